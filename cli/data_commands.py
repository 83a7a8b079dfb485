"""Read-only commands over a play's state: `status`, `failures`, `export`, `runs`."""

from __future__ import annotations

import argparse
import sys

from . import export as export_command
from .commands import (
    _json_option,
    _port_options,
    _positive,
    _read_only,
    _tenant_options,
    command,
    run_trio,
)
from .connect import replica_line
from .operators import show_failures


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
            await say_replica(tenant)
            return await show_status(tenant, args)

    try:
        return run_trio(main)
    except KeyboardInterrupt:
        if args.watch:  # Ctrl-C is how a watch ends
            return 0
        raise


async def say_replica(port) -> None:
    """The replica a read command reads, and its lag, on stderr (stdout may be JSON)."""
    note = await replica_line(port)
    if note is not None:
        print(note, file=sys.stderr)


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
            await say_replica(tenant)
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
    from .worker import show_workers

    async def main() -> int:
        async with _read_only(args) as tenant:
            await say_replica(tenant)
            status = await show_runs(tenant, args)
            if not getattr(args, "json", False):  # one JSON document with --json
                await show_workers(tenant, args.play)
            return status

    return run_trio(main)


# -- sql (see cli.psql) -------------------------------------------------------------------------
def _sql_options(parser: argparse.ArgumentParser) -> None:
    _tenant_options(parser)
    parser.add_argument("play", help="play name")
    parser.add_argument("table", help="table namespace")


@command("sql", "print a SELECT over a table's sheet with readable column names (for psql)")(_sql_options)
def sheet_sql(args: argparse.Namespace) -> int:
    from .psql import print_sheet_select

    async def main() -> int:
        async with _read_only(args) as tenant:
            return await print_sheet_select(tenant, args.play, args.table)

    return run_trio(main)
