"""`runplane status PLAY [TABLE] [--watch] [--json]`: a play's sheet counters and recent runs.

How it works
- The counters are the sheet's (`engine.sheets.summaries`): `queued` (admitted, waiting for a
  call), `leased` (the stored `running` status: admitted to a live attempt), `completed`,
  `failed`; and `running`, the rows inside a call of the function now, summed over every live
  process (`engine.runs.row_calls`: each reports at least every 5 s; a report older than 15 s no
  longer counts). A schema or gateway without `row_calls` shows running 0.
- `--watch` reads them again every second (`WATCH_S`) and adds each table's rate (rows settled
  a second, over about the last ten seconds) and time left, until Ctrl-C (which ends it with
  exit 0). On a terminal the screen is redrawn; otherwise each refresh is a block of lines
  headed by the time.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import attrs
import trio

from runplane.engine import PlayScope, runs, sheets
from runplane.engine.runs import outbox, row_calls
from runplane.engine.sheets import ColumnSummary
from runplane.engine.errors import EngineError
from runplane.engine.ports import Port
from runplane.engine.values.scopes import normalize_namespace

from .connect import require_tenant_schema
from .operators import CommandError
from .progress import Rates, duration
from .terminal import emit_json, say

WATCH_S = 1.0


@attrs.frozen
class TableCounts:
    total: int
    queued: int
    running: int  # inside a call now (`engine.runs.row_calls`)
    leased: int   # the stored `running` status: admitted to a live attempt
    completed: int
    failed: int
    columns: dict[str, ColumnSummary]


async def in_call(port: Port, scope: PlayScope) -> dict[str, int]:
    """Rows inside a call now per table (empty when the schema or gateway has no
    `row_calls`)."""
    try:
        return row_calls.by_table(await row_calls.running(port, scope))
    except EngineError:
        return {}


async def read_counts(port: Port, scope: PlayScope, table: str | None) -> dict[str, TableCounts]:
    summaries = await sheets.summaries(port, scope)
    if table is not None:
        wanted = normalize_namespace(table)
        if wanted not in summaries:
            raise CommandError(f"play {scope.play!r} has no table {wanted!r}")
        summaries = {wanted: summaries[wanted]}
    calling = await in_call(port, scope) if summaries else {}
    return {name: TableCounts(s.total, s.queued, calling.get(name, 0), s.running, s.completed,
                              s.failed, dict(sorted(s.columns.items())))
            for name, s in summaries.items()}


def table_line(name: str, c: TableCounts) -> str:
    return (f"table {name}: total {c.total}, queued {c.queued}, running {c.running}, "
            f"leased {c.leased}, completed {c.completed}, failed {c.failed}")


async def show_status(port: Port, args: argparse.Namespace) -> int:
    await require_tenant_schema(port)
    scope = PlayScope(port.org_id, args.play)
    counts = await read_counts(port, scope, args.table)
    recent = await runs.list_runs(port, scope, limit=10)
    if not counts and not recent:
        raise CommandError(f"play {scope.play!r} has no sheets and no runs "
                           f"in org {scope.org_id!r} (see --org / RUNPLANE_ORG)")
    if getattr(args, "watch", False):
        return await watch_status(port, scope, args.table)
    entries = await outbox.get_many(port, scope, [info.run_id for info in recent])
    if args.json:
        emit_json(status_document(scope, counts, recent, entries), args.json_stream)
        return 0
    for name, c in counts.items():
        say(table_line(name, c))
        for field, column in c.columns.items():
            say(f"  column {field}: completed {column.completed}, failed {column.failed}")
    for info in recent:
        entry = entries.get(info.run_id)
        say(f"run {info.run_id} epoch {info.epoch} outbox {entry.state if entry else '-'}")
    from .worker import show_workers  # the workers of the play's shared maps

    await show_workers(port, scope.play)
    return 0


def status_document(scope: PlayScope, counts: dict[str, TableCounts], recent: list,
                    entries: dict) -> dict:
    """`status --json`: the counters of each table and column, and the recent runs."""
    tables = {
        name: {"total": c.total, "queued": c.queued, "running": c.running, "leased": c.leased,
               "completed": c.completed, "failed": c.failed,
               "columns": {field: {"completed": col.completed, "failed": col.failed}
                           for field, col in c.columns.items()}}
        for name, c in counts.items()
    }
    listed = [{"run_id": info.run_id, "epoch": info.epoch,
               "outbox": entries[info.run_id].state if info.run_id in entries else None}
              for info in recent]
    return {"org": scope.org_id, "play": scope.play, "tables": tables, "runs": listed}


async def watch_status(port: Port, scope: PlayScope, table: str | None) -> int:
    """Refresh the counters every `WATCH_S` with rate and time left, until cancelled."""
    terminal = sys.stdout.isatty()
    rates: dict[str, Rates] = {}
    while True:
        counts = await read_counts(port, scope, table)
        lines = [f"{scope.play} at {datetime.datetime.now():%H:%M:%S} (Ctrl-C to stop)"]
        for name, c in counts.items():
            rate = rates.setdefault(name, Rates()).add(c.completed + c.failed)
            left = c.queued + c.leased
            lines.append(f"{table_line(name, c)}; {rate:,.1f} rows/s, "
                         f"ETA {duration(Rates.eta(left, rate))}")
        if terminal:
            sys.stdout.write("\x1b[H\x1b[2J")  # home and clear: redraw in place
        for line in lines:
            say(line)
        await trio.sleep(WATCH_S)
