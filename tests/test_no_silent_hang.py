"""No silent hang: a worker resolves its play as `runplane run` does and says what it joins; a
shared map without a live worker says so."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import trio

from runplane.actors import open_run
from runplane.actors.shared import coordinator as shared_map_module
from runplane.actors.shared.worker import WorkerOptions, serve_play
from runplane.engine.sheets import SheetContract

from .cli_helpers import cli_env
from .plays.computed_play import PLAY as COMPUTED_PLAY
from .plays.computed_play import double

PLAY_FILE = Path(__file__).parent / "plays" / "computed_play.py"
ROOT = Path(__file__).resolve().parents[1]
CONTRACT = SheetContract(("n",), ("double",))


async def test_a_worker_serves_a_play_whose_name_the_file_computes_and_says_so(tenant, dsn):
    """Was: the worker parsed only a literal `PLAY = "..."`, served the file's stem, printed
    `0 units done` after 60 s and exited 0 while the map waited."""
    assert COMPUTED_PLAY == "computed-name" != PLAY_FILE.stem
    env = cli_env(RUNPLANE_DSN=dsn, RUNPLANE_SCHEMA=tenant.schema, RUNPLANE_ORG=tenant.org_id)
    worker = await trio.lowlevel.open_process(
        [sys.executable, "-m", "runplane.cli", "worker", str(PLAY_FILE), "--exit-when-idle"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, cwd=ROOT)
    out = bytearray()

    async def read() -> None:
        async for chunk in worker.stdout:
            out.extend(chunk)

    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                async with open_run(tenant, COMPUTED_PLAY) as run:
                    result = await run.map("nums", [{"n": i} for i in range(50)], double,
                                           contract=CONTRACT, shared=True)
                await worker.wait()
    finally:
        if worker.returncode is None:
            worker.kill()
    assert result.completed == 50
    lines = out.decode().splitlines()
    assert any(f"org {tenant.org_id!r}, play 'computed-name'" in line and "serving" in line
               for line in lines), lines
    joined = [line for line in lines if "joined shared map" in line]
    left = [line for line in lines if "left shared map" in line]
    assert len(joined) == 1 and len(left) == 1, lines
    assert f"of org {tenant.org_id!r}, play 'computed-name'" in joined[0]
    assert "table 'nums'" in joined[0]


async def test_a_shared_map_with_no_live_worker_says_which_org_and_play_need_one(
        tenant, monkeypatch, caplog):
    monkeypatch.setattr(shared_map_module, "NO_WORKER_WARN_S", 0.3)
    monkeypatch.setattr(shared_map_module, "NO_WORKER_REPEAT_S", 0.5)
    monkeypatch.setattr(shared_map_module, "WORKER_CHECK_S", 0.05)
    caplog.set_level(logging.WARNING, logger="runplane.actors")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no live worker" in r.getMessage()]

    with trio.fail_after(60):
        async with open_run(tenant, COMPUTED_PLAY) as run:
            async with trio.open_nursery() as nursery:
                async def coordinate() -> None:
                    result = await run.map("nums", [{"n": i} for i in range(20)], double,
                                           contract=CONTRACT, shared=True)
                    assert result.completed == 20

                nursery.start_soon(coordinate)
                while len(warnings()) < 2:  # the first, then a repeat
                    await trio.sleep(0.05)
                await serve_play(tenant, COMPUTED_PLAY, str(PLAY_FILE),
                                 WorkerOptions(exit_when_idle=True))
    first = warnings()[0]
    assert f"org {tenant.org_id!r}" in first and "play 'computed-name'" in first
    assert "runplane worker" in first


async def test_a_local_worker_killed_mid_map_has_its_leases_released_at_once(
        tenant, tmp_path, monkeypatch, caplog):
    """`workers=2` with a lease far longer than the test may take: one child is SIGKILLed with
    units leased; the coordinator, its parent, sees it exit and releases them, so the other
    child finishes the map (was: the map waited out the whole lease)."""
    from .plays.scale_play import logged_hang
    from .test_shared_map import CONTRACT as SCALE_CONTRACT, PLAY as SCALE_PLAY

    calls = tmp_path / "calls"
    monkeypatch.setenv("RUNPLANE_TEST_CALLS", str(calls))
    monkeypatch.setenv("RUNPLANE_TEST_HANG_AT", "40")
    caplog.set_level(logging.WARNING, logger="runplane.actors")
    named = tmp_path / "calls.victim"
    result = None
    victim = None
    with trio.fail_after(120):  # the lease is 600 s
        async with open_run(tenant, SCALE_PLAY) as run:
            async def coordinate() -> None:
                nonlocal result
                result = await run.map("nums", [{"n": i} for i in range(600)], logged_hang,
                                       contract=SCALE_CONTRACT, workers=2, lease_s=600.0)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(coordinate)
                # Read until it names a pid, and use that very reading: the file is a hard
                # link to the victim's claim, which its later calls truncate and write again.
                text = ""
                while not text:
                    text = named.read_text() if named.exists() else ""
                    if not text:
                        await trio.sleep(0.05)
                victim = int(text)
                os.kill(victim, signal.SIGKILL)
    assert result is not None and result.completed == 600
    released = [r.getMessage() for r in caplog.records if "were released" in r.getMessage()]
    assert len(released) == 1 and f"pid {victim} exited" in released[0], released


async def test_the_coordinator_of_a_workers_map_shows_every_workers_progress(tenant, monkeypatch):
    """Was: nothing between `3376 input rows` and the last line with `--workers`."""
    monkeypatch.setattr(shared_map_module, "PROGRESS_S", 0.05)
    from .plays.scale_play import slow_tag
    from .test_shared_map import CONTRACT as SCALE_CONTRACT, PLAY as SCALE_PLAY

    seen: list = []
    with trio.fail_after(120):
        async with open_run(tenant, SCALE_PLAY) as run:
            result = await run.map("nums", [{"n": i} for i in range(600)], slow_tag,
                                   contract=SCALE_CONTRACT, workers=2, on_progress=seen.append)
    assert result.completed == 600
    assert len(seen) >= 2 and seen[-1].completed == 600 and seen[-1].source_rows == 600
    assert any(0 < s.completed < 600 for s in seen)  # while it ran, not only at the end
    assert [s.completed for s in seen] == sorted(s.completed for s in seen)
