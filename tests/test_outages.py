"""Server restarts: a private embedded PostgreSQL is stopped and started under a
running map. An outage shorter than the outage budget is ridden out with nothing lost and
nothing done twice; a longer one ends the run with `StoreOutageError`, leaves it wakeable, and
a wake finishes it."""

from __future__ import annotations

import collections
import uuid

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import open_tenant
from runplane.engine.errors import StoreOutageError, StoreUnavailableError, leaf_errors
from runplane.engine.sheets import SheetContract
from runplane.engine.sheets.layout import layout_for

from .outage_support import private_server, remove_private_server
from .run_helpers import outbox_state
from .sheet_helpers import counters_match, play_scope

PLAY = "outages"
TABLE = "companies"
CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
ROW_S = 0.002          # the map function's latency: the run is still going when the server stops
CONCURRENCY = 16
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server():
    server, root = private_server()
    try:
        yield server
    finally:
        remove_private_server(server, root)


def fresh_schema() -> str:
    return f"o_{uuid.uuid4().hex[:12]}"


class Map:
    """The map function (counting calls per row) and a trip wire at N completed rows."""

    def __init__(self, rows: int, stop_after: int) -> None:
        self.rows = [{"name": f"row-{i}"} for i in range(rows)]
        self.calls: collections.Counter = collections.Counter()
        self.stop_after = stop_after
        self.tripped = trio.Event()
        self.completed_at_trip: int | None = None

    async def fn(self, row: dict) -> dict:
        self.calls[row["name"]] += 1
        await trio.sleep(ROW_S)
        return {"score": len(row["name"])}

    def on_progress(self, progress) -> None:
        if progress.completed >= self.stop_after and not self.tripped.is_set():
            self.completed_at_trip = progress.completed
            self.tripped.set()

    async def run(self, run):
        return await run.map(TABLE, self.rows, self.fn, contract=CONTRACT,
                             concurrency=CONCURRENCY, on_progress=self.on_progress)


async def assert_finished_once(tenant, rows: int) -> None:
    """Every row is in the sheet, finished, its call counted once; counters equal COUNT."""
    layout = layout_for(tenant, play_scope(tenant, PLAY), TABLE)
    async with tenant.connection("sheet") as conn:
        stored = await conn.fetchrow(
            f"SELECT count(*) AS n, count(*) FILTER (WHERE _status = 'enriched') AS done, "
            f"count(DISTINCT _key) AS keys, sum(_attempts) AS attempts FROM {layout.qualified}")
    assert dict(stored) == {"n": rows, "done": rows, "keys": rows, "attempts": rows}
    assert await counters_match(tenant, play_scope(tenant, PLAY), TABLE) == (True, "")


async def ride_out(server, *, outage_s: float, rows: int = 30_000, stop_after: int = 5_000,
                   mode: str = "fast"):
    work = Map(rows, stop_after)
    seen: dict = {}
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_tenant("org-outage", server.dsn, schema=fresh_schema(),
                               outage_budget_s=60) as tenant:

            async def outage() -> None:
                await work.tripped.wait()
                await server.stop(mode)
                await trio.sleep(outage_s)
                seen["waiting_s"] = seen["run"].outage.waiting_s()  # the run is waiting
                await server.start()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(outage)
                async with open_run(tenant, PLAY) as run:
                    seen["run"] = run
                    result = await work.run(run)
            assert server.stops and seen["waiting_s"] is not None
            assert work.completed_at_trip is not None and work.completed_at_trip < rows
            assert run.outage.outages >= 1 and run.outage.waiting_s() is None
            assert (result.completed, result.failed, result.fenced) == (rows, 0, 0)
            assert len(work.calls) == rows and set(work.calls.values()) == {1}
            await assert_finished_once(tenant, rows)
            assert await outbox_state(tenant, run.run_id) == "done"


async def test_a_run_rides_out_a_five_second_server_restart(server):
    await ride_out(server, outage_s=5)


async def test_a_run_rides_out_a_server_crash_and_its_recovery(server):
    """Immediate shutdown: no farewell, commits in flight may or may not have happened; the
    restart runs crash recovery. Nothing is lost or applied twice all the same."""
    await ride_out(server, outage_s=3, mode="immediate")


@pytest.mark.outage
async def test_a_run_rides_out_a_thirty_second_server_restart(server):
    await ride_out(server, outage_s=30)


@pytest.mark.outage
async def test_an_outage_past_the_budget_ends_the_run_and_a_wake_finishes_it(server):
    rows, outage_s, budget_s = 10_000, 90, 10
    work = Map(rows, stop_after=2_000)
    ended = trio.Event()
    seen: dict = {}
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_tenant("org-outage", server.dsn, schema=fresh_schema(),
                               outage_budget_s=budget_s) as tenant:

            async def outage() -> None:
                await work.tripped.wait()
                await server.stop()
                stopped = trio.current_time()
                await ended.wait()
                seen["running_when_ended"] = server.running()
                await trio.sleep_until(stopped + outage_s)
                await server.start()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(outage)
                try:
                    async with open_run(tenant, PLAY) as run:
                        seen["run_id"] = run.run_id
                        await work.run(run)
                except BaseException as exc:
                    seen["error"] = exc
                finally:
                    ended.set()
            leaves = leaf_errors(seen["error"])
            assert any(isinstance(leaf, StoreOutageError) for leaf in leaves), leaves
            outage_error = next(leaf for leaf in leaves if isinstance(leaf, StoreOutageError))
            assert isinstance(outage_error, StoreUnavailableError)
            assert outage_error.budget_s == budget_s and outage_error.waited_s >= budget_s
            assert seen["running_when_ended"] is False  # it ended during the outage
            # Not terminal: the entry stays open and the staged input stays for a wake.
            assert await outbox_state(tenant, seen["run_id"]) == "open"
            done_before_wake = sum(work.calls.values())
            async with open_run(tenant, PLAY, seen["run_id"]) as run:
                result = await work.run(run)
            assert result.failed == 0 and result.completed + result.cached == rows
            assert result.cached > 0  # what the first incarnation wrote is not redone
            assert sum(work.calls.values()) - done_before_wake == result.completed
            await assert_finished_once(tenant, rows)
            assert await outbox_state(tenant, run.run_id) == "done"


def test_the_demo_waits_for_the_database_then_ends_with_the_resume_command(server, tmp_path):
    """`runplane demo` with a 5 s budget: the server stops mid-run, the demo says it is waiting
    for the database, ends with StoreOutageError and the resume command; once the server is
    back, the pasted command finishes the run. (The line names the public class,
    StoreUnavailableError, of the StoreOutageError the run ended with.)"""
    import subprocess

    from .cli_helpers import cli_env, pasted, start_cli, wait_for_text

    schema = fresh_schema()
    env = cli_env(RUNPLANE_DSN=server.dsn, RUNPLANE_OUTAGE_BUDGET_S="5")
    log = tmp_path / "demo.log"
    proc = start_cli("demo", "--rows", "20000", "--schema", schema, "--fail-rate", "0",
                     "--latency-ms", "2", stdout_path=log, env=env)
    try:
        wait_for_text(log, "to resume it:", proc)
        server.stop_now()
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            server.start_now()
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert proc.returncode == 1, (out, err)
    assert "demo: waiting for the database (" in out, (out, err)
    assert "runplane: StoreUnavailableError: " in err and "outage budget of 5s" in err, err
    resume = [line for line in err.splitlines() if line.startswith("runplane: resume run ")]
    assert len(resume) == 1, err
    command = resume[0].split(" with: ", 1)[1]
    again = subprocess.run(pasted(command), capture_output=True, text=True, env=env,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    line = [l for l in again.stdout.splitlines() if l.startswith("demo: run ")][-1]
    fields = dict(zip(line.split()[3::2], line.split()[4::2]))
    assert int(fields["cached"]) + int(fields["completed"]) == 20000, line
    assert int(fields["failed"]) == 0, line


SLOW_PLAY = '''
import trio

from runplane.engine.sheets import SheetContract

PLAY = "waits"
CONTRACT = SheetContract(inputs=("name",), outputs=("size",))


async def measure(row):
    await trio.sleep(0.02)
    return {"size": len(row["name"])}


async def play(run, rows):
    return await run.map("things", rows, measure, contract=CONTRACT, concurrency=2)
'''


def test_runplane_run_says_in_its_progress_lines_that_it_waits_for_the_database(server, tmp_path):
    """`runplane run` in a log (a progress block every 0.3 s): the server stops mid-run and a
    progress block says the run is waiting for the database, how long and within what budget,
    as the demo's bars do; the server comes back and the run finishes every row (exit 0)."""
    import subprocess

    from .cli_helpers import RUNPLANE, ROOT, cli_env, wait_for_text

    play, rows = tmp_path / "waits_play.py", tmp_path / "rows.csv"
    play.write_text(SLOW_PLAY)
    rows.write_text("name\n" + "".join(f"n{i}\n" for i in range(300)))
    env = cli_env(RUNPLANE_DSN=server.dsn, RUNPLANE_OUTAGE_BUDGET_S="120")
    log = tmp_path / "run.err"
    with log.open("w") as err:
        proc = subprocess.Popen([*RUNPLANE, "run", str(play), "--input", str(rows), "--schema",
                                 fresh_schema(), "--progress-every", "0.3"],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                cwd=ROOT)
    try:
        wait_for_text(log, "progress things: ", proc)
        server.stop_now()
        try:
            wait_for_text(log, "progress: waiting for the database (", proc)
        finally:
            server.start_now()
        proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text
    waiting = [line for line in text.splitlines() if line.startswith("progress: waiting")]
    assert waiting and all(line.endswith("; the outage budget is 120 s") for line in waiting), text
    last = [line for line in text.splitlines() if line.startswith("progress things: ")][-1]
    assert last.startswith("progress things: 300/300 rows") and "completed 300" in last, last
    assert not text.splitlines()[-1].startswith("progress: waiting"), text  # back before the end
