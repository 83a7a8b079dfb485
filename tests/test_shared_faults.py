"""Shared maps under faults: a worker cut off from the database, and a worker through a
gateway with database sessions. Exactly once holds throughout: each row enriched once
(`_attempts` = 1), the coordinator's result exact, counters equal COUNT(*)."""

from __future__ import annotations

import subprocess
import sys

import trio

from runplane.actors import open_run
from runplane.actors.shared.service import MapWorker
from runplane.actors.shared.worker import WorkerOptions, serve_play, worker_plan
from runplane.engine import open_tenant
from runplane.engine.shared import maps as sm
from runplane.engine.errors import StoreOutageError

from .cli_helpers import cli_env
from .gateway_support import server, token_for  # noqa: F401  (a fixture)
from .pg_proxy import open_pg_proxy
from .sheet_helpers import counters_match, play_scope, raw_rows
from .test_shared_map import CONTRACT, PLAY, sheet_state
from .test_shared_workers import PLAY_FILE, ROOT

BUDGET_S = 3.0


async def test_a_worker_cut_off_rides_out_its_budget_then_others_take_its_units(tenant, dsn):
    """A worker reaching the database through a proxy is cut off (the proxy drops its
    connections and answers no new one) once it ran some rows: it waits out its outage budget and ends with `StoreOutageError`;
    its leases expire and a worker with a working connection takes its units over."""
    rows = [{"n": i} for i in range(3000)]
    ran = trio.Event()
    calls = 0
    ended: list[BaseException] = []
    result = None

    async def cut_off_fn(row: dict) -> dict:
        nonlocal calls
        calls += 1
        if calls >= 50:
            ran.set()
        await trio.sleep(0.01)
        return {"pid": -1, "double": row["n"] * 2}

    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant(tenant.org_id, proxy.dsn, schema=tenant.schema,
                               outage_budget_s=BUDGET_S) as far:

            async def cut_off_worker(shared: sm.SharedMap) -> None:
                await sm.join(far, PLAY, "far:1")
                worker = MapWorker(far, "far:1", shared, worker_plan(far, shared, cut_off_fn, 4),
                                   trio.CapacityLimiter(4), renew_s=shared.lease_s / 3)
                try:
                    await worker.serve()
                except* StoreOutageError as group:
                    ended.extend(group.exceptions)

            with trio.fail_after(120):
                async with open_run(tenant, PLAY) as run:

                    async def coordinate() -> None:
                        nonlocal result
                        from .plays.scale_play import tag_pid

                        result = await run.map("nums", rows, tag_pid, contract=CONTRACT,
                                               shared=True, lease_s=2.0)

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(coordinate)
                        while not (maps := await sm.live_maps(tenant, PLAY)) or \
                                maps[0].state != sm.OPEN:
                            await trio.sleep(0.02)
                        nursery.start_soon(cut_off_worker, maps[0])
                        await ran.wait()
                        # its connections dropped (the server rolls back what they had open),
                        # new ones never answered
                        proxy.set_blackhole(True, sever=True)
                        nursery.start_soon(lambda: serve_play(
                            tenant, PLAY, str(PLAY_FILE),
                            WorkerOptions(exit_when_idle=True, poll_s=0.1)))
            proxy.set_blackhole(False)
    assert len(ended) == 1  # it rode out the budget, then gave up
    stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n", "pid", "double"))
    assert len(stored) == 3000
    assert all(row["_status"] == "enriched" and row["double"] == 2 * row["n"]
               for row in stored.values())
    assert [r["_attempts"] for r in await sheet_state(tenant, "nums")] == [1] * 3000
    assert result is not None
    assert (result.completed, result.failed, result.cached, result.fenced) == (3000, 0, 0, 0)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why
    async with tenant.connection("sheet") as conn:  # its units were taken over
        taken = await conn.fetchval(
            f'SELECT count(*) FROM "{tenant.schema}".shared_units WHERE claims >= 2')
    assert taken >= 1


async def test_a_worker_through_a_gateway_with_database_sessions_runs_a_shared_map(tenant,
                                                                                  server):
    """`runplane worker --gateway URL --db-sessions`: a worker with a token and database
    sessions (no DSN) runs a shared map exactly once."""
    env = cli_env(RUNPLANE_TOKEN=token_for(tenant))
    for name in ("RUNPLANE_DSN", "RUNPLANE_SCHEMA", "RUNPLANE_ORG"):
        env.pop(name, None)
    worker = await trio.lowlevel.open_process(
        [sys.executable, "-m", "runplane.cli", "worker", str(PLAY_FILE), "--gateway", server.url,
         "--db-sessions", "--exit-when-idle", "--concurrency", "8"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        cwd=ROOT)
    from .plays.scale_play import tag_pid

    try:
        with trio.fail_after(120):
            async with open_run(tenant, PLAY) as run:
                result = await run.map("nums", [{"n": i} for i in range(1500)], tag_pid,
                                       contract=CONTRACT, shared=True)
            errors = b""
            async for chunk in worker.stderr:
                errors += chunk
            await worker.wait()
    finally:
        if worker.returncode is None:
            worker.kill()
    assert worker.returncode == 0, errors.decode()
    assert b"database sessions off" not in errors, errors.decode()
    stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n", "pid"))
    assert {row["pid"] for row in stored.values()} == {worker.pid}
    assert [r["_attempts"] for r in await sheet_state(tenant, "nums")] == [1] * 1500
    assert (result.completed, result.failed, result.cached) == (1500, 0, 0)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why
