"""Commands that run plays: `demo` (the main job, see `cli.demo`), `run PLAY.py`, and
`cancel PLAY RUN_ID` (every process of the run stops its rows; `run` then exits 130).

`run --input FILE` checks the file before it connects (`cli.inputs`) and, before the run
starts, names in one line the file's columns that no contract of the play file stores as an
input (the `SheetContract` values the play module defines at its top level; a play that builds
its contracts elsewhere gets no such line): `run.map` drops them."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

import attrs

from runplane.actors.shared.config import RUN_PLAY_MODULE
from runplane.engine.canonical import JsonObject
from runplane.engine.ports import Port

from .commands import (
    ROW_ERRORS_EXIT,
    _count,
    _fraction,
    _json_option,
    _non_negative,
    _port_options,
    _positive,
    _rate,
    _row_error_options,
    command,
    run_trio,
)
from .connect import open_port
from .inputs import read_input
from .operators import RunCancelled, RunNotice, UsageError, print_failure_summary
from .terminal import emit_json, plural, say

if TYPE_CHECKING:
    from runplane.actors import Run
    from runplane.engine.sheets import SheetContract


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
    parser.add_argument("--infer-types", action="store_true",
                        help="read CSV cells as JSON numbers, true/false, or null (empty) where "
                             "they are one; text otherwise, `007` included (default: all text)")
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


@attrs.frozen
class PlayFile:
    """A loaded play file: its play name, `play` function and top-level contracts."""

    name: str
    play: Callable[[Run, Sequence[JsonObject]], Awaitable[object]]
    contracts: tuple[SheetContract, ...] = ()


def load_play(path: str) -> PlayFile:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"{RUN_PLAY_MODULE}{file.stem}", file)
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
    from runplane.engine.sheets import SheetContract

    contracts = tuple(value for value in vars(module).values()
                      if isinstance(value, SheetContract))
    return PlayFile(str(getattr(module, "PLAY", file.stem)), play, contracts)


def unstored_columns(columns: Sequence[str], contracts: Sequence[SheetContract]) -> list[str]:
    """The input columns no contract stores as an input (none when no contract is known)."""
    if not contracts:
        return []
    stored = {name for contract in contracts for name in contract.inputs}
    return [name for name in columns if name not in stored]


async def choose_run_id(tenant: Port, play: str, args: argparse.Namespace) -> str | None:
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

    loaded = load_play(args.play_file)
    name, play = loaded.name, loaded.play
    rows: Sequence[JsonObject] = []  # a checked input file is a `FileRows`, sized
    if args.input is None and not args.no_input:
        raise UsageError("no input: pass --input FILE.csv|.jsonl (or --no-input for a play "
                         "that reads its own data)")
    if args.input is not None:
        source = read_input(args.input, infer_types=args.infer_types)
        if source.note is not None:
            say(source.note)
            return 0
        rows = source.rows
        dropped = unstored_columns(source.columns, loaded.contracts)
        if dropped:
            say(f"{args.input}: {plural(len(dropped), 'column')} not stored (no contract of "
                f"{args.play_file} names them as inputs): {', '.join(dropped)}")
    play_name = args.play_name or name
    notice = args.notice = RunNotice(args.argv, "--run-id")

    async def main() -> int:
        if args.workers is not None:
            from runplane.actors.shared.coordinator import default_workers

            default_workers.set(args.workers)
        async with open_port(args) as tenant:  # a tenant, or a gateway with --gateway
            run_id = await choose_run_id(tenant, play_name, args)
            async with open_run(tenant, play_name, run_id, force=args.force) as run:
                await notice.started(run)
                say(f"{len(rows)} input rows")
                progress = RunProgress(interval_s=args.progress_every, input_rows=len(rows))
                result = await with_progress(run, progress, lambda: play(run, rows))
            if result is not None:
                say(describe_result(result))
            if run.cancelled:
                raise RunCancelled(run.run_id)
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


# -- cancel -------------------------------------------------------------------------------------
def _cancel_options(parser: argparse.ArgumentParser) -> None:
    _port_options(parser)
    parser.add_argument("play", help="play name")
    parser.add_argument("run_id", metavar="RUN_ID", help="the run to stop")


@command("cancel", "cancel a run: every process of it stops its rows within seconds")(_cancel_options)
def cancel_run(args: argparse.Namespace) -> int:
    from runplane.engine.runs.cancel import CANCEL_POLL_S, CancelAnswer, request_cancel
    from runplane.engine.values.scopes import RunScope

    async def main() -> int:
        async with open_port(args) as port:
            scope = RunScope(port.org_id, args.play, args.run_id)
            answer = await request_cancel(port, scope)
        if answer is CancelAnswer.UNKNOWN:
            raise UsageError(f"no run {args.run_id!r} of play {args.play!r}")
        say({CancelAnswer.REQUESTED: f"run {args.run_id}: cancelled; its processes stop their "
                                     f"rows within {CANCEL_POLL_S:g}s and the run ends",
             CancelAnswer.ALREADY: f"run {args.run_id}: already cancelled",
             CancelAnswer.FINISHED: f"run {args.run_id}: already finished, nothing to "
                                    "cancel"}[answer])
        return 0

    return run_trio(main)


# -- retry --------------------------------------------------------------------------------------
def _retry_options(parser: argparse.ArgumentParser) -> None:
    _port_options(parser)
    parser.add_argument("play", help="play name")
    parser.add_argument("table", metavar="TABLE", help="the table whose rows run again")
    parser.add_argument("--status", default="failed",
                        help="the rows to run: failed (default), enriched, pending, running, or "
                             "all (every row); anything but failed needs --force")
    parser.add_argument("--run", dest="only_run", default=None, metavar="RUN_ID",
                        help="only the rows this run wrote")
    parser.add_argument("--force", action="store_true",
                        help="compute the chosen rows again even when they finished")
    parser.add_argument("--progress-every", type=_non_negative, default=10.0, metavar="SECONDS",
                        help="without a terminal on stderr: a progress line this often (default 10)")


@command("retry", "run a table's failed rows again (or recompute rows with --force) on the "
                  "play's workers")(_retry_options)
def retry_rows(args: argparse.Namespace) -> int:
    from runplane.actors import open_run
    from runplane.actors.retrying import RetrySelection, prepare_retry, retry_table

    from .progress import RunProgress, with_progress
    from .results import describe_result

    selection = RetrySelection(None if args.status == "all" else args.status, args.only_run,
                               args.force)

    async def main() -> int:
        async with open_port(args) as tenant:
            plan = await prepare_retry(tenant, args.play, args.table, selection)
            async with open_run(tenant, args.play) as run:
                say(f"run {run.run_id}: {'recomputing' if args.force else 'retrying'} "
                    f"{'every' if selection.status is None else selection.status} row(s) of "
                    f"{args.table}; `runplane worker PLAY.py` runs them")
                progress = RunProgress(interval_s=args.progress_every)
                result = await with_progress(run, progress, lambda: retry_table(run, plan))
            say(describe_result(result))
            if run.cancelled:
                raise RunCancelled(run.run_id)
            return 0

    return run_trio(main)
