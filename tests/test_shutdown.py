"""Clean shutdown: closing a gateway server, a tenant, a run or a map never lets an exception
escape (asyncio.CancelledError included), whatever its connections are doing at that moment —
mid-statement, mid-COMMIT, being closed, or having their backend terminated."""

from __future__ import annotations

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import open_tenant, pg, sheets
from runplane.engine.errors import EngineError, leaf_errors
from runplane.engine.gateway import RetryPolicy, open_gateway

from .gateway_support import serving, token_for
from .session_helpers import drop_all_sessions

CYCLES = 25
CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("upper",))
SHORT_RETRY = RetryPolicy(answered_delays_s=(0.01,), unreachable_budget_s=0.5,
                          request_timeout_s=5.0, completion_total_s=5.0, min_answered_wait_s=0.0)


def rows(n: int, tag: str = "") -> list[dict]:
    return [{"name": f"row-{tag}{i}", "n": i} for i in range(n)]


async def enrich(row: dict) -> dict:
    await trio.sleep(0)
    return {"upper": row["name"].upper()}


async def map_until_cancelled(port, play: str, source: list[dict]) -> None:
    """A map over `port` that the caller cancels (or the store ends: both are fine here)."""
    try:
        async with open_run(port, play) as run:
            await run.map("things", source, enrich, contract=CONTRACT, concurrency=8)
    except Exception as exc:  # the server went away under the map: its own typed failure
        if not all(isinstance(leaf, EngineError) for leaf in leaf_errors(exc)):
            raise


def escaped(errors: list[BaseException]) -> list[str]:
    return [f"{type(e).__module__}.{type(e).__name__}: {e}" for e in errors]


async def host_server(tenant, close: trio.Event, *, task_status=trio.TASK_STATUS_IGNORED):
    async with serving(tenant) as server:
        task_status.started(server.url)
        await close.wait()


@pytest.mark.parametrize("db_sessions", [False, True], ids=["http", "db-sessions"])
async def test_gateway_servers_close_cleanly_with_a_map_running_through_them(tenant, db_sessions):
    errors: list[BaseException] = []
    for cycle in range(CYCLES):
        close = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                url = await nursery.start(host_server, tenant, close)
                async with open_gateway(url, token_for(tenant), retry=SHORT_RETRY,
                                        db_sessions=db_sessions) as gateway:
                    async with trio.open_nursery() as maps:
                        maps.start_soon(map_until_cancelled, gateway, f"gw-{cycle}",
                                        rows(400, f"{cycle}-"))
                        await trio.sleep(0.05 + 0.02 * cycle)
                        close.set()  # the server closes with the map's requests in flight
                        await trio.sleep(0.01 * (cycle % 5))
                        maps.cancel_scope.cancel()
        except BaseException as exc:  # noqa: BLE001 - anything escaping is the failure
            errors.append(exc)
    await drop_all_sessions(tenant)
    assert not errors, escaped(errors)


async def test_maps_cancelled_mid_flight_close_cleanly(tenant):
    errors: list[BaseException] = []
    for cycle in range(CYCLES):
        try:
            with trio.move_on_after(0.01 + 0.015 * cycle):
                async with open_run(tenant, f"cancelled-{cycle}") as run:
                    await run.map("things", rows(2000, f"{cycle}-"), enrich, contract=CONTRACT,
                                  concurrency=8)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    assert not errors, escaped(errors)
    # the tenant still works afterwards: no connection was left in a bad state in the pool
    async with tenant.connection("sheet") as conn:
        assert await conn.fetchval("SELECT 1") == 1


async def terminate_backends(killer, stop: trio.Event) -> None:
    """Terminate every other runplane backend on the server (from `killer`'s connection) until
    `stop`; the killer's own connection may be terminated too, and then it simply reconnects."""
    while not stop.is_set():
        try:
            async with killer.login_connection() as conn:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'runplane' AND pid <> pg_backend_pid()")
        except EngineError:
            pass
        await trio.sleep(0.003)


async def test_a_tenant_closes_cleanly_while_its_backends_are_terminated(dsn, tenant):
    errors: list[BaseException] = []
    async with open_tenant("org-killer", dsn, schema=tenant.schema, bootstrap=False) as killer:
        for cycle in range(CYCLES):
            stop = trio.Event()
            try:
                async with trio.open_nursery() as outer:
                    try:
                        async with open_tenant("org-test", dsn, schema=tenant.schema,
                                               max_connections=8) as victim:
                            async with trio.open_nursery() as inner:
                                inner.start_soon(map_until_cancelled, victim, f"term-{cycle}",
                                                 rows(300, f"{cycle}-"))
                                await trio.sleep(0.02 + 0.005 * cycle)
                                outer.start_soon(terminate_backends, killer, stop)
                                await trio.sleep(0.002 * cycle)
                                inner.cancel_scope.cancel()
                            # leaving the block closes the tenant while its backends are killed
                    finally:
                        stop.set()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
    assert not errors, escaped(errors)


async def test_closing_a_connection_while_its_event_loop_shuts_down_raises_nothing(dsn):
    """The event loop a connection lives on shuts down while the connection is being closed
    (or terminated) from another task: the loop cancels the close on the asyncio side, which
    trio did not ask for; the close still ends quietly, every time."""
    errors: list[BaseException] = []
    for cycle in range(CYCLES):
        try:
            async with trio.open_nursery() as outer:
                async with pg.open_driver() as driver:
                    raws = [await driver.connect(dsn, server_settings={}) for _ in range(3)]
                    for raw in raws:
                        outer.start_soon(pg.close_gracefully, raw, driver)
                    await trio.sleep(0.0005 * cycle)
                # the loop is gone; the closes that were still in flight end on their own
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    assert not errors, escaped(errors)
