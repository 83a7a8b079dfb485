"""What counts as an outage (retried within the run's outage budget) and what is the
statement's own error: the pure rule, and a run riding out a server that turns read-only for a
while (SQLSTATE 25006, as a demoted primary or a standby reached mid-promotion answers)."""

from __future__ import annotations

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import open_tenant
from runplane.engine.errors import StatementTimeoutError, StoreUnavailableError
from runplane.engine.pg import is_outage

from .outage_support import private_server, remove_private_server
from .test_outages import PLAY, Map, assert_finished_once, fresh_schema


@pytest.mark.parametrize("sqlstate", ["25006", "57P01", "57P02", "57P03", "08006", "08003",
                                      "08001"])
def test_promotion_and_shutdown_errors_are_outages(sqlstate):
    assert is_outage(sqlstate, connection_lost=False)


def test_a_reset_connection_is_an_outage_whatever_the_server_said():
    assert is_outage(None, connection_lost=True)
    assert is_outage("XX000", connection_lost=True)


def test_a_statement_timeout_is_an_outage_only_with_a_lost_connection_or_a_new_server():
    assert not is_outage("57014", connection_lost=False, server_changed=False)
    assert is_outage("57014", connection_lost=True)
    assert is_outage("57014", connection_lost=False, server_changed=True)


@pytest.mark.parametrize("sqlstate", ["23505", "42P01", "42501", "22P02", "40001", None])
def test_statement_errors_are_not_outages(sqlstate):
    assert not is_outage(sqlstate, connection_lost=False)


@pytest.fixture(scope="module")
def server():
    server, root = private_server()
    try:
        yield server
    finally:
        remove_private_server(server, root)


async def set_read_only(tenant, on: bool) -> None:
    async with tenant.login_connection() as conn:
        await conn.execute(f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'off'}")
        await conn.execute("SELECT pg_reload_conf()")


async def test_a_run_rides_out_a_server_that_is_read_only_for_a_while(server):
    rows = 4_000
    work = Map(rows, stop_after=1_000)
    with trio.fail_after(120):
        async with open_tenant("org-ro", server.dsn, schema=fresh_schema(),
                               outage_budget_s=30) as tenant:

            async def demote_for_a_while() -> None:
                await work.tripped.wait()
                await set_read_only(tenant, True)
                await trio.sleep(2)
                # the login connection's own transactions are read-only now: turn it back
                # from a session that overrides the default
                async with tenant.login_connection() as conn:
                    await conn.execute("SET default_transaction_read_only = off")
                    await conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
                    await conn.execute("SELECT pg_reload_conf()")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(demote_for_a_while)
                async with open_run(tenant, PLAY) as run:
                    result = await work.run(run)
            assert run.outage.outages >= 1  # it did wait for a writable server
            assert (result.completed, result.failed) == (rows, 0)
            assert len(work.calls) == rows and set(work.calls.values()) == {1}
            await assert_finished_once(tenant, rows)


async def timed_out_statement(tenant) -> None:
    async with tenant.connection("sheet") as conn:
        async with conn.transaction():
            await conn.execute("SET LOCAL statement_timeout = '100ms'")
            await conn.execute("SELECT pg_sleep(2)")


async def test_a_statement_timeout_is_an_outage_only_once_the_server_changed(server):
    with trio.fail_after(120):
        async with open_tenant("org-timeout", server.dsn, schema=fresh_schema()) as tenant:
            # the same server: the timeout it says
            with pytest.raises(StatementTimeoutError):
                await timed_out_statement(tenant)
            # the server restarted (another postmaster start time) while the connection that
            # timed out stayed open: an outage, retried within the budget
            await server.stop()
            await server.start()
            with pytest.raises(StoreUnavailableError, match="the server changed") as caught:
                await timed_out_statement(tenant)
            assert not isinstance(caught.value, StatementTimeoutError)
            assert caught.value.sqlstate == "57014"
            # the server is the same as at the last look again: the timeout it says
            with pytest.raises(StatementTimeoutError):
                await timed_out_statement(tenant)
