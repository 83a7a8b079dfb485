"""Cancelling a run (SPEC §32, §35): a stamp on the run that every process of the run polls;
its maps stop early with stop reason "cancelled", what was written stays and is counted, and
the run ends retired. The same through the gateway, and from the command line."""

from __future__ import annotations

import trio

from runplane.actors import open_run
from runplane.actors.cancellation import CANCELLED
from runplane.engine import sheets
from runplane.engine.gateway import open_gateway
from runplane.engine.runs import history, outbox
from runplane.engine.runs.cancel import CancelAnswer, cancel_requested, request_cancel
from runplane.engine.runs.history import MapRunState
from runplane.engine.values.scopes import RunScope

from .cli_helpers import RUNPLANE, cli_env, schema, start_cli, wait_for_text  # noqa: F401
from .gateway_support import FAST_RETRY, server, token_for  # noqa: F401 - fixture

CONTRACT = sheets.SheetContract(inputs=("n",), outputs=("double",))
ROWS = [{"n": i} for i in range(5_000)]


async def cancel_once_started(port, run, started: trio.Event) -> list[CancelAnswer]:
    """Ask twice once rows are running: the second request finds the first."""
    await started.wait()
    return [await request_cancel(port, run.scope), await request_cancel(port, run.scope)]


async def map_until_cancelled(port, requester_port, play: str):
    """Map slow rows; once 50 are done, ask (through `requester_port`) for the run to stop.
    Returns (the run, the map's result, the cancel answer)."""
    started = trio.Event()
    done = 0
    answers: list[CancelAnswer] = []

    async def double(row: dict) -> dict:
        nonlocal done
        await trio.sleep(0.005)
        done += 1
        if done >= 50:
            started.set()
        return {"double": row["n"] * 2}

    async with open_run(port, play) as run:
        async with trio.open_nursery() as nursery:
            async def ask() -> None:
                answers.extend(await cancel_once_started(requester_port, run, started))
            nursery.start_soon(ask)
            result = await run.map("things", ROWS, double, contract=CONTRACT, concurrency=4)
        later = await run.map("others", ROWS[:10], double, contract=CONTRACT)
    return run, result, later, answers


async def test_a_cancelled_run_stops_its_maps_keeps_what_it_wrote_and_is_retired(tenant):
    run, result, later, answers = await map_until_cancelled(tenant, tenant, "cancel")
    assert answers == [CancelAnswer.REQUESTED, CancelAnswer.ALREADY]
    assert run.cancelled
    assert result.stopped_early and result.stop_reason == CANCELLED
    assert 50 <= result.completed < len(ROWS)
    summary = await sheets.summary(tenant, run.scope.play_scope, "things")
    assert summary.completed == result.completed  # what was written stays, counted
    assert later.stopped_early and later.admitted == 0  # a map after the cancel stops at once
    maps = {m.record.table_namespace: m.record for m in await history.list_maps(
        tenant, run.scope.play_scope, [run.run_id])}
    assert maps["things"].state == MapRunState.STOPPED_EARLY
    assert maps["things"].stop_reason == CANCELLED
    entry = await outbox.get(tenant, run.scope)
    assert entry is not None and entry.state == outbox.OutboxState.DONE  # retired
    # a finished run: nothing to stop; an unknown run: unknown
    assert await request_cancel(tenant, run.scope) is CancelAnswer.FINISHED
    async with open_run(tenant, "cancel") as other:
        pass
    assert await request_cancel(tenant, other.scope) is CancelAnswer.FINISHED
    assert not await cancel_requested(tenant, other.scope)
    unknown = RunScope(tenant.org_id, "cancel", "no-such-run")
    assert await request_cancel(tenant, unknown) is CancelAnswer.UNKNOWN


async def test_a_run_through_the_gateway_is_cancelled_by_the_runs_cancel_action(tenant, server):
    async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as runner, \
            open_gateway(server.url, token_for(tenant, actions=("runs.cancel",)),
                         retry=FAST_RETRY) as operator:
        run, result, _, answers = await map_until_cancelled(runner, operator, "cancel-remote")
    assert answers == [CancelAnswer.REQUESTED, CancelAnswer.ALREADY]
    assert result.stopped_early and result.stop_reason == CANCELLED
    assert result.completed < len(ROWS)
    entry = await outbox.get(tenant, run.scope)
    assert entry is not None and entry.state == outbox.OutboxState.DONE


def test_runplane_cancel_stops_a_running_demo_which_exits_130(schema, tmp_path, capsys):
    import json
    import re
    import subprocess

    from runplane.cli import main

    log = tmp_path / "demo.log"
    proc = start_cli("demo", "--rows", "100000", "--latency-ms", "40", "--concurrency", "4",
                     "--schema", schema, stdout_path=log, env=cli_env())
    try:
        content = wait_for_text(log, "started (epoch", proc)
        run_id = re.search(r"^run (\S+) of play demo started", content, re.MULTILINE).group(1)
        assert main(["cancel", "demo", run_id, "--schema", schema]) == 0
        assert "cancelled; its processes stop their rows" in capsys.readouterr().out
        status = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 130, err
    assert f"runplane: run {run_id} was cancelled" in err
    assert "resume" not in err  # finished: a new run reuses its rows, nothing to resume
    assert main(["cancel", "demo", run_id, "--schema", schema]) == 0
    assert "already finished" in capsys.readouterr().out
    assert main(["cancel", "demo", "no-such-run", "--schema", schema]) == 2
    shown = subprocess.run([*RUNPLANE, "runs", "demo", run_id, "--schema", schema, "--json"],
                           capture_output=True, text=True, env=cli_env(), timeout=60)
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["state"] == "done" and document["resume_command"] is None  # retired
    (shown_map,) = document["maps"]
    assert (shown_map["state"], shown_map["stop_reason"]) == ("stopped early", "cancelled")
    assert shown_map["completed"] < 100_000


async def test_a_cancelled_shared_map_stops_its_workers_and_the_run_is_retired(tenant):
    from pathlib import Path

    from runplane.actors.shared.worker import WorkerOptions, serve_play
    from runplane.engine.shared import maps as sm

    from .plays.scale_play import slow_tag
    from .sheet_helpers import counters_match

    contract = sheets.SheetContract(("n",), ("pid", "double"))
    play_file = str(Path(__file__).parent / "plays" / "scale_play.py")
    rows = [{"n": i} for i in range(3000)]
    with trio.fail_after(120):
        async with open_run(tenant, "scale") as run:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: serve_play(tenant, "scale", play_file, WorkerOptions(
                    exit_when_idle=True, poll_s=0.05, concurrency=4)))

                done_enough = trio.Event()

                def watch(snapshot) -> None:
                    if snapshot.completed >= 50:
                        done_enough.set()

                async def cancel_when_rows_are_done() -> None:
                    await done_enough.wait()
                    assert await request_cancel(tenant, run.scope) is CancelAnswer.REQUESTED
                nursery.start_soon(cancel_when_rows_are_done)
                result = await run.map("nums", rows, slow_tag, contract=contract, shared=True,
                                       concurrency=4, on_progress=watch)
    assert run.cancelled
    assert result.stopped_early and result.stop_reason == CANCELLED
    assert 50 <= result.completed < len(rows)
    status = await sm.map_status(tenant, run.ref, result.map_invocation_id)
    assert status.state == "cancelled"
    ok, why = await counters_match(tenant, run.scope.play_scope, "nums")
    assert ok, why
    entry = await outbox.get(tenant, run.scope)
    assert entry is not None and entry.state == outbox.OutboxState.DONE


async def test_a_map_history_write_is_the_run_cancellation_poll(tenant):
    """A map's heartbeat answers the run's cancellation stamp (one request a second per run, not
    two): while writes answer it, the run's watcher (polling every `CANCEL_POLL_S`) sends no
    poll of its own; a stamp set meanwhile stops the run at the next write."""
    from runplane.actors.history import MapRecorder
    from runplane.engine.runs.cancel import CANCEL_POLL_S

    async with open_run(tenant, "cancel-heard") as run:
        recorder = MapRecorder(tenant, run.scope, "t/map-0", "t", stop=run.stop)
        record = recorder._record(MapRunState.RUNNING, None)
        before = tenant.permits()["receipts"].acquired
        writes = 0
        while writes * 0.2 < 2 * CANCEL_POLL_S:  # a write every 0.2 s, for two poll periods
            await recorder._write(record)
            writes += 1
            assert not run.cancelled
            await trio.sleep(0.2)
        assert tenant.permits()["receipts"].acquired - before == writes, (
            "the run's watcher polled although every write answered the stamp")
        assert await request_cancel(tenant, run.scope) == CancelAnswer.REQUESTED
        await recorder._write(record)
        assert run.cancelled  # the write saw the stamp


async def test_a_stalled_maps_heartbeat_is_its_runs_only_cancellation_poll(tenant, monkeypatch):
    """While a map's heartbeat runs, the run's watcher sends no poll of its own, even for a map
    whose snapshot does not change (its rows wait inside the function): the watcher nudges the
    heartbeat, which writes unchanged and reads the stamp, so a cancel still stops the map."""
    from runplane.actors import cancellation
    from runplane.engine.runs.cancel import CANCEL_POLL_S

    polls: list[float] = []
    writes: list[float] = []
    real_poll, real_record = cancellation.cancel_requested, history.record_map

    async def poll(port, scope):
        polls.append(trio.current_time())
        return await real_poll(port, scope)

    async def record(port, scope, entry):
        writes.append(trio.current_time())
        return await real_record(port, scope, entry)

    monkeypatch.setattr(cancellation, "cancel_requested", poll)
    monkeypatch.setattr(history, "record_map", record)
    inside, never = trio.Semaphore(0), trio.Event()

    async def stalled(row: dict) -> dict:
        inside.release()
        await never.wait()
        return {"double": row["n"] * 2}

    with trio.fail_after(30):
        async with open_run(tenant, "stalled") as run:
            async with trio.open_nursery() as nursery:
                async def cancel_while_stalled() -> None:
                    for _ in range(2):
                        await inside.acquire()
                    watched = trio.current_time()
                    await trio.sleep(2 * CANCEL_POLL_S + 0.5)  # two poll periods, unchanged
                    assert polls == []
                    assert len([t for t in writes if t > watched]) >= 2
                    assert await request_cancel(tenant, run.scope) is CancelAnswer.REQUESTED
                nursery.start_soon(cancel_while_stalled)
                result = await run.map("stalled", ROWS[:2], stalled, contract=CONTRACT,
                                       concurrency=2)
    assert run.cancelled and result.stop_reason == CANCELLED and result.completed == 0
    assert polls == []  # the heartbeat read the stamp; the watcher never polled


async def test_the_watcher_sends_no_poll_while_a_heartbeat_runs_even_when_due(tenant, monkeypatch):
    """The race of a heartbeat and a poll coming due together, forced: the watcher's poll
    comes due period after period while a heartbeat runs (`RunStop.beat`): the watcher nudges
    the heartbeat (here, nobody takes the nudge) and sends no poll; once no heartbeat runs, it
    polls."""
    from runplane.actors import cancellation
    from runplane.actors.cancellation import RunStop, watch_for_cancel

    polls: list[float] = []
    real_poll = cancellation.cancel_requested

    async def poll(port, scope):
        polls.append(trio.current_time())
        return await real_poll(port, scope)

    monkeypatch.setattr(cancellation, "cancel_requested", poll)
    async with open_run(tenant, "due") as run:
        stop = RunStop()
        async with trio.open_nursery() as nursery:
            with stop.beat():
                nursery.start_soon(lambda: watch_for_cancel(tenant, run.scope, stop, poll_s=0.02))
                await trio.sleep(0.3)  # fifteen poll periods
                assert polls == []
            with trio.fail_after(10):
                while not polls:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
