"""The operators' view: run notices, failed rows, recent runs.

How it works
- `RunNotice` belongs to one `run` or `demo` invocation. When the run is registered it prints
  one plain, flushed line with the run id (before any progress bar takes the terminal, so a
  redirected log keeps it even after `kill -9`) and records in the `runs` table the command that
  resumes the run. The command is the invocation's own argument list with the options that
  chose or cut short the run (`--run-id`, `--new-run-id`, `--resume`, `--crash-after`) replaced
  by the option that wakes this run; a `--dsn` holding a password is left out (the resume
  command must not print it). On any end other than success, `main` prints that command.
- `print_failure_summary` is the top-5 table of a run's failed rows that `run` and `demo` end
  with; `failures` lists failed rows and the commonest errors of one table; `runs` lists a
  play's recent runs with their state (open, retiring, done), the rows each wrote last, and
  the resume command of open ones (and, when `RUNPLANE_CONSOLE_URL` names a web console, each
  run's page there).
- Read-only commands open the tenant with `bootstrap=False` and check the schema first
  (`require_schema`), so a mistyped `--schema` is one line and creates nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.parse
from typing import Any

import attrs

from runplane.actors.retry import retry_transient
from runplane.engine import PlayScope, outbox, runs, sheets
from runplane.engine.ports import RECEIPTS_LANE
from runplane.engine.schema import schema_status
from runplane.engine.scopes import normalize_namespace

from .terminal import plural, say, shell_command, table_lines

WAKE_OPTIONS = ("--run-id", "--new-run-id", "--resume", "--crash-after")
TOP_ERRORS = 5


class CommandError(Exception):
    """A command refused to go on (an unknown schema, play or table): exit 1."""


class UsageError(Exception):
    """Bad command-line input argparse could not see (a file's content, a missing function, a
    run id that does not exist or already does): exit 2."""


# -- run notices -----------------------------------------------------------------------------
def _dsn_without_password(value: str) -> bool:
    if "://" in value:
        try:
            return urllib.parse.urlsplit(value).password in (None, "")
        except ValueError:
            return False
    return "password=" not in value


def resume_words(argv: list[str], wake_option: str, run_id: str) -> list[str]:
    """`argv` with the run-choosing options replaced by `wake_option run_id`."""
    words: list[str] = []
    skip = False
    for index, word in enumerate(argv):
        if skip:
            skip = False
            continue
        name, has_value, value = word.partition("=")
        if name in WAKE_OPTIONS:
            skip = not has_value
            continue
        if name == "--dsn":
            shown = value if has_value else (argv[index + 1] if index + 1 < len(argv) else "")
            skip = not has_value
            if _dsn_without_password(shown):
                words += ["--dsn", shown]
            continue
        words.append(word)
    return [*words, wake_option, run_id]


@attrs.define(eq=False)
class RunNotice:
    """The start line and resume command of one invocation's run."""

    argv: list[str]
    wake_option: str
    run_id: str | None = None
    resume_command: str | None = None

    async def started(self, run: Any) -> None:
        """Print `run`'s start line (flushed), then record how to resume it."""
        self.run_id = run.run_id
        self.resume_command = shell_command(resume_words(self.argv, self.wake_option, run.run_id))
        say(f"run {run.run_id} of play {run.play} started (epoch {run.epoch}); "
            f"to resume it: {self.resume_command}")
        await retry_transient(
            lambda: runs.record_command(run.port, run.scope, self.resume_command))


# -- schema checks for read-only commands ----------------------------------------------------
async def require_schema(tenant: Any) -> None:
    async with tenant.connection(RECEIPTS_LANE) as conn:
        status = await schema_status(conn, tenant.schema)
    if status is None:
        raise CommandError(
            f"schema {tenant.schema!r} has no runplane tables (check --schema or "
            "RUNPLANE_SCHEMA); nothing was created"
        )


async def play_tables(tenant: Any, scope: PlayScope) -> list[str]:
    """The play's table namespaces, in name order."""
    return sorted(await sheets.summaries(tenant, scope))


async def require_table(tenant: Any, scope: PlayScope, table: str) -> str:
    wanted = normalize_namespace(table)
    if wanted not in await play_tables(tenant, scope):
        raise CommandError(f"play {scope.play!r} has no table {wanted!r}")
    return wanted


# -- failures ---------------------------------------------------------------------------------
def error_table(counts: sheets.ErrorCounts) -> list[str]:
    rows = [(top.count, "(no message)" if top.error is None else top.error)
            for top in counts.top]
    return ["  " + line for line in table_lines(("count", "error"), rows, right=(0,))]


async def print_failure_summary(tenant: Any, scope: PlayScope, run_id: str) -> int:
    """The top errors of the rows `run_id` left failed, per table; returns how many failed."""
    failed = 0
    for table in await play_tables(tenant, scope):
        counts = await sheets.error_counts(tenant, scope, table, run_id=run_id, limit=TOP_ERRORS)
        if not counts.failed:
            continue
        failed += counts.failed
        shown = min(TOP_ERRORS, counts.distinct)
        say(f"{plural(counts.failed, 'failed row')} in table {table}, "
            f"{plural(counts.distinct, 'distinct error')} (top {shown}):")
        for line in error_table(counts):
            say(line)
        say(f"  see them: {shell_command(['failures', scope.play, table, '--run', run_id])}")
    return failed


def _inputs_text(inputs: dict) -> str:
    return json.dumps(inputs, ensure_ascii=False, separators=(", ", ": "), sort_keys=True)


async def show_failures(tenant: Any, args: argparse.Namespace) -> int:
    await require_schema(tenant)
    scope = PlayScope(tenant.org_id, args.play)
    table = await require_table(tenant, scope, args.table)
    counts = await sheets.error_counts(tenant, scope, table, run_id=args.run, limit=TOP_ERRORS)
    of_run = f" of run {args.run}" if args.run else ""
    if not counts.failed:
        say(f"no failed rows{of_run} in table {table} of play {scope.play}")
        return 0
    # The failed rows in the sheet's order, paged through the dataset; a field with no column
    # counters is an input (outputs have them).
    outputs = set((await sheets.summaries(tenant, scope))[table].columns)
    failed = sheets.dataset(tenant, scope, table, status="failed", run_id=args.run)
    rows = await failed.materialize(limit=args.limit)
    say(f"{plural(counts.failed, 'failed row')}{of_run} in table {table} of play {scope.play}"
        + (f" (first {len(rows)})" if len(rows) < counts.failed else "") + ":")
    listing = [
        (row["_key"], row["_attempts"], row["_error"] or "(no message)", _inputs_text({
            field: value for field, value in row.items()
            if not field.startswith("_") and field not in outputs and value is not None}))
        for row in rows
    ]
    for line in table_lines(("key", "attempts", "error", "inputs"), listing, right=(1,)):
        say("  " + line)
    say(f"most common errors ({counts.distinct} distinct, top {min(TOP_ERRORS, counts.distinct)}):")
    for line in error_table(counts):
        say(line)
    return 0


# -- runs -------------------------------------------------------------------------------------
STATES = {"open": "open", "pending": "retiring", "done": "done"}


async def show_runs(tenant: Any, args: argparse.Namespace) -> int:
    await require_schema(tenant)
    scope = PlayScope(tenant.org_id, args.play)
    recent = await runs.list_runs(tenant, scope, limit=args.limit)
    if not recent:
        raise CommandError(f"play {scope.play!r} has no runs")
    ids = [info.run_id for info in recent]
    entries = await outbox.get_many(tenant, scope, ids)
    totals = {run_id: sheets.RunRows() for run_id in ids}
    for table in await play_tables(tenant, scope):
        for run_id, rows in (await sheets.run_rows(tenant, scope, table, ids)).items():
            total = totals[run_id]
            totals[run_id] = sheets.RunRows(
                total.pending + rows.pending, total.running + rows.running,
                total.enriched + rows.enriched, total.failed + rows.failed,
            )
    listing = []
    for info in recent:
        rows = totals[info.run_id]
        entry = entries.get(info.run_id)
        listing.append((
            info.run_id, info.epoch, info.created_at.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
            STATES.get(entry.state, entry.state) if entry is not None else "open",
            rows.enriched, rows.failed, rows.pending + rows.running,
        ))
    header = ("run id", "epoch", "started", "state", "completed", "failed", "unfinished")
    for line in table_lines(header, listing, right=(1, 4, 5, 6)):
        say(line)
    for info, row in zip(recent, listing):
        if row[3] != "open":
            continue
        command = info.command or (
            f"(started from Python: wake it with actors.open_run(tenant, "
            f"{scope.play!r}, {info.run_id!r}))"
        )
        say(f"resume {info.run_id}: {command}")
    console = os.environ.get("RUNPLANE_CONSOLE_URL", "").strip().rstrip("/")
    for info in recent if console else ():  # a page of the web console per run
        say(f"console {info.run_id}: {console}/ui/runs/{urllib.parse.quote(scope.play, safe='')}/"
            f"{urllib.parse.quote(info.run_id, safe='')}?org={urllib.parse.quote(scope.org_id)}")
    return 0
