"""Datasets: counts and filters, keyset pages in the sheet's order (one index range scan a
page), stability under a concurrent writer, the gateway and database sessions, MapResult.dataset,
Arrow and pandas."""

from __future__ import annotations

import sys

import attrs
import pytest
import trio

from runplane.actors import open_run
from runplane.engine import sheets
from runplane.engine.errors import InvalidInputError
from runplane.engine.gateway import open_gateway
from runplane.engine.sheets import RowOutcome, SheetContract
from runplane.engine.sheets.dataset_pages import Filters, page_statement, resolve
from runplane.engine.sheets.layout import layout_for

from .dataset_support import CONTRACT, NS, fill
from .gateway_support import FAST_RETRY, gateway, server, token_for  # noqa: F401
from .sheet_helpers import new_run, play_scope


async def all_rows(tenant, namespace=NS, run_id=None):
    return await sheets.read_rows(tenant, play_scope(tenant), namespace, run_id=run_id,
                                  limit=10_000)


async def test_counts_and_filters_match_the_rows(tenant):
    scope = play_scope(tenant)
    await fill(tenant, 60, "r1")
    await fill(tenant, 20, "r2", offset=60)
    rows = await all_rows(tenant)
    by_status = {s: [r for r in rows if r["_status"] == s] for s in sheets.dataset_pages.STATUSES}
    assert len(by_status["enriched"]) and len(by_status["failed"]) and len(by_status["pending"])
    every = sheets.dataset(tenant, scope, NS)
    assert await every.count() == 80
    assert await every.materialize() == rows
    for status, expected in by_status.items():
        ds = sheets.dataset(tenant, scope, NS, status=status)
        assert await ds.count() == len(expected)
        assert await ds.materialize() == expected
    r2 = sheets.dataset(tenant, scope, NS, run_id="r2")
    assert await r2.count() == 20
    assert [r["_key"] for r in await r2.materialize()] == [r["_key"] for r in rows[60:]]
    failed_r2 = sheets.dataset(tenant, scope, NS, run_id="r2", status="failed")
    assert await failed_r2.count() == sum(1 for r in rows[60:] if r["_status"] == "failed") > 0
    narrow = sheets.dataset(tenant, scope, NS, fields=["score", "name"])
    first = (await narrow.peek(3))
    assert [list(r) for r in first] == [["score", "name", "_key", "_status", "_error",
                                         "_input_index", "_attempts", "_failed_runs"]] * 3
    assert [r["name"] for r in first] == [r["name"] for r in rows[:3]]
    assert await every.materialize(limit=7) == rows[:7]
    assert await every.materialize(limit=0) == []
    assert await sheets.dataset(tenant, scope, "never_written").count() == 0
    assert await sheets.dataset(tenant, scope, "never_written").materialize() == []


async def test_bad_filters_are_refused_before_any_query(tenant):
    scope = play_scope(tenant)
    for kwargs, word in (({"status": "done"}, "status"), ({"run_id": ""}, "run_id"),
                         ({"fields": "score"}, "fields"), ({"fields": [""]}, "fields")):
        with pytest.raises(InvalidInputError, match=word):
            sheets.dataset(tenant, scope, NS, **kwargs)
    ds = sheets.dataset(tenant, scope, NS)
    with pytest.raises(InvalidInputError, match="page rows"):
        async for _ in ds.iterate(page_rows=0):
            pass
    with pytest.raises(InvalidInputError, match="limit"):
        await ds.materialize(limit=-1)
    await fill(tenant, 3)
    with pytest.raises(InvalidInputError, match="no field 'nope'"):
        await sheets.dataset(tenant, scope, NS, fields=["nope"]).peek()


async def test_pages_follow_the_sheet_order_with_unindexed_rows_last(tenant):
    scope = play_scope(tenant)
    await fill(tenant, 23)
    run = await new_run(tenant, scope.play, "r9")
    await sheets.admit(tenant, run, NS, CONTRACT, [{"name": f"x{i}", "n": i} for i in range(5)])
    # Completed outcomes for keys never admitted are inserted as enriched with no input index.
    await sheets.complete(tenant, run, NS, CONTRACT, [
        RowOutcome(f"orphan-{i}", "completed", data={"score": i}) for i in range(9)])
    rows = await all_rows(tenant)
    assert [r["_input_index"] for r in rows[-9:]] == [None] * 9
    ds = sheets.dataset(tenant, scope, NS)
    for page_rows in (1, 4, 7, 37, 1000):
        seen = [row async for row in ds.iterate(page_rows=page_rows)]
        assert seen == rows, page_rows


def literal(value) -> str:
    """A bind value as SQL text, for `EXECUTE` of a prepared statement (test data only)."""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "ARRAY[" + ", ".join(literal(v) for v in value) + "]"
    return "'" + str(value).replace("'", "''") + "'"


async def test_a_page_is_one_index_range_scan_on_a_big_sheet(tenant):
    scope = play_scope(tenant)
    await fill(tenant, 20_000)
    layout = layout_for(tenant, scope, NS)
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"ANALYZE {layout.qualified}")
        read = await resolve(conn, tenant, layout, Filters())
        first = await sheets.dataset_pages.fetch_page(conn, read, Filters(), None, 1000)
        # Custom plans (as sent), then generic ones (what a prepared statement may switch to
        # after five runs): every one walks the order index, none scans or sorts the sheet.
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        try:
            for filters in (Filters(), Filters(status="failed", run_id="r1")):
                for after in (None, first.after, attrs.evolve(first.after, input_index=None)):
                    sql, values = page_statement(read, filters, after, 1000)
                    custom = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + sql, *values))
                    await conn.execute("PREPARE page_plan AS " + sql)
                    generic = "\n".join(r[0] for r in await conn.fetch(
                        f"EXPLAIN EXECUTE page_plan({', '.join(map(literal, values))})"))
                    await conn.execute("DEALLOCATE page_plan")
                    for plan in (custom, generic):
                        assert f"Index Scan using {layout.table}_ord" in plan, plan
                        assert "Seq Scan" not in plan, plan
                        sorts = [i for i, line in enumerate(plan.splitlines())
                                 if line.strip().startswith(("->  Sort  (", "Sort  ("))]
                        # A run's page merges its two ranges (at most 2 pages of rows) with
                        # one sort on top; no page ever sorts the sheet.
                        assert sorts == ([1] if filters.run_id else []), plan
        finally:
            await conn.execute("RESET plan_cache_mode")


async def test_iteration_under_a_concurrent_writer_has_no_duplicates_and_no_gaps(tenant):
    scope = play_scope(tenant)
    keys = await fill(tenant, 200, "r1")
    first_page_read, writer_done = trio.Event(), trio.Event()

    async def writer():
        await first_page_read.wait()
        # Another run adds rows behind and ahead of the cursor and settles existing ones.
        run = await new_run(tenant, scope.play, "r2")
        new = [{"name": f"new {i}", "n": i} for i in range(300)]
        admission = await sheets.admit(tenant, run, NS, CONTRACT, new, input_offset=5)
        await sheets.complete(tenant, run, NS, CONTRACT, [
            RowOutcome(a.key, "completed", data={"score": 1}) for a in admission.pending[:50]])
        writer_done.set()

    seen: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            async for page in sheets.dataset(tenant, scope, NS).pages(page_rows=25):
                seen += [sheets.frames.loads(line)["_key"] for line in page.lines()]
                if not first_page_read.is_set():
                    first_page_read.set()
                    await writer_done.wait()
    assert len(seen) == len(set(seen)), "a row was read twice"
    assert set(keys) <= set(seen), "a row present when iteration began was skipped"
    assert len(set(seen) - set(keys)) > 0  # rows added ahead of the cursor were read too


async def test_the_gateway_and_database_sessions_read_the_same_rows(tenant, server):
    scope = play_scope(tenant)
    await fill(tenant, 2_500)
    direct = sheets.dataset(tenant, scope, NS, status="enriched", fields=["score", "info"])
    expected = await direct.materialize()
    async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
        over_http = sheets.dataset(gw, scope, NS, status="enriched", fields=["score", "info"])
        assert await over_http.count() == len(expected)
        assert await over_http.materialize() == expected
        assert [r async for r in over_http.iterate(page_rows=333)] == expected
    assert server.requests["sheets.read_page"] >= 7  # pages of 1000 and of 333
    before = server.requests["sheets.read_page"]
    async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY,
                            db_sessions=True) as gw:
        over_session = sheets.dataset(gw, scope, NS, status="enriched", fields=["score", "info"])
        assert await over_session.materialize() == expected
        assert await over_session.count() == len(expected)
    assert server.requests["sheets.read_page"] == before  # the session read straight from PG


async def test_map_result_dataset_holds_the_rows_of_that_run(tenant):
    contract = SheetContract(inputs=("name",), outputs=("upper",))

    async def shout(row):
        if row["name"].startswith("bad"):
            raise ValueError("bad name")
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "mapper", "first") as run:
        first = await run.map("words", [{"name": n} for n in ("a", "b", "bad")], shout,
                              contract=contract)
    async with open_run(tenant, "mapper", "second") as run:
        second = await run.map("words", [{"name": n} for n in ("c", "bad2")], shout,
                               contract=contract)
    assert [r["upper"] for r in await first.dataset.materialize()] == ["A", "B", None]
    assert await first.dataset.count() == 3
    rows = await second.dataset.materialize()
    assert [(r["name"], r["_status"]) for r in rows] == [("c", "enriched"), ("bad2", "failed")]


async def test_arrow_and_pandas_frames(tenant, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    scope = play_scope(tenant)
    await fill(tenant, 50)
    ds = sheets.dataset(tenant, scope, NS)
    rows = await ds.materialize()
    table = await ds.to_arrow(page_rows=7)
    assert table.num_rows == 50
    assert table.schema.names == [*CONTRACT.fields, "_key", "_status", "_error"]
    kinds = await ds.field_kinds()
    assert kinds == {"name": "string", "n": "integer", "score": "float", "info": "json",
                     "tags": "json", "ok": "boolean"}
    assert table.schema.field("n").type == pa.int64()
    assert table.column("_key").to_pylist() == [r["_key"] for r in rows]
    assert table.column("score").to_pylist() == [None if r["score"] is None else float(r["score"])
                                                 for r in rows]
    frame = await ds.to_pandas()
    assert list(frame["_key"]) == [r["_key"] for r in rows]
    assert frame["info"].iloc[0] == rows[0]["info"]
    for module in ("pyarrow", "pandas"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"pip install 'runplane\[frames\]'"):
        await ds.to_arrow()
    with pytest.raises(ImportError, match=r"Dataset.to_pandas needs pandas"):
        await ds.to_pandas()
