"""`force=True`: enriched rows of earlier runs are admitted again and recomputed; `force_failed`:
a failed outcome replaces an enriched row. Counters always equal a COUNT over the sheet."""

from __future__ import annotations

import collections

import pytest

from runplane.actors import open_run
from runplane.cli import main
from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import RowOutcome, SheetContract, admit, complete, probe, summary
from tests.sheet_helpers import PLAY, counters_match, new_run, play_scope, raw_rows
from tests.test_cli import demo_line, schema  # noqa: F401  (the CLI's schema fixture)

CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
NS = "forced"


async def assert_counters(tenant, namespace=NS):
    ok, detail = await counters_match(tenant, play_scope(tenant), namespace)
    assert ok, detail


async def settled_first_run(tenant, names=("a", "b", "c")):
    """A first run: a and b enriched, c failed."""
    first = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, first, NS, CONTRACT, [{"name": n} for n in names])
    keys = [r.key for r in admission.pending]
    await complete(tenant, first, NS, CONTRACT, [
        RowOutcome(keys[0], "completed", {"score": 1}),
        RowOutcome(keys[1], "completed", {"score": 2}),
        RowOutcome(keys[2], "failed", error="boom"),
    ])
    return first, keys


async def test_force_readmits_enriched_rows_at_the_runs_version_and_counters_move(tenant):
    _, (a, b, c) = await settled_first_run(tenant)
    second = await new_run(tenant, PLAY, "r2")
    rows = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    assert (await probe(tenant, second, NS, CONTRACT, rows[:2])).cached == 2  # settled
    assert await probe(tenant, second, NS, CONTRACT, rows[:2], force=True) is None  # to admit
    forced = await admit(tenant, second, NS, CONTRACT, rows, force=True)
    assert [r.key for r in forced.pending] == [a, b, c] and forced.completed == ()
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["score"])
    assert {k: (row["_status"], row["_write_version"]) for k, row in stored.items()} == {
        k: ("pending", second.epoch) for k in (a, b, c)}
    assert stored[a]["score"] == 1  # earlier outputs kept until the recomputed ones land
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.total, s.queued, s.completed, s.failed) == (3, 3, 0, 0)
    await assert_counters(tenant)
    await complete(tenant, second, NS, CONTRACT, [
        RowOutcome(k, "completed", {"score": 10 + i}) for i, k in enumerate((a, b, c))])
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.total, s.queued, s.completed, s.failed) == (3, 0, 3, 0)
    assert s.columns["score"].completed == 3
    await assert_counters(tenant)
    # The same run forced again (a wake): what it recomputed already stays a cache hit.
    again = await admit(tenant, second, NS, CONTRACT, rows, force=True)
    assert again.pending == () and [r.row["score"] for r in again.completed] == [10, 11, 12]
    assert (await probe(tenant, second, NS, CONTRACT, rows, force=True)).cached == 3
    await assert_counters(tenant)


async def test_force_never_takes_rows_of_a_newer_run(tenant):
    _, (a, b, c) = await settled_first_run(tenant)
    older = await new_run(tenant, PLAY, "r2")
    newer = await new_run(tenant, PLAY, "r3")
    await admit(tenant, newer, NS, CONTRACT, [{"name": "a"}], force=True)
    late = await admit(tenant, older, NS, CONTRACT, [{"name": "a"}, {"name": "b"}], force=True)
    assert [(r.key, r.reason) for r in late.blocked] == [(a, "newer_run")]
    assert [r.key for r in late.pending] == [b]
    await assert_counters(tenant)


async def test_force_must_be_a_flag(tenant):
    run = await new_run(tenant, PLAY, "r1")
    with pytest.raises(InvalidInputError, match="force"):
        await admit(tenant, run, NS, CONTRACT, [{"name": "a"}], force="yes")


async def test_run_map_with_force_recomputes_every_row_once(tenant):
    calls: collections.Counter = collections.Counter()

    async def fn(row):
        calls[row["name"]] += 1
        return {"score": calls[row["name"]]}

    rows = [{"name": f"n{i}"} for i in range(300)]
    async with open_run(tenant, PLAY) as run:
        assert (await run.map(NS, rows, fn, contract=CONTRACT)).completed == 300
    async with open_run(tenant, PLAY) as run:
        assert (await run.map(NS, rows, fn, contract=CONTRACT)).cached == 300
    async with open_run(tenant, PLAY, force=True) as run:
        result = await run.map(NS, rows, fn, contract=CONTRACT)
    assert (result.cached, result.completed) == (0, 300)
    assert set(calls.values()) == {2}
    async with open_run(tenant, PLAY) as run:  # a streamed source, forced per map
        async def source():
            for row in rows:
                yield row
        result = await run.map(NS, source(), fn, contract=CONTRACT, force=True)
    assert (result.cached, result.completed) == (0, 300)
    assert set(calls.values()) == {3}
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.total, s.completed, s.queued) == (300, 300, 0)
    await assert_counters(tenant)


def test_demo_force_recomputes_the_cached_rows(schema, capsys):
    args = ["demo", "--rows", "100", "--schema", schema, "--fail-rate", "0"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--force"]) == 0
    forced = demo_line(capsys.readouterr().out)
    assert (forced["cached"], forced["executed"], forced["completed"]) == (0, 100, 100)


@pytest.fixture(params=["returning_old", "snapshot_join"])
def completion_path(request, monkeypatch):
    """Both exact-key completion statements: PostgreSQL >= 18 `RETURNING old` and the snapshot
    join of older servers."""
    from runplane.engine.sheets import completion

    if request.param == "snapshot_join":
        monkeypatch.setattr(completion, "RETURNING_OLD_SINCE", 10**9)
    return request.param


async def test_force_failed_replaces_an_enriched_row_and_its_cells_count_failed(
        tenant, completion_path):
    contract = SheetContract(inputs=("name",), outputs=("score", "tag"))
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, contract, [{"name": "a"}, {"name": "b"}])
    a, b = (r.key for r in admission.pending)
    await complete(tenant, run, NS, contract, [
        RowOutcome(a, "completed", {"score": 1, "tag": "x"}),
        RowOutcome(b, "completed", {"score": 2, "tag": "y"})])
    plain = await complete(tenant, run, NS, contract, [RowOutcome(a, "failed", error="late")])
    assert [f.reason for f in plain.fenced] == ["already_completed"]
    forced = await complete(tenant, run, NS, contract, [RowOutcome(a, "failed", error="bad data")],
                            force_failed=True)
    assert forced.committed_keys == (a,) and forced.fenced == () and forced.updated == 1
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["score"])
    assert stored[a]["_status"] == "failed" and stored[a]["_error"] == "bad data"
    assert {f: m["status"] for f, m in stored[a]["_cell_meta"].items()} == {
        "score": "failed", "tag": "failed"}
    assert stored[b]["_status"] == "enriched"
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.completed, s.failed) == (1, 1)
    assert (s.columns["score"].completed, s.columns["score"].failed) == (1, 1)
    assert (s.columns["tag"].completed, s.columns["tag"].failed) == (1, 1)
    await assert_counters(tenant)
    again = await complete(tenant, run, NS, contract, [RowOutcome(a, "failed", error="bad data")],
                           force_failed=True)
    assert again.committed_keys == (a,) and again.updated == 0  # an identical replay
    newer = await new_run(tenant, PLAY, "r2")
    await admit(tenant, newer, NS, contract, [{"name": "b"}], force=True)
    fenced = await complete(tenant, run, NS, contract, [RowOutcome(b, "failed", error="x")],
                            force_failed=True)
    assert [f.reason for f in fenced.fenced] == ["stale_write_version"]  # still fenced by version
    await assert_counters(tenant)
