"""The `runplane` command line.

Every command connects through `engine.open_tenant` (the embedded default, or `RUNPLANE_DSN`).
Errors reach the user as one line on stderr and a non-zero exit status, never a traceback:
engine errors exit 1, usage errors 2, an interrupt 130. Errors that come out of trio nurseries
as exception groups are unwrapped to their first leaf for that line.

Commands: `demo` (the main job, see `actors.demo`), `run PLAY.py` (a user's play), `status`,
`supervise`, `doctor`, `simulate`.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import inspect
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import trio

from runplane.engine import PlayScope, open_tenant
from runplane.engine.errors import EngineError, leaf_errors
from runplane.engine.schema import SCHEMA_VERSION, schema_status

DEFAULT_ORG = "local"

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
    parser.add_argument("--org", default=os.environ.get("RUNPLANE_ORG", DEFAULT_ORG), help="org id")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"), help="tenant schema")


# -- doctor -------------------------------------------------------------------------------------
@command("doctor", "connect and report server version, schema status and permit lanes")(_tenant_options)
def doctor(args: argparse.Namespace) -> int:
    async def main() -> None:
        async with open_tenant(args.org, args.dsn, schema=args.schema) as tenant:
            version = await tenant.server_version()
            async with tenant.connection("receipts") as conn:
                status = await schema_status(conn, tenant.schema)
            print(f"server      PostgreSQL {version} at {tenant.host}")
            state = "ok" if status == SCHEMA_VERSION else f"needs bootstrap (found {status})"
            print(f"schema      {tenant.schema} version {status} ({state})")
            print(f"org         {tenant.org_id}")
            for name, stats in tenant.permits().items():
                print(f"lane        {name:<12} limit {stats.limit}")

    run_trio(main)
    return 0


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
    _tenant_options(parser)
    parser.add_argument("--rows", type=_positive, default=10_000, help="synthetic companies (default 10,000)")
    parser.add_argument("--concurrency", type=_positive, default=128, help="map workers (default 128)")
    parser.add_argument("--latency-ms", type=_non_negative, default=2.0, help="mean fake tool latency (default 2 ms)")
    parser.add_argument("--fail-rate", type=_fraction, default=0.02, help="fake tool failure rate (default 0.02)")
    parser.add_argument("--crash-after", type=_positive, default=None, metavar="N",
                        help="cancel the run after N executed rows and print its id")
    parser.add_argument("--resume", default=None, metavar="RUN_ID", help="wake a crashed run and finish it")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
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

    return run_trio(run_demo, args, Console())


# -- run ----------------------------------------------------------------------------------------
def _run_options(parser: argparse.ArgumentParser) -> None:
    _tenant_options(parser)
    parser.add_argument("play_file", metavar="PLAY.py", help="a file defining `async def play(run, rows)`")
    parser.add_argument("--input", default=None, metavar="FILE", help="rows as .csv or .jsonl")
    parser.add_argument("--play", dest="play_name", default=None, help="play name (default: PLAY in the file, else its stem)")
    parser.add_argument("--run-id", default=None, help="wake this run instead of starting a new one")


class UsageError(Exception):
    """Bad command-line input that argparse could not see (a file's content, a missing function)."""


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


def read_rows(path: str | None) -> list[dict]:
    if path is None:
        return []
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    if file.suffix == ".csv":
        with file.open(newline="", encoding="utf-8") as handle:
            return [dict(row) for row in csv.DictReader(handle)]
    if file.suffix in (".jsonl", ".ndjson"):
        rows = []
        with file.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UsageError(f"{path}:{number}: invalid JSON: {exc.msg}") from exc
                if not isinstance(row, dict):
                    raise UsageError(f"{path}:{number}: each line must be a JSON object")
                rows.append(row)
        return rows
    raise UsageError(f"{path}: input must be .csv or .jsonl")


@command("run", "run a play: `async def play(run, rows)` in PLAY.py")(_run_options)
def run_play(args: argparse.Namespace) -> int:
    from runplane.actors import open_run

    name, play = load_play(args.play_file)
    rows = read_rows(args.input)

    async def main() -> Any:
        async with open_tenant(args.org, args.dsn, schema=args.schema) as tenant:
            async with open_run(tenant, args.play_name or name, args.run_id) as run:
                print(f"run {run.run_id} of play {run.play} (epoch {run.epoch}), {len(rows)} input rows")
                return await play(run, rows)

    result = run_trio(main)
    if result is not None:
        print(describe_result(result))
    return 0


def describe_result(result: Any) -> str:
    from runplane.actors import MapResult

    if isinstance(result, MapResult):
        return (f"admitted {result.admitted}, cached {result.cached}, completed {result.completed}, "
                f"failed {result.failed}, blocked {result.blocked}, fenced {result.fenced}")
    return repr(result)


# -- status -------------------------------------------------------------------------------------
def _status_options(parser: argparse.ArgumentParser) -> None:
    _tenant_options(parser)
    parser.add_argument("play", help="play name")
    parser.add_argument("table", nargs="?", default=None, help="table namespace (default: all)")


@command("status", "show a play's sheets (counters per table and column) and recent runs")(_status_options)
def status(args: argparse.Namespace) -> int:
    from runplane.engine import outbox, runs as engine_runs, sheets
    from runplane.engine.scopes import normalize_namespace

    async def main() -> int:
        async with open_tenant(args.org, args.dsn, schema=args.schema) as tenant:
            scope = PlayScope(tenant.org_id, args.play)
            summaries = await sheets.summaries(tenant, scope)
            runs = await engine_runs.list_runs(tenant, scope, limit=10)
            entries = await outbox.get_many(tenant, scope, [run.run_id for run in runs])
            if not summaries and not runs:
                print(f"play {scope.play!r} has no sheets and no runs", file=sys.stderr)
                return 1
            if args.table is not None:
                wanted = normalize_namespace(args.table)
                if wanted not in summaries:
                    print(f"play {scope.play!r} has no table {wanted!r}", file=sys.stderr)
                    return 1
                summaries = {wanted: summaries[wanted]}
            for table, summary in summaries.items():
                print(f"table {table}: total {summary.total}, queued {summary.queued}, "
                      f"running {summary.running}, completed {summary.completed}, "
                      f"failed {summary.failed}")
                for field, column in sorted(summary.columns.items()):
                    print(f"  column {field}: completed {column.completed}, failed {column.failed}")
            for run in runs:
                entry = entries.get(run.run_id)
                print(f"run {run.run_id} epoch {run.epoch} outbox {entry.state if entry else '-'}")
        return 0

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
                print(f"supervising org {tenant.org_id} in schema {tenant.schema} "
                      f"as {sup.owner} (Ctrl-C to stop)", flush=True)
                await trio.sleep_forever()

    run_trio(main)
    return 0


# -- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runplane", description="durable, idempotent map runs on PostgreSQL")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, configure, help) in COMMANDS.items():
        configure(sub.add_parser(name, help=help, description=help))
    return parser


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
                interrupted = True
                scope.cancel()
                return

        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope)
                result = await async_fn(*args)
                nursery.cancel_scope.cancel()
        if interrupted:
            raise KeyboardInterrupt
        return result

    return trio.run(guarded)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = COMMANDS[args.command][0]
    try:
        return handler(args)
    except BaseException as raised:  # reported as one line below, or re-raised
        exc = leaf_errors(raised)[0]  # the first, unwrapped from nested groups
        if isinstance(exc, KeyboardInterrupt):
            print("runplane: interrupted", file=sys.stderr)
            return 130
        if isinstance(exc, UsageError):
            print(f"runplane: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, EngineError):
            print(f"runplane: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, OSError):
            print(f"runplane: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, Exception) and args.command == "run":
            print(f"runplane: the play failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        raise

