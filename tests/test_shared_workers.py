"""`runplane worker`: external workers join a shared map; one dies; a changed play is refused."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from pathlib import Path

import trio

from runplane.actors import open_run
from runplane.actors.map_state import MapPlan
from runplane.actors.shared.coordinator import publish_map
from runplane.engine.shared import maps as sm

from .cli_helpers import cli_env, schema  # noqa: F401  (a fixture)
from .gateway_support import server  # noqa: F401  (a fixture)
from .plays.scale_play import logged_hang, slow_tag, tag_pid
from .sheet_helpers import counters_match, play_scope, raw_rows
from .test_shared_map import CONTRACT, PLAY, sheet_state

NUMS_MAP = sm.map_id_for("map-0", "nums")  # the first shared map of sheet "nums" in a run

PLAY_FILE = Path(__file__).parent / "plays" / "scale_play.py"
ROOT = Path(__file__).resolve().parents[1]


def worker_env(tenant, dsn) -> dict[str, str]:
    return cli_env(RUNPLANE_DSN=dsn, RUNPLANE_SCHEMA=tenant.schema, RUNPLANE_ORG=tenant.org_id)


async def start_worker(tenant, dsn, play_file=PLAY_FILE, *extra: str) -> trio.Process:
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "runplane.cli", "worker", str(play_file), "--exit-when-idle",
         "--concurrency", "8", *extra],
        env=worker_env(tenant, dsn), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, cwd=ROOT)


HANG_AT = 120  # calls the killed worker finishes before its next ones hang


async def test_a_worker_killed_mid_map_loses_only_its_calls_in_flight(tenant, dsn, tmp_path,
                                                                     monkeypatch):
    """Three external workers; the first to start more than `HANG_AT` calls hangs in its next
    ones (`logged_hang`) and, once the rows it computed are recorded, is SIGKILLed. Every row
    ends enriched exactly once, counters exact, and only its calls in flight (at most its
    concurrency, 8) run again elsewhere: nothing it computed is lost."""
    calls = tmp_path / "calls"
    monkeypatch.setenv("RUNPLANE_TEST_CALLS", str(calls))
    monkeypatch.setenv("RUNPLANE_TEST_HANG_AT", str(HANG_AT))
    rows = [{"n": i} for i in range(4000)]
    workers = [await start_worker(tenant, dsn) for _ in range(3)]
    named = tmp_path / "calls.victim"
    victim = None
    result = None

    async def written_by(pid: int) -> set[int]:
        stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n", "pid"))
        return {row["n"] for row in stored.values()
                if row["_status"] == "enriched" and row["pid"] == pid}

    try:
        with trio.fail_after(180):
            async with open_run(tenant, PLAY) as run:

                async def coordinate() -> None:
                    nonlocal result
                    result = await run.map("nums", rows, logged_hang, contract=CONTRACT,
                                           shared=True, lease_s=2.0)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(coordinate)
                    while not (named.exists() and named.read_text()):
                        await trio.sleep(0.05)
                    victim = int(named.read_text())
                    # its finished calls are recorded within the linger, its calls in flight
                    # never finish: kill it then
                    while len(await written_by(victim)) < HANG_AT:
                        await trio.sleep(0.05)
                    os.kill(victim, signal.SIGKILL)
            for worker in workers:
                await worker.wait()
    finally:
        for worker in workers:
            if worker.returncode is None:
                worker.kill()
    survivors = [w for w in workers if w.pid != victim]
    assert [w.returncode for w in survivors] == [0, 0]
    stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n", "pid", "double"))
    assert len(stored) == 4000
    assert all(row["_status"] == "enriched" for row in stored.values())
    state = await sheet_state(tenant, "nums")
    assert [r["_attempts"] for r in state] == [1] * 4000  # no row written twice
    assert result is not None
    assert (result.completed, result.failed, result.cached, result.fenced) == (4000, 0, 0, 0)
    assert (result.admitted, result.executed) == (4000, 4000)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why
    # Re-executed rows are exactly the victim's calls in flight; what it recorded stayed.
    logged = [line.split() for line in calls.read_text().splitlines()]
    times = collections.Counter(int(n) for _, n in logged)
    again = {n for n, count in times.items() if count > 1}
    by_victim = {int(n) for pid, n in logged if int(pid) == victim}
    kept = {row["n"] for row in stored.values() if row["pid"] == victim}
    assert len(kept) == HANG_AT
    assert again == by_victim - kept and 1 <= len(again) <= 8, (len(again), len(by_victim))
    async with tenant.connection("sheet") as conn:  # its units were taken over
        assert await conn.fetchval(
            f'SELECT max(claims) FROM "{tenant.schema}".shared_units') >= 2


async def test_a_changed_play_file_is_refused(tenant, dsn, tmp_path):
    changed = tmp_path / "scale_play.py"
    changed.write_text(PLAY_FILE.read_text() + "\n# changed\n")
    async with open_run(tenant, PLAY) as run:
        plan = MapPlan(tenant, run.ref, None, "nums", CONTRACT, tag_pid)
        await publish_map([{"n": 1}], plan, "map-0", sm.LEASE_S)
        await sm.set_state(tenant, run.ref, "map-0", sm.OPEN, (sm.WAITING,))
        with trio.fail_after(60):
            worker = await start_worker(tenant, dsn, changed, "--play", PLAY)
            stderr = await worker.stderr.receive_some(10_000)
            await worker.wait()
        await sm.set_state(tenant, run.ref, "map-0", sm.CANCELLED, sm.LIVE)
    lines = stderr.decode().strip().splitlines()
    assert worker.returncode == 1 and len(lines) == 1, lines
    assert str(changed) in lines[0] and "differs" in lines[0] and "map-0" in lines[0]
    stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums")
    assert all(row["_status"] != "enriched" for row in stored.values())


def test_run_with_workers_spreads_the_play_over_local_workers(schema):
    from .cli_helpers import run_cli

    env = cli_env(RUNPLANE_SCHEMA=schema)
    done = run_cli("run", "examples/enrich_companies.py", "--input", "examples/companies.csv",
                   "--workers", "2", env=env)
    assert done.returncode == 0, done.stderr
    shown = run_cli("status", "enrich-companies", env=env)
    workers = [line for line in shown.stdout.splitlines() if line.startswith("worker pid ")]
    assert len(workers) == 2 and sum("1 units done" in line for line in workers) == 1, shown.stdout
    listed = run_cli("runs", "enrich-companies", env=env)
    assert sum(line.startswith("worker pid ") for line in listed.stdout.splitlines()) == 2

    async def check(dsn) -> None:
        from runplane.engine import open_tenant

        async with open_tenant("local", dsn, schema=schema) as tenant:
            async with tenant.connection("sheet") as conn:
                maps = await conn.fetch(f'SELECT state, units FROM "{schema}".shared_maps')
                units = await conn.fetchval(
                    f'SELECT count(*) FROM "{schema}".shared_units WHERE done')
        assert [(m["state"], m["units"]) for m in maps] == [("done", 1)] and units == 1

    trio.run(check, os.environ["RUNPLANE_DSN"])


async def test_cancelling_the_coordinator_stops_every_worker_nothing_half_written(tenant, dsn):
    rows = [{"n": i} for i in range(6000)]  # twelve units
    workers = [await start_worker(tenant, dsn) for _ in range(2)]
    try:
        with trio.fail_after(120):
            with trio.CancelScope() as cancelled:
                async with open_run(tenant, PLAY) as run:

                    async def cancel_after_first_unit() -> None:
                        while (await sm.map_status(tenant, run.ref, NUMS_MAP)).done < 1:
                            await trio.sleep(0.1)
                        cancelled.cancel()

                    run.start_soon(cancel_after_first_unit)
                    await run.map("nums", rows, slow_tag, contract=CONTRACT, shared=True,
                                  lease_s=3.0)
            assert cancelled.cancelled_caught
            for worker in workers:  # they stop on their own: the map is cancelled
                await worker.wait()
    finally:
        for worker in workers:
            if worker.returncode is None:
                worker.kill()
    assert [w.returncode for w in workers] == [0, 0]
    status = await sm.map_status(tenant, run.ref, NUMS_MAP, counters=True)
    assert status.state == "cancelled" and 1 <= status.done < status.units
    stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n",))
    enriched = sorted(row["n"] for row in stored.values() if row["_status"] == "enriched")
    # nothing half-written: the rows enriched are exactly those the units' holders recorded
    # as settled (in the transactions that wrote them), and counted
    async with tenant.connection("sheet") as conn:
        units = await conn.fetch(
            f'SELECT low, row_count, coalesce(counters->>\'settled\', \'\') AS settled '
            f'FROM "{tenant.schema}".shared_units')
    settled = sorted(u["low"] + offset for u in units for offset in range(u["row_count"])
                     if u["settled"] and int(u["settled"], 16) >> offset & 1)
    assert enriched == settled
    assert status.counters["completed"] == len(enriched)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why


def test_a_dead_coordinator_is_woken_and_its_workers_carry_on(schema):
    """SIGKILL the coordinator of `run --workers 2` mid-map: its workers finish the map; a wake
    (`--run-id`) returns the exact result."""
    from .cli_helpers import RUNPLANE, run_cli

    env = cli_env(RUNPLANE_SCHEMA=schema)
    play = str(Path(__file__).parent / "plays" / "wake_play.py")
    coordinator = subprocess.Popen([*RUNPLANE, "run", play, "--no-input", "--workers", "2",
                                    "--new-run-id", "wake-1"], env=env, cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def progress(dsn, wanted: str):
        from runplane.engine import open_tenant

        async with open_tenant("local", dsn, schema=schema) as tenant:
            with trio.fail_after(120):
                while True:
                    async with tenant.connection("sheet") as conn:
                        done, units = await conn.fetchrow(
                            f'SELECT count(*) FILTER (WHERE done), count(*) '
                            f'FROM "{schema}".shared_units')
                    if (wanted == "some" and done > 0) or (wanted == "all" and units
                                                           and done == units):
                        return
                    await trio.sleep(0.1)

    dsn = os.environ["RUNPLANE_DSN"]
    try:
        trio.run(progress, dsn, "some")
        coordinator.kill()  # SIGKILL: no cleanup, the map stays open
        coordinator.wait()
        trio.run(progress, dsn, "all")  # the orphaned workers finish it
        woken = run_cli("run", play, "--no-input", "--workers", "2", "--run-id", "wake-1", env=env)
        assert woken.returncode == 0, woken.stderr
        assert "admitted 3000, cached 0, completed 3000, failed 0" in woken.stdout, woken.stdout
    finally:
        if coordinator.poll() is None:
            coordinator.kill()

    async def check(dsn) -> None:
        from runplane.engine import open_tenant

        async with open_tenant("local", dsn, schema=schema) as tenant:
            async with tenant.connection("sheet") as conn:
                state = await conn.fetchval(f'SELECT state FROM "{schema}".shared_maps')
            assert state == "done"
            rows = await sheet_state_of(tenant, "scale-wake")
            assert [(r["_status"], r["_attempts"]) for r in rows] == [("enriched", 1)] * 3000
            ok, why = await counters_match(tenant, play_scope(tenant, "scale-wake"), "nums")
            assert ok, why

    trio.run(check, dsn)


async def sheet_state_of(tenant, play: str):
    from runplane.engine.sheets.layout import layout_for

    layout = layout_for(tenant, play_scope(tenant, play), "nums")
    async with tenant.connection("sheet") as conn:
        return await conn.fetch(f"SELECT _status, _attempts FROM {layout.qualified}")


async def test_a_worker_through_a_gateway_runs_a_shared_map(tenant, server):
    """A worker with only a gateway URL and a token (no DSN) joins a shared map."""
    from .gateway_support import token_for

    env = cli_env(RUNPLANE_TOKEN=token_for(tenant))
    for name in ("RUNPLANE_DSN", "RUNPLANE_SCHEMA", "RUNPLANE_ORG"):
        env.pop(name, None)
    worker = await trio.lowlevel.open_process(
        [sys.executable, "-m", "runplane.cli", "worker", str(PLAY_FILE), "--gateway", server.url,
         "--exit-when-idle", "--concurrency", "8"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        cwd=ROOT)
    try:
        with trio.fail_after(120):
            async with open_run(tenant, PLAY) as run:
                result = await run.map("nums", [{"n": i} for i in range(1200)], tag_pid,
                                       contract=CONTRACT, shared=True)
            await worker.wait()
    finally:
        if worker.returncode is None:
            worker.kill()
    assert worker.returncode == 0
    stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n", "pid"))
    assert {row["pid"] for row in stored.values()} == {worker.pid}
    assert [r["_attempts"] for r in await sheet_state(tenant, "nums")] == [1] * 1200
    assert (result.completed, result.failed, result.cached) == (1200, 0, 0)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why
