"""Connections under real network faults (a PostgreSQL wire proxy, `tests.pg_proxy`): stale
pooled connections, statements that failed without the server's answer, lost COMMIT replies."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from runplane.actors import open_run
from runplane.actors.retry import OutageWatch, retry_transient
from runplane.engine import open_tenant
from runplane.engine.errors import DatabaseError, StoreUnavailableError
from runplane.engine.sheets import SheetContract
from runplane.engine.sheets.layout import layout_for

from .pg_proxy import open_pg_proxy
from .sheet_helpers import counters_match, play_scope


async def select_one(tenant, lane: str) -> int:
    async with tenant.connection(lane) as conn:
        return await conn.fetchval("SELECT 1")


async def _terminate(tenant, pids) -> None:
    async with tenant.connection("receipts") as admin:
        for pid in pids:
            await admin.fetchval("SELECT pg_terminate_backend($1)", pid)


async def test_a_pooled_connection_whose_backend_was_terminated_while_idle_is_replaced(dsn, tenant):
    """The driver read the server's farewell to an idle pooled connection but has not seen the
    socket close (the proxy holds it open): its protocol is busy ("another operation is in
    progress") though the connection looks open. The next checkout must not fail on it."""
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-test", proxy.dsn, schema=tenant.schema) as proxied:
            async with proxied.connection("receipts") as a, proxied.connection("sheet") as b:
                pids = {a.backend_pid, b.backend_pid}
            (_, probe), (_, stale) = proxied._idle
            proxy.hold_close = True
            await _terminate(tenant, pids)
            with trio.fail_after(10):
                while proxy.closes_held < 2:
                    await proxy.close_held.wait()
            # The farewell is in the client's socket: let the driver read it (the close is held).
            await trio.testing.wait_all_tasks_blocked(cushion=0.1)
            assert not probe.is_closed() and not stale.is_closed()
            # The forced state, shown on one of them through the bare driver:
            proxied._idle[:] = [entry for entry in proxied._idle if entry[1] is not probe]
            with pytest.raises(Exception, match="another operation .* is in progress"):
                await proxied.driver.call(probe.fetchval("SELECT 1"))
            probe.terminate()
            # The other one is what the pool hands out next: replaced, not failed.
            async with proxied.connection("receipts") as conn:
                assert await conn.fetchval("SELECT 41 + 1") == 42
                assert conn.backend_pid not in pids
            assert stale.is_closed() and proxied._idle and proxied._idle[0][1] is not stale
            proxy.release_close()


async def test_a_statement_the_server_rejected_keeps_its_connection(tenant):
    async with tenant.connection("receipts") as conn:
        pid = conn.backend_pid
        with pytest.raises(DatabaseError):
            await conn.fetchval("SELECT 1 / 0")
        assert not conn.broken
    async with tenant.connection("receipts") as conn:
        assert conn.backend_pid == pid


async def test_a_cancelled_statement_never_returns_its_connection_to_the_pool(tenant):
    async with tenant.connection("receipts") as conn:
        pid = conn.backend_pid
        with trio.move_on_after(0.2):
            await conn.fetchval("SELECT pg_sleep(30)")
        assert conn.broken
        with pytest.raises(StoreUnavailableError):
            await conn.fetchval("SELECT 1")
    async with tenant.connection("receipts") as conn:
        assert conn.backend_pid != pid
        assert await conn.fetchval("SELECT 1") == 1


async def test_a_lost_connection_mid_operation_is_never_reused(dsn, tenant):
    """Backends terminated while in use and while idle, again and again (every 20 ms): every
    checkout either works or fails with StoreUnavailableError; the tenant stays usable."""
    async with open_tenant("org-test", dsn, schema=tenant.schema) as victim:
        errors: list[str] = []

        async def worker():
            for _ in range(40):
                try:
                    async with victim.connection("receipts") as conn:
                        await conn.fetchval("SELECT pg_sleep(0.005)")
                except StoreUnavailableError as exc:
                    errors.append(str(exc))

        async def killer():
            for _ in range(20):
                await trio.sleep(0.02)
                async with tenant.connection("sheet") as admin:
                    await admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE application_name = 'runplane' AND pid <> pg_backend_pid() "
                        "AND backend_type = 'client backend' AND query NOT ILIKE '%pg_terminate%'")

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(worker)
            nursery.start_soon(killer)
        # A connection whose backend ended while it was idle is replaced on its first statement,
        # or (when that happens twice in a row) reported as such, never as a driver-state error.
        leaked = [e for e in errors if "another operation" in e
                  and not e.startswith("the server ended the connection before the statement ran")]
        assert not leaked, leaked
        # The last kill may have reached pooled connections the driver has not heard from yet.
        assert await retry_transient(lambda: select_one(victim, "receipts")) == 1


async def _counter_table(tenant) -> str:
    name = f'"{tenant.schema}".outage_counter'
    async with tenant.connection("receipts") as conn:
        await conn.execute(f"CREATE TABLE {name} (n int NOT NULL)")
        await conn.execute(f"INSERT INTO {name} VALUES (0)")
    return name


class Bump:
    """`n = n + 1` on the counter table in one transaction through `port`, counting its calls."""

    def __init__(self, port, counter: str) -> None:
        self.port, self.counter, self.calls = port, counter, 0

    async def __call__(self) -> None:
        self.calls += 1
        async with self.port.connection("receipts") as conn:
            async with conn.transaction():
                await conn.execute(f"UPDATE {self.counter} SET n = n + 1")


async def bump_once_through_a_lost_commit_reply(proxy, proxied, counter: str) -> None:
    """Run `n = n + 1` in a transaction whose COMMIT reply the proxy drops, under the outage
    retry: the bump must have been called exactly once (its commit was resolved, not re-run)."""
    bump = Bump(proxied, counter)
    proxy.drop_commit_reply = 1
    await retry_transient(bump, watch=OutageWatch(10.0))
    assert proxy.fired == {"drop_commit_reply": 1}
    assert bump.calls == 1


async def test_a_lost_commit_reply_is_detected_and_not_applied_twice(dsn, tenant):
    """A non-idempotent transaction (n = n + 1): the server commits, the reply never arrives.
    The transaction's fate is read on a fresh connection: committed, so it is not run again."""
    counter = await _counter_table(tenant)
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-test", proxy.dsn, schema=tenant.schema) as proxied:
            await bump_once_through_a_lost_commit_reply(proxy, proxied, counter)
    async with tenant.connection("receipts") as conn:
        assert await conn.fetchval(f"SELECT n FROM {counter}") == 1


async def test_a_commit_past_its_deadline_is_resolved_too(dsn, tenant, monkeypatch):
    """The COMMIT's reply comes later than `COMMIT_TIMEOUT` (shortened here): the connection is
    dropped and the transaction's fate read instead of retrying blindly."""
    from runplane.engine.pg import connection

    monkeypatch.setattr(connection, "COMMIT_TIMEOUT", 0.3)
    counter = await _counter_table(tenant)
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-test", proxy.dsn, schema=tenant.schema) as proxied:
            bump = Bump(proxied, counter)
            proxy.delay_commit_reply, proxy.commit_reply_delay_s = 1, 3.0
            await retry_transient(bump, watch=OutageWatch(10.0))
            assert proxy.fired == {"delay_commit_reply": 1}
            assert bump.calls == 1
    async with tenant.connection("receipts") as conn:
        assert await conn.fetchval(f"SELECT n FROM {counter}") == 1


async def test_a_lost_commit_request_is_rolled_back_and_retried_once(dsn, tenant):
    counter = await _counter_table(tenant)
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-test", proxy.dsn, schema=tenant.schema) as proxied:
            bump = Bump(proxied, counter)
            proxy.drop_commit_request = 1
            with pytest.raises(StoreUnavailableError, match="rolled back"):
                await bump()
            await retry_transient(bump, watch=OutageWatch(10.0))
            assert proxy.fired == {"drop_commit_request": 1}
            assert bump.calls == 2
    async with tenant.connection("receipts") as conn:
        assert await conn.fetchval(f"SELECT n FROM {counter}") == 1


async def test_a_map_whose_commit_replies_are_lost_finishes_every_row_once(dsn, tenant):
    contract = SheetContract(inputs=("name",), outputs=("score",))
    rows = [{"name": f"row-{i}"} for i in range(3000)]
    calls: dict[str, int] = {}

    async def fn(row):
        calls[row["name"]] = calls.get(row["name"], 0) + 1
        return {"score": len(row["name"])}

    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-test", proxy.dsn, schema=tenant.schema) as proxied:
            proxy.drop_commit_reply = 6
            async with open_run(proxied, "play") as run:
                result = await run.map("ns", rows, fn, contract=contract, concurrency=8,
                                       batch_rows=200)
            assert proxy.fired["drop_commit_reply"] == 6
    assert result.completed == len(rows) and result.failed == 0
    assert all(count == 1 for count in calls.values()) and len(calls) == len(rows)
    layout = layout_for(tenant, play_scope(tenant), "ns")
    async with tenant.connection("sheet") as conn:
        stored = await conn.fetchrow(
            f"SELECT count(*) AS n, count(*) FILTER (WHERE _status = 'enriched') AS done, "
            f"sum(_attempts) AS attempts FROM {layout.qualified}")
    assert (stored["n"], stored["done"], stored["attempts"]) == (len(rows), len(rows), len(rows))
    assert await counters_match(tenant, play_scope(tenant), "ns") == (True, "")


async def test_under_an_execution_role_a_lost_commit_reply_of_the_checkout_is_resolved(
        dsn, role_tenant):
    """Under an execution role the checkout's own transaction commits the work of a
    `transaction()` inside it (a savepoint): its lost reply is resolved the same way."""
    counter = f'"{role_tenant.schema}".outage_counter'
    async with role_tenant.login_connection() as conn:  # as the login: DDL and grants
        await conn.execute(f"CREATE TABLE {counter} (n int NOT NULL)")
        await conn.execute(f"INSERT INTO {counter} VALUES (0)")
        await conn.execute(f'GRANT SELECT, UPDATE ON {counter} TO "{role_tenant.execution_role}"')
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-test", proxy.dsn, schema=role_tenant.schema,
                               execution_role=role_tenant.execution_role) as proxied:
            await bump_once_through_a_lost_commit_reply(proxy, proxied, counter)
    async with role_tenant.connection("receipts") as conn:
        assert await conn.fetchval(f"SELECT n FROM {counter}") == 1


async def test_the_supervisor_under_backend_termination_logs_no_driver_state_error(
        dsn, tenant, caplog):
    """The drainer polls the outbox every 10 ms while every runplane backend is terminated
    every 100 ms, for 3 s: it backs off and goes on; a connection whose backend ended while it
    was idle never surfaces the driver's "another operation is in progress"."""
    import logging

    from runplane.actors import open_supervisor

    kill_sql = ("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'runplane' AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'")
    killed = 0
    async with open_tenant("org-test", dsn, schema=tenant.schema) as victim:
        with caplog.at_level(logging.WARNING, logger="runplane.actors"):
            async with open_supervisor(victim, poll_interval=0.01, backoff_base=0.01,
                                       backoff_cap=0.05):
                for _ in range(30):
                    await trio.sleep(0.1)
                    async with tenant.connection("sheet") as admin:
                        killed += await admin.fetchval(kill_sql)
        assert await retry_transient(lambda: select_one(victim, "retirement")) == 1
    assert killed > 0
    leaked = [r.getMessage() for r in caplog.records if "another operation" in r.getMessage()
              and "the server ended the connection before the statement ran" not in r.getMessage()]
    assert not leaked, leaked


async def test_a_sheet_transaction_learns_its_id_without_the_extra_probe(tenant, monkeypatch):
    """Resolving a lost COMMIT needs the transaction's id: a plain transaction reads it with one
    more statement before COMMIT; a sheet transaction gets it from its first statement, so it
    sends no such probe."""
    from runplane.engine import pg, runs, sheets
    from runplane.engine.values.scopes import RunScope

    sent: list[str] = []
    real = pg.Connection._send

    async def recording(self, method, args, kwargs=None):
        if args and isinstance(args[0], str):
            sent.append(args[0])
        return await real(self, method, args, kwargs)

    monkeypatch.setattr(pg.Connection, "_send", recording)
    counter = await _counter_table(tenant)
    async with tenant.connection("receipts") as conn:
        async with conn.transaction():
            await conn.execute(f"UPDATE {counter} SET n = n + 1")
    assert sent.count(pg.XID_PROBE) == 1
    run = await runs.register(tenant, RunScope(tenant.org_id, "play", "r1"))
    contract = SheetContract(inputs=("name",), outputs=("score",))
    sent.clear()
    admission = await sheets.admit(tenant, run, "ns", contract, [{"name": "a"}])
    await sheets.complete(tenant, run, "ns", contract, [
        sheets.RowOutcome(admission.pending[0].key, "completed", {"score": 1})])
    assert "COMMIT" in sent and pg.XID_PROBE not in sent


async def test_a_connection_whose_event_loop_closed_is_dropped_and_the_server_sees_it_go(
        dsn, tenant):
    """`pg.terminate` never raises: on a connection whose event loop is closed already (the
    driver cannot schedule its own cleanup, as when tenants sharing a loop close after it), it
    shuts the socket down, and the server ends the backend."""
    import asyncpg
    import trio_asyncio

    from runplane.engine import pg

    async with trio_asyncio.open_loop():
        raw = await trio_asyncio.aio_as_trio(asyncpg.connect)(dsn)
        pid = raw.get_server_pid()
    pg.terminate(raw)  # its loop is closed: no raise
    with trio.fail_after(10):
        while True:
            async with tenant.connection("receipts") as conn:
                if not await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid):
                    break
            await trio.sleep(0.05)
