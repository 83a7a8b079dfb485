"""Write modes: `append_rows` (every row new, a retried append adds nothing twice, input indexes
continue) and `replace_rows` (the table's rows replaced in one transaction, counters exact)."""

from __future__ import annotations

import pytest

from runplane.engine.actions import actions
from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import (
    RowOutcome, SheetContract, admit, append_rows, complete, read_rows, replace_rows, summary,
)
from tests.sheet_helpers import PLAY, counters_match, new_run, play_scope, raw_rows

CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
NS = "modes"


async def assert_counters(tenant):
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


async def test_append_adds_every_row_as_new_and_a_retry_adds_nothing_twice(tenant):
    run = await new_run(tenant, PLAY, "r1")
    first = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}], input_offset=4)
    await complete(tenant, run, NS, CONTRACT, [RowOutcome(first.pending[0].key, "completed",
                                                          {"score": 1})])
    rows = [{"name": "a"}, {"name": "c"}, {"name": "c"}]  # a duplicate is a row of its own
    appended = await append_rows(tenant, run, NS, CONTRACT, rows, idempotency_key="batch-1")
    assert appended.inserted == 3 and appended.skipped == 0 and appended.completed == ()
    assert [(r.row["name"], r.input_index) for r in appended.pending] == [
        ("a", 6), ("c", 7), ("c", 8)]  # continuing from the sheet's largest input index (5)
    assert len({r.key for r in appended.pending}) == 3
    assert not {r.key for r in appended.pending} & {r.key for r in first.pending}
    retried = await append_rows(tenant, run, NS, CONTRACT, rows, idempotency_key="batch-1")
    assert retried.inserted == 0
    assert [(r.key, r.input_index) for r in retried.pending] == [
        (r.key, r.input_index) for r in appended.pending]
    other = await append_rows(tenant, run, NS, CONTRACT, rows[:1], idempotency_key="batch-2")
    assert other.inserted == 1 and other.pending[0].input_index == 9
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.total, s.queued, s.completed) == (6, 5, 1)
    await assert_counters(tenant)
    names = [(r["name"], r["_input_index"]) for r in await read_rows(tenant, play_scope(tenant), NS)]
    assert names == [("a", 4), ("b", 5), ("a", 6), ("c", 7), ("c", 8), ("a", 9)]


async def test_append_into_a_new_sheet_starts_at_zero_and_checks_its_key(tenant):
    run = await new_run(tenant, PLAY, "r1")
    appended = await append_rows(tenant, run, NS, CONTRACT, [{"name": "x"}], idempotency_key="k")
    assert [r.input_index for r in appended.pending] == [0]
    for bad in ("", None, 5):
        with pytest.raises(InvalidInputError, match="idempotency_key"):
            await append_rows(tenant, run, NS, CONTRACT, [{"name": "x"}], idempotency_key=bad)
    with pytest.raises(InvalidInputError):
        await append_rows(tenant, run, NS, CONTRACT, {"name": "x"}, idempotency_key="k")
    assert (await append_rows(tenant, run, NS, CONTRACT, [], idempotency_key="k")).inserted == 0


async def test_replace_rows_replaces_the_table_and_resets_counters_exactly(tenant):
    old = await new_run(tenant, PLAY, "r1")
    first = await admit(tenant, old, NS, CONTRACT, [{"name": n} for n in "abc"])
    a, b, c = (r.key for r in first.pending)
    await complete(tenant, old, NS, CONTRACT, [
        RowOutcome(a, "completed", {"score": 1}), RowOutcome(b, "failed", error="x")])
    run = await new_run(tenant, PLAY, "r2")
    replaced = await replace_rows(tenant, run, NS, CONTRACT,
                                  [{"name": "a"}, {"name": "d"}, {"name": "a"}])
    assert replaced.inserted == 2 and replaced.skipped == 1 and replaced.completed == ()
    assert [(r.row["name"], r.input_index) for r in replaced.pending] == [("a", 0), ("d", 1)]
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["name", "score"])
    assert set(stored) == {a, replaced.pending[1].key}
    assert stored[a]["_status"] == "pending" and stored[a]["score"] is None  # outputs gone
    assert stored[a]["_write_version"] == run.epoch and stored[a]["_cell_meta"] == {}
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.total, s.queued, s.completed, s.failed) == (2, 2, 0, 0)
    assert (s.columns["score"].completed, s.columns["score"].failed) == (0, 0)
    await assert_counters(tenant)
    emptied = await replace_rows(tenant, run, NS, CONTRACT, [])
    assert emptied.inserted == 0
    assert (await summary(tenant, play_scope(tenant), NS)).total == 0
    assert await read_rows(tenant, play_scope(tenant), NS) == []
    await assert_counters(tenant)


async def test_replace_into_a_sheet_not_created_yet(tenant):
    run = await new_run(tenant, PLAY, "r1")
    replaced = await replace_rows(tenant, run, "fresh", CONTRACT, [{"name": "a"}])
    assert replaced.inserted == 1


def test_both_are_actions():
    assert {"sheets.append_rows", "sheets.replace_rows"} <= set(actions())
