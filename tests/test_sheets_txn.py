"""The sheet write transaction: one checkout and a bounded number of round trips per call,
a statement timeout that bounds lock waits, the shared/exclusive column lock, and execution
roles (savepoints inside the checkout's transaction)."""

from __future__ import annotations


import pytest
import trio

from runplane.engine import PlayScope
from runplane.engine.errors import StatementTimeoutError
from runplane.engine.sheets import (
    RowOutcome,
    SheetContract,
    admit,
    complete,
    ensure_sheet,
    read_rows,
    summary,
)
from runplane.engine.sheets import completion as completion_module
from runplane.engine.sheets.layout import layout_for
from runplane.engine.sheets.list_opening import open_list_map
from runplane.simulations.ports import CountingPort, GatedPort
from tests.sheet_helpers import CONTRACT, counters_match, new_run, play_scope, raw_rows

NS = "txn"


async def test_large_calls_take_one_checkout_and_one_statement_per_chunk(tenant):
    run = await new_run(tenant, "play", "r1")
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    port = CountingPort(tenant)
    rows = [{"name": f"n{i}"} for i in range(25_000)]
    admission = await admit(port, run, NS, CONTRACT, rows)
    # BEGIN with its settings, lock + summary row, 3 chunks, COMMIT
    assert port.checkout_count == 1 and port.round_trips == 6, port.statements
    port.reset()
    outcomes = [RowOutcome(r.key, "completed", {"score": i}) for i, r in enumerate(admission.pending)]
    result = await complete(port, run, NS, CONTRACT, outcomes)
    assert result.updated == 25_000
    assert port.checkout_count == 1 and port.round_trips == 6, port.statements


async def test_statement_timeout_bounds_a_lock_wait_and_writes_nothing(tenant, monkeypatch):
    run = await new_run(tenant, "play", "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    layout = layout_for(tenant, play_scope(tenant), NS)
    monkeypatch.setattr(completion_module, "COMPLETE_STATEMENT_TIMEOUT_MS", 200)
    before = await raw_rows(tenant, play_scope(tenant), NS, ["score"])
    async with tenant.connection("retirement") as blocker:
        async with blocker.transaction():
            await blocker.execute(  # the sheet lock: its summary row
                f'SELECT 1 FROM "{tenant.schema}".sheet_summary WHERE org_id = $1 AND play = $2'
                " AND table_namespace = $3 FOR UPDATE", *layout.counter_args)
            with trio.fail_after(10), pytest.raises(StatementTimeoutError):
                await complete(tenant, run, NS, CONTRACT, [RowOutcome(key, "completed", {"score": 1})])
    assert await raw_rows(tenant, play_scope(tenant), NS, ["score"]) == before


async def _waiting_for_a_lock(tenant, locktype: str | None = None) -> bool:
    async with tenant.connection("retirement") as conn:
        return await conn.fetchval(
            "SELECT count(*) > 0 FROM pg_locks WHERE NOT granted AND ($1::text IS NULL OR locktype = $1)",
            locktype,
        )


async def test_column_extension_waits_for_shared_writers(tenant):
    run = await new_run(tenant, "play", "r1")
    scope = play_scope(tenant)
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    a, b = (r.key for r in admission.pending)
    writer = GatedPort(tenant)
    parked = writer.gate_query(4)  # BEGIN, settings, lock: parked before its chunk statement
    results = {}

    async def shared_writer():
        results["writer"] = await complete(writer, run, NS, CONTRACT,
                                           [RowOutcome(a, "completed", {"score": 1})])

    async def extender():
        results["extender"] = await complete(
            tenant, run, NS, CONTRACT, [RowOutcome(b, "completed", {"score": 2, "new field": "x"})]
        )

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shared_writer)
            await parked.wait_reached()
            nursery.start_soon(extender)
            # The extender queues behind the parked writer (on the sheet's summary row); once
            # the writer commits it finds no column under the shared lock, rolls back, and
            # retries under the exclusive lock.
            while not await _waiting_for_a_lock(tenant):
                await trio.sleep(0.01)
            assert "extender" not in results
            parked.release()
    assert results["writer"].committed_keys == (a,)
    assert results["extender"].committed_keys == (b,)
    assert results["extender"].diagnostics.column_retries == 1
    stored = await raw_rows(tenant, scope, NS, ["score", "new field"])
    assert (stored[a]["score"], stored[b]["score"], stored[b]["new field"]) == (1, 2, "x")
    ok, detail = await counters_match(tenant, scope, NS)
    assert ok, detail


async def test_under_an_execution_role_sheets_work_inside_the_checkout_transaction(role_tenant):
    assert role_tenant.outer_transaction
    scope = PlayScope("org-test", "play")
    run = await new_run(role_tenant, "play", "r1")
    admission = await admit(role_tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    a, b = (r.key for r in admission.pending)
    port = CountingPort(role_tenant)
    result = await complete(port, run, NS, CONTRACT, [
        RowOutcome(a, "completed", {"score": 1, "extra": True}),  # extends the sheet
        RowOutcome(b, "failed", error="no"),
    ])
    assert result.committed_keys == (a, b)
    assert result.diagnostics.column_retries == 1
    assert any(s.startswith("SAVEPOINT") for s in port.statements)
    s = await summary(role_tenant, scope, NS)
    assert (s.total, s.completed, s.failed) == (2, 1, 1)
    ok, detail = await counters_match(role_tenant, scope, NS)
    assert ok, detail


async def test_ensure_sheet_waits_for_shared_writers_on_the_exclusive_lock(tenant):
    run = await new_run(tenant, "play", "r1")
    scope = play_scope(tenant)
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    writer = GatedPort(tenant)
    parked = writer.gate_query(4)
    done = {}

    async def shared_writer():
        done["writer"] = await complete(writer, run, NS, CONTRACT,
                                        [RowOutcome(key, "completed", {"score": 1})])

    async def extend():
        wider = SheetContract(inputs=("name",), outputs=("score", "later"))
        done["layout"] = await ensure_sheet(tenant, scope, NS, wider)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shared_writer)
            await parked.wait_reached()
            nursery.start_soon(extend)
            # the summary row the writer claimed, then the exclusive lock
            while not await _waiting_for_a_lock(tenant):
                await trio.sleep(0.01)
            assert "layout" not in done
            parked.release()
    assert done["writer"].committed_keys == (key,)
    assert set((await summary(tenant, scope, NS)).columns) == {"score", "later"}


async def test_ensure_sheet_of_a_known_contract_takes_the_shared_lock_and_sends_no_ddl(tenant):
    """Every map starts with `ensure_sheet`: once its fields are registered it creates nothing
    and takes the shared lock (BEGIN with its settings, lock, column counters, COMMIT)."""
    scope = play_scope(tenant)
    await ensure_sheet(tenant, scope, NS, CONTRACT)
    counted = CountingPort(tenant)
    await ensure_sheet(counted, scope, NS, CONTRACT)
    sent = " ".join(counted.statements)
    assert "pg_advisory" not in sent  # the sheet lock is its summary row (no advisory key)
    assert "CREATE TABLE" not in sent and "ALTER TABLE" not in sent, counted.statements
    assert counted.round_trips == 4, counted.statements
    wider = SheetContract(inputs=("name",), outputs=("score", "later"))
    counted.reset()
    await ensure_sheet(counted, scope, NS, wider)  # a new field: the exclusive path adds it
    assert "ALTER TABLE" in " ".join(counted.statements)
    # in the same transaction, no rollback: BEGIN, lock, one read, the DDL, the field's
    # registration, column counters, COMMIT
    assert not any(s.startswith("ROLLBACK") for s in counted.statements), counted.statements
    assert counted.round_trips == 7, counted.statements
    assert "pg_advisory" not in " ".join(counted.statements)
    assert set((await summary(tenant, scope, NS)).columns) == {"score", "later"}


async def test_a_new_sheet_is_made_in_its_first_transaction_with_one_message_of_ddl(tenant):
    """A sheet's first write finds no registered column and goes on under the exclusive path in
    the same transaction (no rollback, no second BEGIN); its table is created with every column
    and both indexes in one message."""
    run = await new_run(tenant, "play", "r1")
    counted = CountingPort(tenant)
    admission = await admit(counted, run, NS, CONTRACT, [{"name": "a"}])
    assert not any(s.startswith("ROLLBACK") for s in counted.statements), counted.statements
    assert sum(s.startswith("BEGIN") for s in counted.statements) == 1
    [ddl] = [s for s in counted.statements if "CREATE TABLE" in s]
    assert ddl.count("CREATE INDEX") == 2 and "ALTER TABLE" not in ddl
    [key] = [r.key for r in admission.pending]
    await complete(tenant, run, NS, CONTRACT, [RowOutcome(key, "completed", {"score": 7})])
    assert (await raw_rows(tenant, play_scope(tenant), NS, ["score"]))[key]["score"] == 7


async def test_a_list_maps_opening_ensures_the_sheet_only_when_it_is_not_ready(tenant):
    """A list map's opening (the gateway's `open_list_map`) reads in one statement whether the
    sheet is ready for the contract, with its row total: a ready sheet opens with that read
    and the manifest's, no transaction; a new sheet, a new field or a missing index sends it
    through `ensure_sheet`, which makes what is missing."""
    run = await new_run(tenant, "play", "r1")
    scope = run.scope.map(NS, "map-1")
    counted = CountingPort(tenant)
    first = await open_list_map(counted, scope, CONTRACT, count_rows=True)
    assert first.sheet_rows == 0 and any(s.startswith("BEGIN") for s in counted.statements)
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    assert len(admission.pending) == 2
    counted.reset()
    again = await open_list_map(counted, scope, CONTRACT, count_rows=True)
    assert again.sheet_rows == 2 and again.layout == first.layout
    assert counted.round_trips == 2, counted.statements  # readiness and total, the manifest
    assert not any(s.startswith("BEGIN") for s in counted.statements)
    wider = SheetContract(inputs=("name",), outputs=("score", "later"))
    counted.reset()
    await open_list_map(counted, scope, wider)
    assert any("ALTER TABLE" in s for s in counted.statements), counted.statements
    assert set((await summary(tenant, play_scope(tenant), NS)).columns) == {"score", "later"}
    async with tenant.connection("sheet") as conn:  # an index lost: not ready, and remade
        await conn.execute(f"DROP INDEX {first.layout.cause_index}")
    counted.reset()
    await open_list_map(counted, scope, wider)
    assert any(s.startswith("BEGIN") for s in counted.statements)
    counted.reset()
    await open_list_map(counted, scope, wider)
    assert not any(s.startswith("BEGIN") for s in counted.statements), counted.statements


async def test_completion_chunks_by_patch_bytes_in_one_transaction(tenant):
    run = await new_run(tenant, "play", "r1")
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": f"n{i}"} for i in range(10)])
    big = "x" * (300 * 1024)  # ten 300 KiB patches: at most six fit under 2 MiB
    port = CountingPort(tenant)
    result = await complete(port, run, NS, CONTRACT, [
        RowOutcome(r.key, "completed", {"score": big}) for r in admission.pending
    ])
    assert result.updated == 10 and result.diagnostics.chunks == 2
    assert port.checkout_count == 1
    assert sum(s.startswith("BEGIN") for s in port.statements) == 1
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["score"])
    assert all(row["score"] == big for row in stored.values())


async def test_missing_sheet_and_registry_self_heal(tenant):
    scope = play_scope(tenant)
    run = await new_run(tenant, "play", "r1")
    await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])
    layout = layout_for(tenant, scope, NS)
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"DROP TABLE {layout.qualified}")
        await conn.execute(f'DROP TABLE "{tenant.schema}".sheet_columns')
        await conn.execute(f'DELETE FROM "{tenant.schema}".sheet_summary')
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    assert admission.inserted == 2
    result = await complete(tenant, run, NS, CONTRACT,
                            [RowOutcome(admission.pending[0].key, "completed", {"score": 1})])
    assert result.updated == 1
    rows = {row["_key"]: row for row in await read_rows(tenant, scope, NS)}
    assert rows[admission.pending[0].key]["score"] == 1
    ok, detail = await counters_match(tenant, scope, NS)
    assert ok, detail
