"""The `runplane` command line.

Every command connects through `engine.open_tenant` (the embedded default, or `RUNPLANE_DSN`);
`run`, `demo` and `status` can go through a gateway instead (`--gateway URL` or
`RUNPLANE_GATEWAY_URL`, with the token in `RUNPLANE_TOKEN`), needing no database access at all.
Errors reach the user as one line on stderr and a non-zero exit status, never a traceback:
engine errors and refusals exit 1, usage errors (bad arguments, unreadable input files) 2, rows
that failed under `--fail-on-row-errors` 3, an interrupt 130. Errors that come out of trio
nurseries as exception groups are unwrapped to their first leaf for that line. A run that ends
any other way than success (interrupt, SIGTERM, a store failure, a failing play, a simulated
crash) exits non-zero and prints the command that resumes it on stderr (see
`operators.RunNotice`). A second or third Ctrl-C while the command winds down only says it is
stopping; `--json` (status, runs, failures, run) prints one JSON document on stdout and the
human lines on stderr (see `terminal`). Printed text goes through
`terminal.clean`: stored or user-supplied text never reaches the terminal with control
characters in it.

Commands: `demo` (the main job, see `cli.demo`), `run PLAY.py` (a user's play), `status`,
`failures`, `runs`, `supervise`, `doctor`, `simulate`. `status`, `failures`, `runs` and
`doctor` are read-only: they open the tenant without bootstrap and create nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import trio

from runplane.engine import open_tenant
from runplane.engine.errors import EngineError, leaf_errors, public_name
from runplane.engine.ports import RECEIPTS_LANE
from runplane.engine.schema import SCHEMA_VERSION, schema_status
from runplane.engine.sessions import password_probe, sweep_expired as sweep_expired_sessions

from . import export as export_command
from .connect import open_port
from .inputs import InputFileError, read_input
from .operators import (
    CommandError,
    RunNotice,
    UsageError,
    print_failure_summary,
    show_failures,
)
from .terminal import emit_json, say, warn

DEFAULT_ORG = "local"
ROW_ERRORS_EXIT = 3

Command = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[Command, Callable[[argparse.ArgumentParser], None], str]] = {}


def command(name: str, help: str):
    """Register `fn(args) -> exit status` as subcommand `name`; `configure` adds its options."""

    def register(configure: Callable[[argparse.ArgumentParser], None]):
        def wrap(fn: Command) -> Command:
            COMMANDS[name] = (fn, configure, help)
            return fn

        return wrap

    return register


def _tenant_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_DSN, else embedded)")
    parser.add_argument("--org", default=os.environ.get("RUNPLANE_ORG", DEFAULT_ORG),
                        help=f"org id (default: RUNPLANE_ORG, else {DEFAULT_ORG!r})")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"),
                        help="tenant schema (default: RUNPLANE_SCHEMA, else 'runplane')")


def _port_options(parser: argparse.ArgumentParser) -> None:
    """A tenant's options, or a gateway to go through instead."""
    _tenant_options(parser)
    parser.add_argument("--gateway", default=os.environ.get("RUNPLANE_GATEWAY_URL") or None,
                        metavar="URL", help="work through a gateway (default: RUNPLANE_GATEWAY_URL); "
                        "the token comes from RUNPLANE_TOKEN, the org from the token")
    parser.add_argument("--db-sessions", action="store_true",
                        help="with --gateway: get short-lived database sessions from the gateway and "
                        "run sheet, receipt and array-input work straight against PostgreSQL")


def _read_only(args: argparse.Namespace):
    """The tenant of a read-only command: no bootstrap, nothing created (or, with `--gateway`,
    the gateway)."""
    return open_port(args, read_only=True)


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout (other lines go to stderr)")


def _row_error_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fail-on-row-errors", action="store_true",
                        help=f"exit {ROW_ERRORS_EXIT} when any row of the run failed")


# -- doctor -------------------------------------------------------------------------------------
@command("doctor", "connect and report the server, how to reach it with psql, schema status and permit lanes")(_tenant_options)
def doctor(args: argparse.Namespace) -> int:
    from .doctor import connection_lines, outage_line

    async def main() -> None:
        async with _read_only(args) as tenant:
            version = await tenant.server_version()
            async with tenant.connection(RECEIPTS_LANE) as conn:
                status = await schema_status(conn, tenant.schema)
                where = await connection_lines(conn, args.dsn or os.environ.get("RUNPLANE_DSN"))
            say(f"server      PostgreSQL {version}")
            for line in where:
                say(line)
            if status is None:
                state = "absent; nothing created (the first `runplane run` or `demo` creates it)"
            elif status == SCHEMA_VERSION:
                state = f"version {status} (ok)"
            else:
                state = f"version {status} (the next `runplane run` or `demo` upgrades it)"
            say(f"schema      {tenant.schema} {state}")
            say(f"org         {tenant.org_id}")
            say(outage_line(tenant))
            for name, stats in tenant.permits().items():
                say(f"lane        {name:<12} limit {stats.limit}")
            say(f"sessions    {await password_probe(tenant)}")

    run_trio(main)
    return 0


# -- psql ---------------------------------------------------------------------------------------
def _psql_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_DSN, else embedded)")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"),
                        help="tenant schema, first on psql's search_path (default: RUNPLANE_SCHEMA, else 'runplane')")
    parser.add_argument("psql_args", nargs=argparse.REMAINDER, metavar="-- PSQL_ARGS",
                        help="passed to psql, e.g. -- -c 'SELECT * FROM runs'")


@command("psql", "a psql session on the database, keeping the embedded server up while it lasts")(_psql_options)
def psql(args: argparse.Namespace) -> int:
    from .psql import run_psql

    return run_psql(args)


# -- simulate -----------------------------------------------------------------------------------
def _simulate_options(parser: argparse.ArgumentParser) -> None:
    from runplane import simulations

    parser.add_argument("name", nargs="?", default="all", choices=[*simulations.SCENARIOS, "all"])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_TEST_DSN or a throwaway embedded server)")


@command("simulate", "run the property-tested race simulations")(_simulate_options)
def simulate(args: argparse.Namespace) -> int:
    from runplane.simulations.__main__ import main as run_simulations

    argv = [args.name, "--examples", str(args.examples)]
    if args.seed is not None:
        argv += ["--seed", str(args.seed)]
    if args.dsn:
        argv += ["--dsn", args.dsn]
    return run_simulations(argv)


# -- demo ---------------------------------------------------------------------------------------
def _demo_options(parser: argparse.ArgumentParser) -> None:
    _port_options(parser)
    _row_error_options(parser)
    parser.add_argument("--rows", type=_positive, default=10_000, help="synthetic companies (default 10,000)")
    parser.add_argument("--concurrency", type=_positive, default=128, help="map workers (default 128)")
    parser.add_argument("--latency-ms", type=_non_negative, default=2.0, help="mean fake tool latency (default 2 ms)")
    parser.add_argument("--fail-rate", type=_fraction, default=0.02, help="fake tool failure rate (default 0.02)")
    parser.add_argument("--crash-after", type=_positive, default=None, metavar="N",
                        help="cancel the run after N executed rows and print its id")
    parser.add_argument("--resume", default=None, metavar="RUN_ID", help="wake a crashed run and finish it")
    parser.add_argument("--retries", type=_count, default=0, metavar="N",
                        help="retry a failed tool call up to N times, with backoff (default 0)")
    parser.add_argument("--force", action="store_true", help="recompute rows earlier runs enriched")
    parser.add_argument("--rate", type=_rate, default=None, metavar="PER_SECOND",
                        help="start at most this many tool calls a second (default: no limit)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 100, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of calls a second > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


@command("demo", "the main job: map a fake enrichment tool over synthetic companies")(_demo_options)
def demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .demo import run_demo

    args.notice = RunNotice(args.argv, "--resume")
    failed = run_trio(run_demo, args, Console())
    return ROW_ERRORS_EXIT if failed and args.fail_on_row_errors else 0


# -- run ----------------------------------------------------------------------------------------
def _run_options(parser: argparse.ArgumentParser) -> None:
    _port_options(parser)
    _row_error_options(parser)
    _json_option(parser)
    parser.add_argument("play_file", metavar="PLAY.py", help="a file defining `async def play(run, rows)`")
    parser.add_argument("--input", default=None, metavar="FILE", help="rows as .csv or .jsonl")
    parser.add_argument("--force", action="store_true", help="every run.map recomputes rows earlier runs enriched")
    parser.add_argument("--no-input", action="store_true",
                        help="run a play that reads its own data (rows is an empty list)")
    parser.add_argument("--progress-every", type=_non_negative, default=10.0, metavar="SECONDS",
                        help="without a terminal on stderr: a progress line this often (default 10)")
    parser.add_argument("--play", dest="play_name", default=None, help="play name (default: PLAY in the file, else its stem)")
    parser.add_argument("--workers", type=_positive, default=None, metavar="N",
                        help="run the play's list-source maps on N local worker processes")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--run-id", default=None, help="wake this existing run (an unknown id is refused)")
    chosen.add_argument("--new-run-id", default=None, metavar="RUN_ID",
                        help="start a new run with this id (default: a fresh time-ordered id)")


def load_play(path: str) -> tuple[str, Callable[..., Any]]:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"runplane_play_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Like `python PLAY.py`: the play's own folder comes first, so its sibling modules (even one
    # named `engine`) are what it imports; runplane itself lives only under `runplane.`.
    sys.path.insert(0, str(file.resolve().parent))
    spec.loader.exec_module(module)
    play = getattr(module, "play", None)
    if not inspect.iscoroutinefunction(play):
        raise UsageError(f"{path}: defines no `async def play(run, rows)`")
    return str(getattr(module, "PLAY", file.stem)), play


async def choose_run_id(tenant: Any, play: str, args: argparse.Namespace) -> str | None:
    """The run to open: `--run-id` must exist, `--new-run-id` must not; None makes a fresh id."""
    from runplane.engine import RunScope, runs

    wanted = args.run_id or args.new_run_id
    if wanted is None:
        return None
    known = await runs.get(tenant, RunScope(tenant.org_id, play, wanted))
    if args.run_id is not None and known is None:
        raise UsageError(f"no run {wanted!r} of play {play!r} to wake "
                         f"(`--new-run-id {wanted}` starts a new run with that id)")
    if args.new_run_id is not None and known is not None:
        raise UsageError(f"run {wanted!r} of play {play!r} already exists "
                         f"(`--run-id {wanted}` wakes it)")
    return wanted


@command("run", "run a play: `async def play(run, rows)` in PLAY.py")(_run_options)
def run_play(args: argparse.Namespace) -> int:
    from runplane.actors import open_run

    from .progress import RunProgress, with_progress
    from .results import describe_result, run_document, stopped_early

    name, play = load_play(args.play_file)
    rows: list[dict] = []
    if args.input is None and not args.no_input:
        raise UsageError("no input: pass --input FILE.csv|.jsonl (or --no-input for a play "
                         "that reads its own data)")
    if args.input is not None:
        source = read_input(args.input)
        if source.note is not None:
            say(source.note)
            return 0
        rows = source.rows
    play_name = args.play_name or name
    notice = args.notice = RunNotice(args.argv, "--run-id")

    async def main() -> int:
        if args.workers is not None:
            from runplane.actors.shared_map import default_workers

            default_workers.set(args.workers)
        async with open_port(args) as tenant:  # a tenant, or a gateway with --gateway
            run_id = await choose_run_id(tenant, play_name, args)
            async with open_run(tenant, play_name, run_id, force=args.force) as run:
                await notice.started(run)
                say(f"{len(rows)} input rows")
                progress = RunProgress(interval_s=args.progress_every,
                                       input_rows=len(rows) if isinstance(rows, list) else None)
                result = await with_progress(run, progress, lambda: play(run, rows))
            if result is not None:
                say(describe_result(result))
            if run.stopped_early_maps:  # the cause once, not a table of the same error
                if args.json:
                    emit_json({**run_document(run, notice, result, None),
                               "status": "stopped_early"}, args.json_stream)
                raise stopped_early(run)
            failed = await print_failure_summary(tenant, run.scope.play_scope, run.run_id)
            if args.json:
                emit_json(run_document(run, notice, result, failed), args.json_stream)
            return failed

    failed = run_trio(main)
    return ROW_ERRORS_EXIT if failed and args.fail_on_row_errors else 0


# -- status -------------------------------------------------------------------------------------
def _status_options(parser: argparse.ArgumentParser) -> None:
    _port_options(parser)
    _json_option(parser)
    parser.add_argument("play", help="play name")
    parser.add_argument("table", nargs="?", default=None, help="table namespace (default: all)")
    parser.add_argument("--watch", action="store_true",
                        help="refresh every second with rate and time left, until Ctrl-C")


@command("status", "show a play's sheets (counters per table and column) and recent runs")(_status_options)
def status(args: argparse.Namespace) -> int:
    from .status import show_status

    async def main() -> int:
        async with _read_only(args) as tenant:
            return await show_status(tenant, args)

    try:
        return run_trio(main)
    except KeyboardInterrupt:
        if args.watch:  # Ctrl-C is how a watch ends
            return 0
        raise


# -- failures -----------------------------------------------------------------------------------
def _failures_options(parser: argparse.ArgumentParser) -> None:
    _tenant_options(parser)
    parser.add_argument("play", help="play name")
    parser.add_argument("table", help="table namespace")
    parser.add_argument("--run", default=None, metavar="RUN_ID", help="only the rows this run left failed")
    parser.add_argument("--limit", type=_positive, default=20, help="failed rows to list (default 20)")
    _json_option(parser)


@command("failures", "list a table's failed rows and its most common errors")(_failures_options)
def failures(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with _read_only(args) as tenant:
            return await show_failures(tenant, args)

    return run_trio(main)


# -- export (see cli.export) --------------------------------------------------------------------
command("export", export_command.HELP)(
    lambda parser: (_port_options(parser), export_command.options(parser)))(
    lambda args: run_trio(export_command.export, args))


# -- runs ---------------------------------------------------------------------------------------
def _runs_options(parser: argparse.ArgumentParser) -> None:
    _tenant_options(parser)
    parser.add_argument("play", help="play name")
    parser.add_argument("run_id", nargs="?", default=None, metavar="RUN_ID",
                        help="show this run in detail: each map's counts, state and duration")
    parser.add_argument("--limit", type=_positive, default=10, help="runs to list (default 10)")
    _json_option(parser)


@command("runs", "list a play's recent runs (what each did, how to resume open ones), or show one")(_runs_options)
def list_runs(args: argparse.Namespace) -> int:
    from .history import show_runs

    async def main() -> int:
        async with _read_only(args) as tenant:
            status = await show_runs(tenant, args)
            if not getattr(args, "json", False):  # one JSON document with --json
                await _worker.show_workers(tenant, args.play)
            return status

    return run_trio(main)


# -- supervise ----------------------------------------------------------------------------------
def _supervise_options(parser: argparse.ArgumentParser) -> None:
    _tenant_options(parser)
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between idle polls")
    parser.add_argument("--abandon-after", type=float, default=None, metavar="SECONDS",
                        help="also retire open runs untouched this long (never woken again)")


@command("supervise", "drain the terminal outbox (retire finished runs) until interrupted")(_supervise_options)
def supervise(args: argparse.Namespace) -> int:
    from runplane.actors import open_supervisor

    async def main() -> None:
        async with open_tenant(args.org, args.dsn, schema=args.schema) as tenant:
            async with open_supervisor(tenant, poll_interval=args.poll,
                                       abandon_after_s=args.abandon_after) as sup:
                say(f"supervising org {tenant.org_id} in schema {tenant.schema} "
                    f"as {sup.owner} (Ctrl-C to stop)")
                await sweep_expired_sessions(tenant)  # drops expired database sessions, forever

    run_trio(main)
    return 0


# -- the gateway: serve and token --------------------------------------------------------------
SECRET_ENV = "RUNPLANE_GATEWAY_SECRET"


def _serve_options(parser: argparse.ArgumentParser) -> None:
    from runplane.engine.gateway import DEFAULT_BODY_LIMIT

    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_DSN, else embedded)")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"), help="tenant schema")
    parser.add_argument("--bind", default="127.0.0.1:8787", metavar="HOST:PORT",
                        help="where to listen (default 127.0.0.1:8787; port 0 picks a free one)")
    parser.add_argument("--body-limit", type=_positive, default=DEFAULT_BODY_LIMIT, metavar="BYTES",
                        help=f"largest request body accepted (default {DEFAULT_BODY_LIMIT:,})")
    parser.add_argument("--no-array-actions", action="store_true",
                        help="answer array-input actions as unsupported (an older gateway)")
    parser.add_argument("--dev", action="store_true",
                        help=f"without {SECRET_ENV}: a throwaway secret and a printed token for org local")
    parser.add_argument("--log-interval", type=float, default=60.0, metavar="SECONDS",
                        help="seconds between statistics log lines (default 60)")
    parser.add_argument("--session-dsn", default=None, metavar="URL",
                        help="the postgresql:// address runners reach the database at, for the URLs "
                        "of database sessions (default: the gateway's own DSN)")


@command("serve", "serve the runtime actions over HTTP (the gateway) until interrupted")(_serve_options)
def serve(args: argparse.Namespace) -> int:
    from runplane.engine.gateway import mint_token, open_server

    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        if not args.dev:
            raise UsageError(f"{SECRET_ENV} is not set: the gateway needs a signing secret for its "
                             "tokens (or pass --dev for a throwaway one)")
        secret = secrets.token_urlsafe(32)
    from .serving import address_in_use, configure_logging

    configure_logging()  # the embedded server's lines go to a file in RUNPLANE_HOME

    async def main() -> None:
        async with open_server(secret=secret, dsn=args.dsn, schema=args.schema, bind=args.bind,
                               body_limit=args.body_limit, array_actions=not args.no_array_actions,
                               log_interval_s=args.log_interval,
                               session_dsn=args.session_dsn) as server:
            actions = "off" if args.no_array_actions else "on"
            print(f"gateway listening on {server.url} (schema {args.schema}, body limit "
                  f"{server.body_limit:,} bytes, array actions {actions}; Ctrl-C to stop)", flush=True)
            if args.dev:
                print(f"dev token for org {DEFAULT_ORG}: {mint_token(secret, DEFAULT_ORG)}", flush=True)
            await trio.sleep_forever()

    try:
        run_trio(main)
    except BaseException as raised:  # a taken address is one line naming it
        problem = address_in_use(raised, args.bind)
        if problem is None:
            raise
        raise CommandError(problem) from None
    return 0


def _token_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--org", default=os.environ.get("RUNPLANE_ORG", DEFAULT_ORG), help="the one org the token acts for")
    parser.add_argument("--play", action="append", default=None, metavar="PLAY",
                        help="a play the token may touch (repeatable; default: every play)")
    parser.add_argument("--action", action="append", default=None, metavar="ACTION",
                        help="an action it may call, e.g. receipts.claim or sheets.* (repeatable; default: all)")
    parser.add_argument("--run", action="append", default=None, metavar="RUN_ID",
                        help="a run it may name (repeatable; default: every run)")
    parser.add_argument("--ttl", type=float, default=3600.0, metavar="SECONDS", help="lifetime (default 3600)")


@command("token", f"print a gateway token signed with {SECRET_ENV}")(_token_options)
def token(args: argparse.Namespace) -> int:
    from runplane.engine.gateway import mint_token

    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise UsageError(f"{SECRET_ENV} is not set: a token is signed with the gateway's secret")
    print(mint_token(secret, args.org, plays=args.play or ("*",), actions=args.action or ("*",),
                     ttl_s=args.ttl, runs=args.run))
    return 0


from . import console as _console  # noqa: E402 - `runplane console`, the web console

command("console", "serve the web console on loopback, behind a one-time login link")(
    _console.configure)(_console.console)


# -- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runplane", description="durable, idempotent map runs on PostgreSQL")
    parser.add_argument("--version", action="version", version=f"runplane {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, configure, help) in COMMANDS.items():
        # No abbreviations: the resume command is rebuilt from the exact option names.
        configure(sub.add_parser(name, help=help, description=help, allow_abbrev=False))
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("runplane")
    except PackageNotFoundError:
        return "(not installed)"


def run_trio(async_fn: Callable[..., Any], *args: Any) -> Any:
    """`trio.run`, with SIGINT and SIGTERM turned into a cancellation of the whole command.

    Teardown (flushing computed outcomes, rollbacks, closing the pool) then runs at checkpoints,
    instead of a KeyboardInterrupt landing inside driver or event-loop code; afterwards the
    command raises KeyboardInterrupt so `main` reports "interrupted" and exits 130.
    """

    async def guarded() -> Any:
        interrupted = False
        result = None

        async def watch(scope: trio.CancelScope) -> None:
            nonlocal interrupted
            async for _ in signals:
                if interrupted:  # a second Ctrl-C: the first one is being honoured
                    warn("runplane: stopping (writing what was computed); please wait")
                    continue
                interrupted = True
                scope.cancel()

        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                work = trio.CancelScope()
                nursery.start_soon(watch, work)
                with work:
                    result = await async_fn(*args)
                nursery.cancel_scope.cancel()
        if interrupted:
            raise KeyboardInterrupt
        return result

    return trio.run(guarded)


def main(argv: list[str] | None = None) -> int:
    process = argv is None  # the process's own command (not a call from Python)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command and its arguments, for resume commands
    args.notice = None
    args.json_stream = sys.stdout  # with --json, the one document goes here ...
    human = contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else None
    handler = COMMANDS[args.command][0]
    try:
        if human is None:
            return handler(args)
        with human:  # ... and every other line to stderr
            return handler(args)
    except BaseException as raised:  # reported as one line below, or re-raised
        exc = leaf_errors(raised)[0]  # the first, unwrapped from nested groups
        status = _report(exc, args.command)
        if status is None:
            raise
        notice = args.notice
        if (notice is not None and notice.resume_command is not None
                and getattr(exc, "resumable", True)):
            warn(f"runplane: resume run {notice.run_id} with: {notice.resume_command}")
            if getattr(args, "json", False):
                emit_json({"run_id": notice.run_id, "status": "unfinished", "exit_status": status,
                           "error": str(exc), "resume_command": notice.resume_command},
                          args.json_stream)
        return status
    finally:
        if process:  # the exit handlers (stopping the embedded server) run without Ctrl-C
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _report(exc: BaseException, command_name: str) -> int | None:
    """Print `exc` as one line and return the exit status, or None to let it through."""
    if isinstance(exc, KeyboardInterrupt):
        warn("runplane: interrupted")
        return 130
    if isinstance(exc, (UsageError, InputFileError)):
        warn(f"runplane: {exc}")
        return 2
    if isinstance(exc, CommandError):
        warn(f"runplane: {exc}")
        return 1
    if isinstance(exc, EngineError):
        warn(f"runplane: {public_name(exc)}: {exc}")
        return 1
    if isinstance(exc, OSError):
        warn(f"runplane: {exc}")
        return 1
    if isinstance(exc, Exception) and command_name == "run":
        warn(f"runplane: the play failed: {type(exc).__name__}: {exc}")
        return 1
    return None


from . import worker as _worker  # noqa: E402,F401  (registers `runplane worker`)
