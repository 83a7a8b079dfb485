""""running" means one thing everywhere: rows inside a call of the function now, reported by
every process hosting rows (`engine.runs.row_calls`), summed over processes seen lately."""

from __future__ import annotations

import trio

from runplane.actors import open_run
from runplane.engine.runs import row_calls
from runplane.engine.values.scopes import PlayScope, RunScope
from runplane.engine.sheets import SheetContract
from runplane.cli import status as status_command
from runplane.engine.gateway import mint_token

from .console_support import SECRET, client, login_token
from .gateway_support import serving

CONTRACT = SheetContract(("name",), ("upper",))
CONCURRENCY = 4


def gate():
    """A function whose calls wait for `release`, counting how many are inside."""
    release = trio.Event()
    inside = [0]

    async def fn(row):
        inside[0] += 1
        await release.wait()
        inside[0] -= 1
        return {"upper": row["name"].upper()}

    return fn, release, inside


async def running_now(tenant, play: str) -> dict[str, int]:
    return row_calls.by_table(await row_calls.running(tenant, PlayScope(tenant.org_id, play)))


async def test_running_is_rows_inside_a_call_on_every_surface_and_drops_when_the_map_ends(tenant):
    """Was: the bars said rows admitted and not written (1,878 at concurrency 16), status the
    same from history, the console 0. A one-page list starts every worker at once: the map's
    own progress catches up with calls its gauge's rate limit held back (`catch_up`)."""
    fn, release, inside = gate()
    seen: list = []
    with trio.fail_after(60):
        async with open_run(tenant, "play") as run:
            async with trio.open_nursery() as nursery:
                async def go() -> None:
                    await run.map("t", [{"name": f"r{i}"} for i in range(200)], fn,
                                  contract=CONTRACT, concurrency=CONCURRENCY,
                                  on_progress=seen.append)

                nursery.start_soon(go)
                while await running_now(tenant, "play") != {"t": CONCURRENCY}:
                    await trio.sleep(0.05)
                assert inside[0] == CONCURRENCY
                assert seen and seen[-1].in_call == CONCURRENCY  # the map's own progress
                counts = await status_command.read_counts(
                    tenant, PlayScope(tenant.org_id, "play"), None)
                assert counts["t"].running == CONCURRENCY  # `runplane status`
                document = status_command.status_document(
                    PlayScope(tenant.org_id, "play"), counts, [], {})
                assert document["tables"]["t"]["running"] == CONCURRENCY
                assert counts["t"].queued + counts["t"].leased == 200  # nothing written yet
                async with serving(tenant) as server, client(server.url) as http:  # the console
                    await login_token(http, mint_token(SECRET, tenant.org_id))
                    answer = (await http.get(f"/ui/api/runs/play/{run.run_id}")).json()
                    assert [m["sheet"]["running"] for m in answer["maps"]] == [CONCURRENCY]
                release.set()
        while await running_now(tenant, "play"):  # the last report says 0 at once
            await trio.sleep(0.05)
    assert seen[-1].in_call == 0


async def test_a_cancelled_runs_rows_stop_counting_at_once(tenant):
    """Was: after Ctrl-C, `status` kept `running 1849` for ~30 s with nothing running."""
    fn, _release, _inside = gate()
    with trio.fail_after(60):
        with trio.CancelScope() as interrupted:
            async with open_run(tenant, "play") as run:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: run.map(
                        "t", [{"name": f"r{i}"} for i in range(50)], fn, contract=CONTRACT,
                        concurrency=CONCURRENCY))
                    while await running_now(tenant, "play") != {"t": CONCURRENCY}:
                        await trio.sleep(0.05)
                    interrupted.cancel()  # as Ctrl-C does
        while await running_now(tenant, "play"):
            await trio.sleep(0.05)


async def test_a_crashed_processs_report_stops_counting_once_it_is_stale(tenant, monkeypatch):
    """A process that died wrote no last 0: its report counts until it is `FRESH_S` old."""
    monkeypatch.setattr(row_calls, "FRESH_S", 0.5)
    scope = RunScope(tenant.org_id, "play", "crashed-run")
    await row_calls.report(tenant, scope, "map-0", "host:1:ab", "t", 7)
    await row_calls.report(tenant, scope, "map-0", "host:2:cd", "t", 2)
    assert await running_now(tenant, "play") == {"t": 9}  # summed over processes
    with trio.fail_after(30):
        while await running_now(tenant, "play"):
            await trio.sleep(0.1)


async def test_a_shared_map_workers_rows_in_a_call_count_as_running(tenant):
    from runplane.actors.shared.config import PlayFile
    from runplane.actors.shared.worker import WorkerOptions, serve_play

    from .plays import computed_play

    release = trio.Event()
    PlayFile.load(computed_play.__file__).module.GATE = release  # the module workers run
    with trio.fail_after(60):
        async with open_run(tenant, computed_play.PLAY) as run:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: run.map(
                    "nums", [{"n": i} for i in range(40)], computed_play.gated,
                    contract=SheetContract(("n",), ("double",)), shared=True))
                nursery.start_soon(lambda: serve_play(
                    tenant, computed_play.PLAY, computed_play.__file__,
                    WorkerOptions(concurrency=3, exit_when_idle=True)))
                while await running_now(tenant, computed_play.PLAY) != {"nums": 3}:
                    await trio.sleep(0.05)
                release.set()
        while await running_now(tenant, computed_play.PLAY):
            await trio.sleep(0.05)


async def test_a_fast_functions_calls_report_progress_once_a_second_not_once_a_call(tenant):
    """Was: a call that ended before the next began reported a snapshot each time (a snapshot,
    the metrics' push and the observer: a fifth of a no-op map's CPU). The snapshots now come
    from admission, completion and at most one a second from the calls; the last says 0."""
    seen: list = []

    async def fast(row):
        return {"upper": row["name"].upper()}

    rows = 2_000
    async with open_run(tenant, "play") as run:
        result = await run.map("fast", [{"name": f"r{i}"} for i in range(rows)], fast,
                               contract=CONTRACT, concurrency=CONCURRENCY, on_progress=seen.append)
    assert result.completed == rows
    assert len(seen) < rows // 4, len(seen)  # was one a row; now admissions, batches, 1/s
    assert seen[-1].in_call == 0 and seen[-1].completed == rows
