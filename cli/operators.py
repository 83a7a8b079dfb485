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
  with, their messages grouped by cause (`engine.sheets.causes`: numbers, quoted values, keys
  and the row's own input values masked, one example each); `failures` lists failed rows and the commonest errors of one table (`runs`, what each
  run did, is `cli.history`; with `RUNPLANE_CONSOLE_URL` set it also prints each
  run's page in the web console).
- Read-only commands open the tenant with `bootstrap=False` and check the schema first
  (`require_schema`), so a mistyped `--schema` is one line and creates nothing.
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
import attrs

from runplane.actors import Run
from runplane.actors.retry import retry_transient
from runplane.engine import PlayScope, runs, sheets
from runplane.engine.ports import RECEIPTS_LANE, Port
from runplane.engine.schema import schema_status
from runplane.engine.sheets import RowStatus
from runplane.engine.sheets.causes import ErrorCause
from runplane.engine.values.scopes import normalize_namespace

from .terminal import emit_json, plural, say, shell_command, table_lines

WAKE_OPTIONS = ("--run-id", "--new-run-id", "--resume", "--crash-after")
TOP_ERRORS = 5
CAUSES_READ = 2000  # causes `failures --json` lists at most


class CommandError(Exception):
    """A command refused to go on (an unknown schema, play or table): exit 1."""


class RunUnfinished(CommandError):
    """A run ended without finishing (a simulated crash, rows left to do): exit 1, with the
    command that resumes it on stderr."""


class StoppedEarly(CommandError):
    """A map of the run stopped early, its function broken for every row it tried: exit 1.
    The run itself finished (no resume command); the next run runs the rows left."""

    resumable = False


class RunCancelled(CommandError):
    """The run was cancelled (`runplane cancel`, the console): exit 130. The run finished (no
    resume command); what it wrote stays, and a new run reuses its finished rows."""

    resumable = False

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id} was cancelled: what it wrote stays, and a new run "
                         "reuses its finished rows")


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

    async def started(self, run: Run) -> None:
        """Print `run`'s start line (flushed), then record how to resume it."""
        self.run_id = run.run_id
        self.resume_command = shell_command(resume_words(self.argv, self.wake_option, run.run_id))
        say(f"run {run.run_id} of play {run.play} started (epoch {run.epoch}); "
            f"to resume it: {self.resume_command}")
        await retry_transient(
            lambda: runs.record_command(run.port, run.scope, self.resume_command))


# -- schema checks for read-only commands ----------------------------------------------------
async def require_schema(tenant: Port) -> None:
    async with tenant.connection(RECEIPTS_LANE) as conn:
        status = await schema_status(conn, tenant.schema)
    if status is None:
        raise CommandError(
            f"schema {tenant.schema!r} has no runplane tables (check --schema or "
            "RUNPLANE_SCHEMA); nothing was created"
        )


async def play_tables(tenant: Port, scope: PlayScope) -> list[str]:
    """The play's table namespaces, in name order."""
    return sorted(await sheets.summaries(tenant, scope))


async def require_table(tenant: Port, scope: PlayScope, table: str) -> str:
    wanted = normalize_namespace(table)
    if wanted not in await play_tables(tenant, scope):
        raise CommandError(f"play {scope.play!r} has no table {wanted!r}")
    return wanted


# -- failures ---------------------------------------------------------------------------------
def error_table(causes: list[ErrorCause]) -> list[str]:
    """The top causes, one example message each (and how many other messages it stands for)."""
    rows = [(cause.count, ("(no message)" if cause.example is None else cause.example)
             + (f"  (+{cause.variants - 1} like it)" if cause.variants > 1 else ""))
            for cause in causes[:TOP_ERRORS]]
    return ["  " + line for line in table_lines(("count", "error"), rows, right=(0,))]


async def error_causes(tenant: Port, scope: PlayScope, table: str,
                       run_id: str | None) -> tuple[int, int, list[ErrorCause]]:
    """How many rows failed, how many causes they have and the commonest causes (stored with
    each failed row: `engine.sheets.causes`)."""
    counts = await sheets.error_counts(tenant, scope, table, run_id=run_id, limit=CAUSES_READ)
    return counts.failed, counts.distinct_causes, list(counts.causes)


async def print_failure_summary(tenant: Port, scope: PlayScope, run_id: str) -> int:
    """The top error causes of the rows `run_id` left failed, per table; returns how many
    failed."""
    failed = 0
    for table in await play_tables(tenant, scope):
        count, distinct, causes = await error_causes(tenant, scope, table, run_id)
        if not count:
            continue
        failed += count
        say(f"{plural(count, 'failed row')} in table {table}, "
            f"{plural(distinct, 'cause')} (top {min(TOP_ERRORS, len(causes))}):")
        for line in error_table(causes):
            say(line)
        say(f"  see them: {shell_command(['failures', scope.play, table, '--run', run_id])}")
    return failed


def _inputs_text(inputs: dict) -> str:
    return json.dumps(inputs, ensure_ascii=False, separators=(", ", ": "), sort_keys=True)


async def show_failures(tenant: Port, args: argparse.Namespace) -> int:
    await require_schema(tenant)
    scope = PlayScope(tenant.org_id, args.play)
    table = await require_table(tenant, scope, args.table)
    failed, distinct, causes = await error_causes(tenant, scope, table, args.run)
    of_run = f" of run {args.run}" if args.run else ""
    if getattr(args, "json", False):
        rows = await sheets.failed_rows(tenant, scope, table, run_id=args.run, limit=args.limit)
        emit_json({
            "play": scope.play, "table": table, "run_id": args.run, "failed": failed,
            "rows": [{"key": row.key, "attempts": row.attempts, "error": row.error,
                      "cause": row.cause, "inputs": row.inputs} for row in rows],
            "causes": distinct,
            "errors": [{"count": cause.count, "error": cause.example, "pattern": cause.pattern,
                        "variants": cause.variants} for cause in causes],
        }, args.json_stream)
        return 0
    if not failed:
        say(f"no failed rows{of_run} in table {table} of play {scope.play}")
        return 0
    # The failed rows in the sheet's order, paged through the dataset; a field with no column
    # counters is an input (outputs have them).
    outputs = set((await sheets.summaries(tenant, scope))[table].columns)
    listed = sheets.dataset(tenant, scope, table, status=RowStatus.FAILED, run_id=args.run)
    rows = await listed.materialize(limit=args.limit)
    say(f"{plural(failed, 'failed row')}{of_run} in table {table} of play {scope.play}"
        + (f" (first {len(rows)})" if len(rows) < failed else "") + ":")
    listing = [
        (row["_key"], row["_attempts"], row["_error"] or "(no message)", _inputs_text({
            field: value for field, value in row.items()
            if not field.startswith("_") and field not in outputs and value is not None}))
        for row in rows
    ]
    for line in table_lines(("key", "attempts", "error", "inputs"), listing, right=(1,)):
        say("  " + line)
    say(f"most common errors ({plural(distinct, 'cause')}, top {min(TOP_ERRORS, len(causes))}):")
    for line in error_table(causes):
        say(line)
    return 0
