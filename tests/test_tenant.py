"""Tenants: permits, connect failures, bootstrap races, self-heal, roles, and connection faults."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

from runplane.engine import PlayScope, RunScope, open_tenant, receipts, runs
from runplane.engine.errors import (
    InvalidInputError,
    StatementTimeoutError,
    StoreUnavailableError,
    TenantUnavailableError,
    TransactionStateUnknownError,
)
from runplane.engine.observability import metrics
from runplane.engine.permits import Permits
from runplane.engine.tenant import describe_dsn

from .conftest import fresh_schema


async def test_permits_are_fifo_cancellable_and_counted():
    permits = Permits("lane", 1)
    order: list[int] = []
    async with trio.open_nursery() as nursery:
        async with permits.hold():
            for i in range(3):
                async def waiter(i=i):
                    async with permits.hold():
                        order.append(i)
                nursery.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as cancelled:
                cancelled.cancel()
                async with permits.hold():  # already cancelled while waiting: never acquires
                    order.append(99)
            assert permits.stats().waiting == 3
            assert permits.stats().in_use == 1
    assert order == [0, 1, 2]
    stats = permits.stats()
    assert (stats.acquired, stats.in_use, stats.waiting) == (4, 0, 0)
    assert stats.wait_seconds >= 0


async def test_lanes_bound_checkouts_and_report_waiters(dsn):
    async with open_tenant("o", dsn, schema=fresh_schema(), lanes={"sheet": 1, "receipts": 2, "retirement": 1}) as tenant:
        entered = trio.Event()
        release = trio.Event()

        async def holder():
            async with tenant.connection("sheet"):
                entered.set()
                await release.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await entered.wait()

            async def second():
                async with tenant.connection("sheet") as conn:
                    assert await conn.fetchval("SELECT 1") == 1

            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            assert tenant.permits()["sheet"].waiting == 1
            assert tenant.permits()["sheet"].in_use == 1
            async with tenant.connection("receipts") as conn:  # another lane is not starved
                assert await conn.fetchval("SELECT 2") == 2
            release.set()
        assert tenant.permits()["sheet"].acquired == 2
        with pytest.raises(InvalidInputError, match="unknown lane"):
            async with tenant.connection("nope"):
                pass


async def test_unreachable_database_names_the_host_never_the_password():
    with trio.fail_after(20):
        with pytest.raises(TenantUnavailableError) as info:
            async with open_tenant("o", "postgresql://alice:s3cret-pw@127.0.0.1:9/db"):
                pass
    assert "127.0.0.1:9/db" in str(info.value)
    assert "s3cret-pw" not in str(info.value)


def test_describe_dsn_forms():
    assert describe_dsn("postgresql://u:pw@db.example:5433/app") == "db.example:5433/app"
    assert describe_dsn("postgresql://postgres:@/postgres?host=/tmp/sock") == "/tmp/sock/postgres"
    assert describe_dsn("host=h port=1 dbname=d password=pw") == "h:1/d"


@pytest.mark.parametrize("pooler", [None, "transaction"])
async def test_concurrent_bootstraps_of_one_schema_all_succeed(dsn, monkeypatch, pooler):
    """Tenants opening at once on a new schema (a gateway's first orgs) all succeed, and they
    wait for one bootstrap: its DDL runs once, not once per tenant in turn. Enough of them that
    some wait for the schema's name while the first creates it: their backends' catalog caches
    still say the schema is absent when they get the name (with four, none did; with thirty,
    half of them ran the whole DDL again before `bootstrap` read the catalog's rows and locked
    `meta`). Through a transaction-mode pooler (`RUNPLANE_POOLER`: the bootstrap runs inside
    the caller's transaction) as well."""
    from runplane.engine import schema as schema_ddl

    if pooler is not None:
        monkeypatch.setenv("RUNPLANE_POOLER", pooler)
    schema = fresh_schema()
    opened = []
    ddl_runs = []
    original = schema_ddl.bootstrap_sql
    monkeypatch.setattr(schema_ddl, "bootstrap_sql",
                        lambda *args: ddl_runs.append(args) or original(*args))

    async def open_one():
        async with open_tenant("o", dsn, schema=schema) as tenant:
            opened.append(await runs.register(tenant, RunScope("o", "p", "r")))

    async with trio.open_nursery() as nursery:
        for _ in range(30):
            nursery.start_soon(open_one)
    assert len({ref.epoch for ref in opened}) == 1
    assert len(opened) == 30 and len(ddl_runs) == 1


async def test_missing_relation_is_repaired_once(tenant):
    run = await runs.register(tenant, RunScope("org-test", "p", "r"))
    async with tenant.connection("sheet") as conn:
        await conn.execute(f'DROP TABLE "{tenant.schema}".work_receipts')
    receipt = await receipts.complete(tenant, run, "k", {"v": 1})
    assert receipt.output == {"v": 1}


async def test_a_killed_backend_surfaces_a_typed_error_and_the_pool_recovers(tenant):
    with pytest.raises(StoreUnavailableError):
        async with tenant.connection("sheet") as conn:
            async with conn.transaction():
                await conn.execute("SELECT 1")
                async with tenant.connection("receipts") as killer:
                    await killer.execute("SELECT pg_terminate_backend($1)", conn.backend_pid)
                await conn.execute("SELECT pg_sleep(0.05)")
    run = await runs.register(tenant, RunScope("org-test", "p", "r"))
    assert (await receipts.claim(tenant, run, "after")).disposition == "claimed"


async def test_a_cancelled_query_never_returns_its_connection_to_the_pool(tenant):
    async with tenant.connection("sheet") as conn:
        first_pid = conn.backend_pid
    with trio.move_on_after(0.2) as scope:
        async with tenant.connection("sheet") as conn:
            assert conn.backend_pid == first_pid  # pooled
            await conn.execute("SELECT pg_sleep(30)")
    assert scope.cancelled_caught
    async with tenant.connection("sheet") as conn:
        assert conn.backend_pid != first_pid
        assert not conn.in_transaction
        assert await conn.fetchval("SELECT 41 + 1") == 42


async def test_a_rollback_on_a_lost_connection_closes_it_and_is_an_outage(tenant):
    # The server ended the connection before COMMIT: it rolled back itself, so the outcome is
    # known (nothing written) and the error is the retryable kind, not a state-unknown one.
    async with tenant.connection("sheet") as conn:
        doomed_pid = conn.backend_pid
        with pytest.raises(StoreUnavailableError) as info:
            async with conn.transaction():
                await conn.execute("SELECT 1")
                async with tenant.connection("receipts") as killer:
                    await killer.execute("SELECT pg_terminate_backend($1)", doomed_pid)
                raise ValueError("operation failed")
        assert not isinstance(info.value, TransactionStateUnknownError)
        assert isinstance(info.value.__cause__, ValueError)
        assert "nothing was committed" in str(info.value)
    async with tenant.connection("sheet") as conn:
        assert conn.backend_pid != doomed_pid
        assert await conn.fetchval("SELECT 1") == 1


async def test_nested_transactions_use_savepoints(tenant):
    async with tenant.connection("sheet") as conn:
        await conn.execute(f'CREATE TABLE "{tenant.schema}".t (v int)')
        async with conn.transaction():
            await conn.execute(f'INSERT INTO "{tenant.schema}".t VALUES (1)')
            with pytest.raises(ZeroDivisionError):
                async with conn.transaction():
                    await conn.execute(f'INSERT INTO "{tenant.schema}".t VALUES (2)')
                    raise ZeroDivisionError
        assert await conn.fetchval(f'SELECT array_agg(v) FROM "{tenant.schema}".t') == [1]


async def test_a_transaction_reports_its_begin_and_commit_phases(tenant):
    phases = []

    def report(phase, seconds, failed):
        assert seconds >= 0
        phases.append((phase, failed))

    async def commit_fails(sql, send):
        if sql in ("COMMIT", "RELEASE SAVEPOINT runplane_sp_1"):
            raise StoreUnavailableError("lost at commit")
        return await send()

    async with tenant.connection("sheet") as conn:
        async with conn.transaction(on_phase=report):
            async with conn.transaction(on_phase=report):  # a savepoint reports the same way
                await conn.fetchval("SELECT 1")
        assert phases == [("begin", False), ("begin", False), ("commit", False), ("commit", False)]
        phases.clear()
        with pytest.raises(ZeroDivisionError):
            async with conn.transaction(on_phase=report):
                raise ZeroDivisionError
        assert phases == [("begin", False)]  # a rollback is not a reported phase
    async with tenant.connection("sheet") as conn:
        phases.clear()
        conn.statement_hook = commit_fails
        with pytest.raises(StoreUnavailableError):
            async with conn.transaction(on_phase=report):
                await conn.fetchval("SELECT 1")
        assert phases == [("begin", False), ("commit", True)]


async def test_statement_timeouts_are_typed(tenant):
    async with tenant.connection("sheet") as conn:
        with pytest.raises(StatementTimeoutError) as info:
            async with conn.transaction():
                await conn.execute("SET LOCAL statement_timeout = '50ms'")
                await conn.execute("SELECT pg_sleep(5)")
        assert info.value.sqlstate == "57014"
        assert await conn.fetchval("SELECT 1") == 1


async def test_execution_role_runs_every_checkout_in_a_transaction_as_that_role(role_tenant):
    tenant = role_tenant
    assert tenant.outer_transaction
    async with tenant.connection("receipts") as conn:
        assert conn.in_transaction
        assert await conn.fetchval("SELECT current_user") == tenant.execution_role
    run = await runs.register(tenant, RunScope("org-test", "p", "r"))
    assert (await receipts.claim(tenant, run, "k")).disposition == "claimed"
    assert (await receipts.complete(tenant, run, "k", 1)).status == "completed"
    assert (await receipts.get(tenant, PlayScope("org-test", "p"), "k")).output == 1


async def test_transient_connect_failures_are_retried_three_times_then_fail():
    """A listener that drops every connection: four attempts reach it, then a typed error."""
    attempts = 0

    async def drop(stream):
        nonlocal attempts
        attempts += 1
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, drop, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(30):
            with pytest.raises(TenantUnavailableError, match=f"127.0.0.1:{port}"):
                async with open_tenant("o", f"postgresql://u:pw@127.0.0.1:{port}/db"):
                    pass
        nursery.cancel_scope.cancel()
    assert attempts == 4


async def test_non_transient_connect_errors_fail_at_once(dsn):
    bad = dsn.replace("/postgres?", "/no_such_database?") if "?" in dsn else dsn + "_missing"
    with pytest.raises(TenantUnavailableError, match="no_such_database|does not exist"):
        async with open_tenant("o", bad):
            pass


async def copy_records(conn, table, records, *, columns, schema):
    """COPY `records` into `schema.table` (binary protocol) through the connection's own
    statement path, as any statement of the adapter runs."""
    return await conn._statement(f"COPY {schema}.{table}", "copy_records_to_table", table,
                                 records=records, columns=list(columns), schema_name=schema)


async def test_statements_run_from_tasks_started_outside_the_tenants_loop(dsn):
    """Statements step their driver coroutines in the calling task: a task whose context
    predates the tenant's event loop (started in an outer nursery) works all the same."""
    seen = []
    async with trio.open_nursery() as outer:
        async with open_tenant("o", dsn, schema=fresh_schema()) as tenant:
            done = trio.Event()

            async def use():
                async with tenant.connection("sheet") as conn:
                    seen.append(await conn.fetchval("SELECT 7"))
                    await copy_records(conn, "copied", [(1,), (2,)], columns=["v"],
                                       schema=tenant.schema)
                    seen.append(await conn.fetchval(f'SELECT sum(v) FROM "{tenant.schema}".copied'))
                done.set()

            async with tenant.connection("sheet") as conn:
                await conn.execute(f'CREATE TABLE "{tenant.schema}".copied (v int)')
            outer.start_soon(use)
            await done.wait()
    assert seen == [7, 3]


async def test_a_rollback_slower_than_one_second_closes_the_connection(tenant):
    """The ROLLBACK is held back past its 1 s deadline (at the statement boundary, as a stalled
    network would): the connection is closed, not pooled, and both errors are reported."""

    async def stall_rollback(sql, send):
        if sql == "ROLLBACK":
            await trio.sleep(30)  # cut short by the rollback's own deadline
        return await send()

    async with tenant.connection("sheet") as conn:
        stalled_pid = conn.backend_pid
        conn.statement_hook = stall_rollback
        with trio.fail_after(10):
            with pytest.raises(TransactionStateUnknownError) as info:
                async with conn.transaction():
                    await conn.execute("SELECT 1")
                    raise KeyError("operation failed")
        assert isinstance(info.value.error, KeyError)
        assert isinstance(info.value.rollback_error, TimeoutError)
        assert conn.broken
    async with tenant.connection("sheet") as conn:
        assert conn.backend_pid != stalled_pid


def _statements_sent() -> int:
    """Every statement this process's tenants have sent so far (the statement metrics)."""
    return sum(sum(histogram.counts) for histogram in metrics.STATEMENT_SECONDS.children.values())


async def test_opening_a_current_schema_reads_it_in_two_statements(tenant):
    """A tenant opening on a current schema reads its version and lock secret in two
    statements (a catalog probe, then both values): no DDL, and the same secret the first
    opening read."""
    async with open_tenant(tenant.org_id, tenant.dsn, schema=tenant.schema) as again:
        again.lock_secret = None
        before = _statements_sent()
        await again.ensure_schema()  # what opening it ran
        assert _statements_sent() - before == 2
        assert again.lock_secret == tenant.lock_secret and again.lock_secret is not None


async def test_a_shared_opening_serves_only_tenants_whose_opening_it_stands_for(
        dsn, role_tenant):
    """Inside `sharing`, a tenant that bootstraps its schema as its login takes what the first
    one read (here a made-up secret, so taking it shows); one with an execution role (its
    opening grants the role) and a reader (no bootstrap) read their own. (One schema fixture
    only: tenants of two fixtures may share a driver loop that one closes first.)"""
    from runplane.engine.opening import SharedOpening, open_reader, sharing

    schema = role_tenant.schema
    with sharing(SharedOpening(lock_secret=b"shared-secret", server="shared-server")):
        async with open_tenant("org-b", dsn, schema=schema) as plain:
            assert (plain.lock_secret, plain.server_identity) == (b"shared-secret",
                                                                  "shared-server")
        async with open_tenant("org-b", dsn, schema=schema,
                               execution_role=role_tenant.execution_role) as role:
            assert role.lock_secret == role_tenant.lock_secret != b"shared-secret"
        async with open_reader("org-b", dsn, schema=schema) as reader:
            assert reader.lock_secret != b"shared-secret"
            assert reader.server_identity != "shared-server"
