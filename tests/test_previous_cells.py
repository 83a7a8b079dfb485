"""Previous cells (seed leftovers): a re-admitted row carries the output cells it completed in
an earlier run (`row["_previous"]`, within a byte budget per admission call), and a function
can store some outputs and fail the rest (`actors.RowError`) — in-process and through the
gateway."""

from __future__ import annotations

import collections
import datetime

import pytest

from runplane.actors import RowError, open_run
from runplane.engine import sheets
from runplane.engine.errors import InvalidInputError
from runplane.engine.gateway import open_gateway

from .gateway_support import FAST_RETRY, serving, token_for
from .sheet_helpers import new_run, play_scope

pytestmark = pytest.mark.usefixtures("tenant")

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("first", "second"))
NS = "prev"


def two_outputs(seen: list, *, second_fails: bool):
    """A function computing `first` (unless the previous cells hold it) then `second`, which
    fails with `RowError` keeping `first` while `second_fails`."""
    calls: collections.Counter = collections.Counter()

    async def fn(row):
        seen.append(row.get("_previous"))
        previous = row.get("_previous") or {}
        if "first" in previous:
            first = previous["first"]
        else:
            calls["first"] += 1
            first = row["name"].upper()
        if second_fails:
            raise RowError(f"second failed for {row['name']}", outputs={"first": first})
        calls["second"] += 1
        return {"first": first, "second": len(row["name"])}

    return fn, calls


async def _by_name(port, cells: bool = False) -> dict[str, dict]:
    found = await sheets.read_rows(port, play_scope(port, "play"), NS, cells=cells)
    return {row["name"]: row for row in found}


async def test_a_rerun_reads_the_output_a_row_error_stored_and_skips_it(tenant):
    rows = [{"name": "ada"}, {"name": "bob"}]
    seen: list = []
    fn, calls = two_outputs(seen, second_fails=True)
    async with open_run(tenant, "play") as run:
        result = await run.map(NS, rows, fn, contract=CONTRACT, previous_cells=True)
    assert (result.completed, result.failed) == (0, 2)
    assert seen == [{}, {}]  # new rows: nothing before
    assert calls == {"first": 2}
    stored = await _by_name(tenant, cells=True)
    ada = stored["ada"]
    # `first` is a completed cell of the failed row, `second` a failed one
    assert ada["_status"] == "failed" and ada["first"] == "ADA" and ada["second"] is None
    assert ada["_error"] == "second failed for ada"
    # the seed's cell meta (status, completedAt, runId, attempts, the value) as `_cells`
    first, second = ada["_cells"]["first"], ada["_cells"]["second"]
    assert datetime.datetime.fromisoformat(first.pop("completed_at")).tzinfo is not None
    assert first == {"status": "completed", "run_id": run.run_id, "attempts": 1,
                     "last_value": "ADA"}
    assert second == {"status": "failed", "completed_at": None, "run_id": run.run_id,
                      "attempts": 1, "last_value": None}
    summary = await sheets.summary(tenant, play_scope(tenant, "play"), NS)
    assert (summary.failed, summary.columns["first"].completed,
            summary.columns["second"].failed) == (2, 2, 2)

    seen.clear()
    fn, calls = two_outputs(seen, second_fails=False)
    async with open_run(tenant, "play") as rerun:
        result = await rerun.map(NS, rows, fn, contract=CONTRACT, previous_cells=True)
    assert (result.completed, result.failed) == (2, 0)
    assert sorted(seen, key=str) == [{"first": "ADA"}, {"first": "BOB"}]
    assert calls == {"second": 2}  # `first` read from the previous cells, not recomputed
    stored = await _by_name(tenant)
    assert {n: (r["_status"], r["first"], r["second"]) for n, r in stored.items()} == {
        "ada": ("enriched", "ADA", 3), "bob": ("enriched", "BOB", 3)}


async def test_without_the_option_a_rerun_sees_its_inputs_only(tenant):
    rows = [{"name": "ada"}]
    seen: list = []
    fn, _ = two_outputs(seen, second_fails=True)
    async with open_run(tenant, "play") as run:
        await run.map(NS, rows, fn, contract=CONTRACT)
    seen.clear()
    fn, calls = two_outputs(seen, second_fails=False)
    async with open_run(tenant, "play") as rerun:
        await rerun.map(NS, rows, fn, contract=CONTRACT)
    assert seen == [None] and calls == {"first": 1, "second": 1}


async def test_cells_past_the_budget_are_marked_truncated(tenant, monkeypatch):
    scope = play_scope(tenant, "play")
    run = await new_run(tenant, "play", "r1")
    names = [f"n{i}" for i in range(6)]
    admission = await sheets.admit(tenant, run, NS, CONTRACT, [{"name": n} for n in names])
    outcomes = [sheets.RowOutcome(row.key, "failed", data={"first": "x" * 10}, error="no",
                                  cell_meta={"first": {"status": "completed"}})
                for row in admission.pending]
    await sheets.complete(tenant, run, NS, CONTRACT, outcomes)

    rerun = await new_run(tenant, "play", "r2")
    # each row's cells cost 12 bytes ("xxxxxxxxxx" as JSON text): 30 bytes hold two rows
    again = await sheets.admit(tenant, rerun, NS, CONTRACT, [{"name": n} for n in names],
                               previous_cells=True, previous_cells_budget_bytes=30)
    got = [row.row["_previous"] for row in again.pending]
    assert got == [{"first": "x" * 10}] * 2 + [{"_truncated": True}] * 4
    # the budget is the call's: with chunks of 4 rows the second chunk gets what is left
    rerun3 = await new_run(tenant, "play", "r3")
    from runplane.engine.sheets import admission as admission_module

    monkeypatch.setattr(admission_module, "ADMIT_CHUNK_ROWS", 4)
    again = await sheets.admit(tenant, rerun3, NS, CONTRACT, [{"name": n} for n in names],
                               previous_cells=True, previous_cells_budget_bytes=5 * 12)
    assert [row.row["_previous"] for row in again.pending] == \
        [{"first": "x" * 10}] * 5 + [{"_truncated": True}]
    # the previous cells are the admission's answer only: a read does not show them
    assert all("_previous" not in row for row in await sheets.read_rows(tenant, scope, NS))


async def test_budget_and_option_are_checked_before_any_query(tenant):
    run = await new_run(tenant, "play", "r1")
    with pytest.raises(InvalidInputError, match="previous_cells_budget_bytes"):
        await sheets.admit(tenant, run, NS, CONTRACT, [{"name": "a"}], previous_cells=True,
                           previous_cells_budget_bytes=-1)
    with pytest.raises(InvalidInputError, match="previous_cells"):
        async with open_run(tenant, "play") as run2:
            await run2.map(NS, [{"name": "a"}], lambda row: {}, contract=CONTRACT,
                           previous_cells="yes")
    async with open_run(tenant, "play") as run3:
        with pytest.raises(InvalidInputError, match="workers"):
            await run3.map(NS, [{"name": "a"}], lambda row: {}, contract=CONTRACT,
                           previous_cells=True, workers=2)


async def test_through_the_gateway_a_rerun_gets_the_same_previous_cells(tenant):
    rows = [{"name": "ada"}, {"name": "bob"}]
    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
            seen: list = []
            fn, _ = two_outputs(seen, second_fails=True)
            async with open_run(gateway, "play") as run:
                result = await run.map(NS, rows, fn, contract=CONTRACT, previous_cells=True)
            assert result.failed == 2
            seen.clear()
            fn, calls = two_outputs(seen, second_fails=False)
            async with open_run(gateway, "play") as rerun:
                result = await rerun.map(NS, rows, fn, contract=CONTRACT, previous_cells=True)
            assert result.completed == 2 and calls == {"second": 2}
            assert sorted(seen, key=str) == [{"first": "ADA"}, {"first": "BOB"}]
            # the action itself (pending rows answered by key): a forced admission hands out
            # the cells as they were before it marked them pending, within the call's budget
            # ("ADA" and 3 cost 6 bytes)
            run3 = await new_run(tenant, "play", "r3")
            forced = await sheets.admit(gateway, run3, NS, CONTRACT, rows, force=True,
                                        previous_cells=True, previous_cells_budget_bytes=6)
    assert [row.row for row in forced.pending] == [
        {"name": "ada", "_previous": {"first": "ADA", "second": 3}},
        {"name": "bob", "_previous": {"_truncated": True}}]
