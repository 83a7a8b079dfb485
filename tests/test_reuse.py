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


async def test_a_datasets_rows_of_a_run_include_the_rows_it_reused(tenant):
    from runplane.engine import sheets

    rows = [{"name": f"n{i}"} for i in range(1_500)]
    failed: set[str] = set()

    async def fn(row):
        return await fail_odd_first_time(row, failed)

    async with open_run(tenant, PLAY, "first") as run:
        await run.map(NS, rows, fn, contract=CONTRACT)
    async with open_run(tenant, PLAY, "second") as run:  # reuses 750, recomputes 750
        assert (await run.map(NS, rows, fn, contract=CONTRACT)).cached == 750
    async with open_run(tenant, PLAY, "forced") as run:  # rewrites 100 reused and 100 not
        await run.map(NS, rows[:200], fn, contract=CONTRACT, force=True)
    scope = play_scope(tenant)
    second = sheets.dataset(tenant, scope, NS, run_id="second")
    expected = await read_rows(tenant, scope, NS, run_id="second", limit=10_000)
    assert len(expected) == 1_300  # 1,500 minus the 200 the forced run rewrote since
    assert await second.count() == 1_300
    for page_rows in (7, 1000):
        assert [r async for r in second.iterate(page_rows=page_rows)] == expected
    assert await sheets.dataset(tenant, scope, NS, run_id="second", status="failed").count() == 0
    assert await sheets.dataset(tenant, scope, NS, run_id="first").count() == 650
    assert await sheets.dataset(tenant, scope, NS, run_id="forced").count() == 200
    assert (await sheets.dataset(tenant, scope, NS, run_id="second").field_kinds()) == {
        "name": "string", "score": "integer"}
    lines: list[bytes] = []

    async def collect(chunk: bytes) -> None:
        lines.append(chunk)

    assert await second.copy_lines(collect)
    assert b"".join(lines).count(b"\n") == 1_300


async def test_a_runs_page_filters_the_sheet_in_its_order_with_a_hashed_key_set(tenant):
    from runplane.engine.sheets import record_reuse as record
    from runplane.engine.sheets.dataset_pages import Filters, fetch_page, page_statement, resolve
    from runplane.engine.sheets.layout import layout_for
    from tests.dataset_support import NS as BIG, fill
    from tests.sheet_helpers import new_run

    keys = await fill(tenant, 20_000, "first")
    rerun = await new_run(tenant, PLAY, "rerun")
    await record(tenant, rerun, BIG, keys)
    scope = play_scope(tenant)
    layout = layout_for(tenant, scope, BIG)
    filters = Filters(run_id="rerun")
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"ANALYZE {layout.qualified}")
        read = await resolve(conn, tenant, layout, filters)
        first = await fetch_page(conn, read, filters, None, 1000)
        assert first.rows == 1000
        for after in (None, first.after):
            sql, values = page_statement(read, filters, after, 1000)
            plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + sql, *values))
            assert f"Index Scan using {layout.table}_ord" in plan, plan
            assert "hashed SubPlan" in plan, plan  # the recorded keys: one hash a statement
            assert f"Seq Scan on {layout.table}" not in plan, plan
