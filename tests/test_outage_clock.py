"""The outage budget is a wall-clock bound: a run whose database stops answering — connects that
time out rather than being refused, statements left hanging — ends within 2 s of its budget,
and a map cancelled during an outage (Ctrl-C) exits at once instead of flushing against a
database that is away. The faults come from `tests.pg_proxy`'s blackhole."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import trio
from rich.console import Console

from runplane.actors import open_run
from runplane.actors.retry import STALL_S, OutageWatch, retry_transient
from runplane.actors.run import ended_by_outage
from runplane.cli.demo import run_demo
from runplane.cli.main import build_parser
from runplane.cli.operators import RunNotice
from runplane.engine import open_tenant, runs, sheets
from runplane.engine.errors import StoreOutageError, TransactionStateUnknownError
from runplane.engine.pg import COMMIT_RESOLVE_TIMEOUT, COMMIT_TIMEOUT

from .cli_helpers import cli_env, start_cli, wait_for_text
from .conftest import fresh_schema
from .pg_proxy import open_pg_proxy
from .test_outage_budget import Flaky

BUDGET_S = 3.0
BOUND_S = 2.0  # the run ends within this of its budget
CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("upper",))


def rows(n: int) -> list[dict]:
    return [{"name": f"row-{i}", "n": i} for i in range(n)]


async def blackholed_run(dsn: str, *, sever: bool, cancel_after_s: float | None = None):
    """Run a long map through a proxy, blackhole the proxy once 300 rows are done, and report
    (the error the run ended with, seconds from the blackhole to the run's end, the proxy)."""
    outcome: dict = {}
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-clock", proxy.dsn, schema=fresh_schema(),
                               outage_budget_s=BUDGET_S) as tenant:
            progressed = trio.Event()

            async def enrich(row: dict) -> dict:
                if row["n"] >= 300:
                    progressed.set()
                await trio.sleep(0.002)
                return {"upper": row["name"].upper()}

            async def run_it(cancel_scope: trio.CancelScope) -> None:
                with cancel_scope:
                    try:
                        async with open_run(tenant, "clock") as run:
                            await run.map("things", rows(50_000), enrich, contract=CONTRACT,
                                          concurrency=8)
                    except Exception as exc:  # noqa: BLE001 - the test inspects it
                        outcome["error"] = exc
                outcome["ended"] = trio.current_time()

            scope = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_it, scope)
                await progressed.wait()
                proxy.set_blackhole(True, sever=sever)
                cut = trio.current_time()
                if cancel_after_s is not None:
                    await trio.sleep(cancel_after_s)
                    cut = trio.current_time()
                    scope.cancel()  # what Ctrl-C does to the command
            elapsed = outcome["ended"] - cut
            # the tenant closes against the blackhole, too: it must not hang
            closing = trio.current_time()
        closed_s = trio.current_time() - closing
        proxy.set_blackhole(False)
    return outcome.get("error"), elapsed, closed_s, proxy


async def test_connects_that_time_out_count_against_the_budget(dsn):
    # every open connection is dropped and every new connect goes unanswered (times out)
    error, elapsed, closed_s, proxy = await blackholed_run(dsn, sever=True)
    print(f"run ended {elapsed:.2f}s after the blackhole (budget {BUDGET_S}s); "
          f"tenant closed in {closed_s:.2f}s")
    assert ended_by_outage(error), repr(error)
    assert proxy.fired["blackhole_connect"] >= 1  # connects did time out
    assert elapsed < BUDGET_S + BOUND_S, elapsed


async def test_statements_left_unanswered_count_against_the_budget(dsn):
    # open connections stay open but nothing comes back: no error ever arrives
    error, elapsed, closed_s, _ = await blackholed_run(dsn, sever=False)
    print(f"run ended {elapsed:.2f}s after the blackhole (budget {BUDGET_S}s); "
          f"tenant closed in {closed_s:.2f}s")
    assert ended_by_outage(error), repr(error)
    assert elapsed < BUDGET_S + BOUND_S, elapsed


async def test_a_commit_left_unanswered_is_not_waited_on_past_the_callers_deadline(dsn):
    """A COMMIT waits shielded (up to `COMMIT_TIMEOUT`, 10 s) so a transaction's fate is known;
    but not past a deadline its caller set — a run's cut-off of an attempt the database leaves
    unanswered: found by the test above when the database stopped answering just as a COMMIT
    was sent, and the run ended 10.5 s after the blackhole instead of within its budget."""
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-clock", proxy.dsn, schema=fresh_schema()) as tenant:
            async with tenant.connection("sheet") as conn:
                started = trio.current_time()
                with pytest.raises(TransactionStateUnknownError, match="within 1.0s"):
                    with trio.move_on_after(1.0):  # the caller's deadline
                        async with conn.transaction():
                            # as a sheet transaction does: the id is known, so COMMIT is next
                            conn.note_transaction_id(
                                await conn.fetchval("SELECT txid_current()::text"))
                            proxy.set_blackhole(True, sever=False)  # COMMIT goes unanswered
                waited = trio.current_time() - started
            proxy.set_blackhole(False)
    assert waited < COMMIT_TIMEOUT, waited


async def test_a_lost_commits_fate_is_not_waited_on_past_a_cancellation(dsn):
    """A COMMIT lost with its connection is resolved on a fresh one; when the server is away
    that connect hangs. A cancellation (Ctrl-C) arriving meanwhile ends the wait: found when a
    run cancelled during an outage waited out its whole budget in an admission's resolve."""
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-clock", proxy.dsn, schema=fresh_schema()) as tenant:
            async with tenant.connection("sheet") as conn:
                scope = trio.CancelScope()
                async with trio.open_nursery() as nursery:
                    async def ctrl_c() -> None:
                        while not proxy.fired["blackhole_connect"]:  # the fate's connect hangs
                            await trio.sleep(0.01)
                        scope.cancel()
                    nursery.start_soon(ctrl_c)
                    started = trio.current_time()
                    with scope:
                        async with conn.transaction():
                            conn.note_transaction_id(
                                await conn.fetchval("SELECT txid_current()::text"))
                            # the connection is dropped; the fate's connect is never answered
                            proxy.set_blackhole(True, sever=True)
                    waited = trio.current_time() - started
            proxy.set_blackhole(False)
    assert scope.cancelled_caught
    assert proxy.fired["blackhole_connect"] >= 1
    assert waited < COMMIT_RESOLVE_TIMEOUT, waited


async def test_a_map_cancelled_during_an_outage_ends_at_once(dsn):
    error, elapsed, closed_s, _ = await blackholed_run(dsn, sever=True, cancel_after_s=1.0)
    print(f"cancelled run ended {elapsed:.2f}s after its cancellation; "
          f"tenant closed in {closed_s:.2f}s")
    assert error is None, repr(error)  # cancelled, not failed: the run stays open to resume
    assert elapsed + closed_s < BOUND_S, (elapsed, closed_s)


async def test_a_connect_abandoned_unanswered_makes_teardown_hurry(dsn):
    """A connect the server leaves unanswered fails no call until the budget cuts it; a map
    cancelled (Ctrl-C) in that window must still not flush against a database that is away.
    A statement that is merely slow when given up on is no such sign."""
    from runplane.actors.retry import STALL_S, hurry_if_waiting, install_watch, reset_watch

    watch = OutageWatch(budget_s=60)
    token = install_watch(watch)
    try:
        async with open_pg_proxy(dsn) as proxy:
            async with open_tenant("org-clock", proxy.dsn, schema=fresh_schema()) as tenant:
                async def slow_statement() -> None:
                    async with tenant.connection("sheet") as conn:
                        await conn.execute("SELECT pg_sleep(30)")

                with trio.move_on_after(STALL_S * 2):  # slow, given up: the server is there
                    await retry_transient(slow_statement, watch=watch)
                with hurry_if_waiting() as waiting:
                    assert not waiting
                proxy.set_blackhole(True, sever=True)  # open connections dropped, connects hang

                async def fresh_connect() -> None:
                    async with tenant.connection("sheet") as conn:
                        await conn.fetchval("SELECT 1")

                with trio.move_on_after(STALL_S * 2):  # unanswered past STALL_S, given up
                    while True:  # the pooled connection fails at once; then a connect hangs
                        try:
                            await retry_transient(fresh_connect, watch=watch)
                        except StoreOutageError:
                            break
                assert proxy.fired["blackhole_connect"] >= 1
                assert watch.connects.stalled()  # the hung connect was seen
                watch.since = None  # as when no call had failed yet (a pool with no
                watch.waiting = 0   # connection to drop): the hung connect alone tells
                with hurry_if_waiting() as waiting:  # ... teardown tries once, briefly
                    assert waiting
                proxy.set_blackhole(False)
                await retry_transient(fresh_connect, watch=watch)
                assert not watch.away()  # a call answered: the database is back
    finally:
        reset_watch(token)


def test_doctor_prints_the_outage_budget_in_force(dsn):
    from .test_doctor import run_doctor

    default = run_doctor(env_dsn=dsn)
    assert default.returncode == 0, default.stderr
    assert "outage      budget 60s (the default; set RUNPLANE_OUTAGE_BUDGET_S" in default.stdout
    env = dict(os.environ, RUNPLANE_DSN=dsn, RUNPLANE_OUTAGE_BUDGET_S="7.5")
    given = subprocess.run([sys.executable, "-m", "runplane.cli", "doctor"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert given.returncode == 0, given.stderr
    assert "outage      budget 7.5s (from RUNPLANE_OUTAGE_BUDGET_S)" in given.stdout


async def test_ctrl_c_during_an_outage_exits_within_two_seconds_with_the_resume_command(
        dsn, tmp_path):
    async with open_pg_proxy(dsn) as proxy:
        log = tmp_path / "demo.log"
        proc = start_cli("demo", "--rows", "20000", "--schema", fresh_schema(), "--fail-rate",
                         "0", "--latency-ms", "2", stdout_path=log,
                         env=cli_env(RUNPLANE_DSN=proxy.dsn))  # the default 60 s budget
        try:
            await trio.to_thread.run_sync(wait_for_text, log, "to resume it:", proc)
            proxy.set_blackhole(True, sever=True)
            await trio.to_thread.run_sync(wait_for_text, log, "waiting for the database (", proc)
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            await trio.to_thread.run_sync(proc.wait, 60)
            exit_s = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
    err = proc.stderr.read()
    print(f"Ctrl-C during an outage: the process exited {exit_s:.2f}s later")
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.startswith("runplane: resume run ")], err
    assert exit_s < BOUND_S, exit_s


async def test_an_outage_while_the_demo_records_its_start_shows_and_ctrl_c_still_exits_at_once(
        dsn, monkeypatch):
    """The database goes away just after the demo printed its start line, while it records the
    resume command (before the map starts): the outage shows as a "waiting for the database"
    line at once, and a cancellation then (what Ctrl-C is, `cli.commands.run_trio`) ends the
    demo within `BOUND_S` instead of after the 60 s budget. Forced at that step by wrapping the
    record call; the subprocess test above lands there only by chance."""
    recorded = runs.record_command
    output = io.StringIO()
    async with open_pg_proxy(dsn) as proxy:
        async def record_during_an_outage(*args, **kwargs):
            proxy.set_blackhole(True, sever=True)
            return await recorded(*args, **kwargs)

        monkeypatch.setattr(runs, "record_command", record_during_an_outage)
        argv = ["demo", "--rows", "2000", "--schema", fresh_schema(), "--fail-rate", "0",
                "--dsn", proxy.dsn]  # the default 60 s outage budget
        args = build_parser().parse_args(argv)
        args.argv, args.notice = argv, RunNotice(argv, "--resume")
        with trio.CancelScope() as interrupt:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_demo, args, Console(file=output, width=120))
                with trio.fail_after(20):  # the code before showed nothing for the budget
                    while "demo: waiting for the database" not in output.getvalue():
                        await trio.sleep(0.05)
                sent = time.monotonic()
                interrupt.cancel()
        exit_s = time.monotonic() - sent
        proxy.set_blackhole(False)
    print(f"cancelled while recording the start: ended {exit_s:.2f}s later")
    assert args.notice.resume_command is not None
    assert exit_s < BOUND_S, exit_s


async def test_a_zero_budget_never_cuts_an_attempt_that_has_not_failed(autojump_clock):
    watch = OutageWatch(budget_s=0)

    async def slow() -> str:
        await trio.sleep(30)  # a slow answer is an answer
        return "ok"

    assert await retry_transient(slow, watch=watch) == "ok"
    with pytest.raises(StoreOutageError):
        await retry_transient(Flaky(failures=1), watch=watch)


async def test_an_attempt_left_unanswered_for_the_budget_is_an_outage(autojump_clock):
    watch = OutageWatch(budget_s=5)

    async def hangs() -> str:
        await trio.sleep_forever()

    started = trio.current_time()
    with pytest.raises(StoreOutageError, match="cut off at the budget"):
        await retry_transient(hangs, watch=watch)
    assert trio.current_time() - started == pytest.approx(5)
    assert watch.exhausted


async def test_a_connect_left_unanswered_shows_as_waiting_from_its_start(autojump_clock):
    """Before any call fails, a connect unanswered past `STALL_S` is a wait for the database,
    counted from the connect's start (what the demo and the map's progress show); one answered
    in time is not, and the wait is over once a call is answered."""
    watch = OutageWatch(budget_s=60)
    started = trio.current_time()
    seen: list[float | None] = []

    async def connect_hangs(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            with watch.connects.connecting():
                await trio.sleep_forever()

    with watch.connects.connecting():
        await trio.sleep(STALL_S / 2)  # a connect answered in time
    assert watch.waiting_s() is None
    async with trio.open_nursery() as nursery:
        hanging = await nursery.start(connect_hangs)
        await trio.sleep(STALL_S / 2)
        seen.append(watch.waiting_s())  # not yet past STALL_S
        await trio.sleep(STALL_S)
        seen.append(watch.waiting_s())
        hanging.cancel()  # given up on: still a wait
    assert seen[0] is None
    assert seen[1] == pytest.approx(1.5 * STALL_S)
    assert watch.waiting_s() == pytest.approx(1.5 * STALL_S)
    assert watch.away()
    watch.connects.clear()  # a call was answered
    assert watch.waiting_s() is None
    assert trio.current_time() - started == pytest.approx(2 * STALL_S)
