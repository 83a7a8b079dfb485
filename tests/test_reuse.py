"""Reruns own their cache hits: `read_rows(run_id=R)` includes the rows R reused, recorded in one
statement per map, the rows themselves untouched."""

from __future__ import annotations

from runplane.actors import open_run
from runplane.engine.sheets import SheetContract, read_rows, record_reuse, summary
from tests.sheet_helpers import PLAY, counters_match, play_scope, raw_rows

CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
NS = "reused"


async def fail_odd_first_time(row, failed=set()):
    n = int(row["name"][1:])
    if n % 2 and row["name"] not in failed:
        failed.add(row["name"])
        raise ValueError("odd rows fail once")
    return {"score": n}


async def reuse_rows(tenant) -> int:
    async with tenant.connection("sheet") as conn:
        return await conn.fetchval(f'SELECT count(*) FROM "{tenant.schema}".sheet_reuse')


async def keys_of(tenant, run_id):
    rows = await read_rows(tenant, play_scope(tenant), NS, run_id=run_id, limit=10_000)
    return {row["_key"]: row for row in rows}


async def test_a_settled_rerun_lists_the_rows_it_reused_and_touches_none(tenant):
    rows = [{"name": f"n{i}"} for i in range(2_000)]
    failed: set[str] = set()

    async def fn(row):
        return await fail_odd_first_time(row, failed)

    async with open_run(tenant, PLAY, "first") as run:
        result = await run.map(NS, rows, fn, contract=CONTRACT)
    assert (result.completed, result.failed) == (1_000, 1_000)
    assert await reuse_rows(tenant) == 0  # a first run reused nothing
    async with open_run(tenant, PLAY, "second") as run:
        result = await run.map(NS, rows, fn, contract=CONTRACT)
    assert (result.cached, result.completed) == (1_000, 1_000)
    second = await keys_of(tenant, "second")
    assert len(second) == 2_000 and {r["_status"] for r in second.values()} == {"enriched"}
    assert await reuse_rows(tenant) == 1  # one statement for the map
    before = await raw_rows(tenant, play_scope(tenant), NS)
    async with open_run(tenant, PLAY, "third") as run:  # fully settled: probes only
        result = await run.map(NS, rows, fn, contract=CONTRACT)
    assert result.cached == 2_000 and result.completed == 0
    assert await reuse_rows(tenant) == 2
    after = await raw_rows(tenant, play_scope(tenant), NS)
    assert after == before  # runs, write versions, cell meta, row versions: untouched
    assert set(await keys_of(tenant, "third")) == set(second)
    first = await keys_of(tenant, "first")  # what the first run wrote and still holds
    assert len(first) == 1_000 and all(after[k]["_run_id"] == "first" for k in first)
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.completed, s.columns["score"].completed) == (2_000, 2_000)  # reused count once
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


async def test_a_streamed_rerun_and_a_newer_rewrite(tenant):
    rows = [{"name": f"n{i}"} for i in range(300)]

    async def fn(row):
        return {"score": 1}

    async def streamed():
        for row in rows:
            yield row

    async with open_run(tenant, PLAY, "first") as run:
        await run.map(NS, rows, fn, contract=CONTRACT)
    async with open_run(tenant, PLAY, "rerun") as run:
        assert (await run.map(NS, streamed(), fn, contract=CONTRACT)).cached == 300
    assert len(await keys_of(tenant, "rerun")) == 300
    async with open_run(tenant, PLAY, "forced") as run:  # a newer run rewrites 100 rows
        await run.map(NS, rows[:100], fn, contract=CONTRACT, force=True)
    assert len(await keys_of(tenant, "rerun")) == 200  # those are the newer run's now
    assert len(await keys_of(tenant, "forced")) == 100


async def test_record_reuse_checks_keys_and_writes_nothing_for_none(tenant):
    import pytest

    from runplane.engine.errors import InvalidInputError
    from tests.sheet_helpers import new_run

    run = await new_run(tenant, PLAY, "r1")
    assert await record_reuse(tenant, run, NS, []) == 0
    assert await reuse_rows(tenant) == 0
    with pytest.raises(InvalidInputError):
        await record_reuse(tenant, run, NS, ["ok", ""])
    assert await record_reuse(tenant, run, NS, ["a", "a", "b"]) == 2


async def test_keys_that_are_not_row_keys_are_recorded_as_text(tenant):
    from runplane.engine.sheets import RowOutcome, admit, complete
    from tests.sheet_helpers import new_run

    first = await new_run(tenant, PLAY, "first")
    keys = ["A" * 32, "a" * 31, "é-key", "f" * 32]
    await admit(tenant, first, NS, CONTRACT, [{"name": k} for k in keys], keys=keys)
    await complete(tenant, first, NS, CONTRACT, [RowOutcome(k, "completed", {"score": 1})
                                                for k in keys])
    rerun = await new_run(tenant, PLAY, "rerun")
    assert await record_reuse(tenant, rerun, NS, keys) == 4
    assert set(await keys_of(tenant, "rerun")) == set(keys)
    assert await record_reuse(tenant, rerun, NS, ["f" * 32, "0" * 32]) == 2  # as digests
    assert set(await keys_of(tenant, "rerun")) == set(keys)  # "000…" has no row
