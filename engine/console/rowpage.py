"""The console's reads of single rows of a sheet: by key, as a row's page shows them.

How it works
- `rows_by_key` reads some rows by primary key (one statement, an index lookup each): every
  registered field (inputs as stored; outputs as every reader shows them, null unless their cell
  is completed: `sheets.reading.shown_cell`) and, with `cells`, each output's `_cells` entry
  (`sheets.reading.cells_json`: status, completed_at, run_id, attempts, last_value), plus the
  row's own columns: status, error and cause, attempts, the runs it failed in, the run that wrote
  it last, when it was created and last written. A sheet from before a system column reads it
  as null (the console never adds columns).
- `touching_runs` names the runs a row's page links to: the run that wrote the row last, each
  output cell's run, and the last run it failed in (`_failed_epoch`, by the runs' unique epoch),
  read from `runs` by primary key, newest first.
- Reads go through `queries.read` (read-only, time-bounded, the console lane); the caller has
  checked the viewer may see the org and play.
"""

from __future__ import annotations

import datetime

import attrs

from .. import canonical
from ..canonical import JsonObject
from ..pg import Connection
from ..ports import Port, table
from ..sheets.layout import SheetLayout, existing_columns
from ..sheets.reading import cells_json, registered_fields, shown_cell
from ..sql import quote_ident
from .queries import layout, read

MAX_KEYS = 100  # rows read at once by key
_OPTIONAL = ("_attempts", "_failed_runs", "_failed_epoch", "_cause")


@attrs.frozen
class RowView:
    """One row as the console shows it; `inputs`/`outputs` map field -> JSON text (None: null
    or not shown); `cells`: each output's `_cells` entry (empty unless asked)."""

    key: str
    status: str
    error: str | None
    cause: str | None
    attempts: int | None
    failed_runs: int | None
    failed_epoch: int | None
    run_id: str | None
    input_index: int | None
    created: datetime.datetime
    updated: datetime.datetime
    inputs: dict[str, str | None]
    outputs: dict[str, str | None]
    cells: dict[str, JsonObject] = attrs.field(factory=dict)


@attrs.frozen
class TouchingRun:
    """A run that touched a row: its id, epoch, start and what it did (`roles`)."""

    run_id: str
    epoch: int
    started: datetime.datetime
    roles: tuple[str, ...]


_ROWS = """
SELECT _key, _status, _error, _run_id, _input_index, _created_at, _updated_at{optional}{cols}{cells}
  FROM {t} WHERE _key = ANY($1::text[])
 ORDER BY _input_index ASC NULLS LAST, _created_at ASC, _key ASC
"""


async def rows_by_key(port: Port, org: str, play: str, namespace: str, keys: list[str], *,
                      cells: bool = False) -> list[RowView] | None:
    """The rows of `keys` (at most `MAX_KEYS`) in row order; None when the sheet has no table."""
    sheet = layout(port, org, play, namespace)

    async def op(conn: Connection) -> list[RowView] | None:
        return await read_by_key(conn, port, sheet, keys[:MAX_KEYS], cells=cells)

    return await read(port, op)


async def read_by_key(conn: Connection, port: Port, sheet: SheetLayout, keys: list[str], *,
                      cells: bool) -> list[RowView] | None:
    """`rows_by_key` on an open read (see the module docstring)."""
    info = await conn.fetchrow(registered_fields(port), *sheet.counter_args, sheet.qualified,
                               sheet.table)
    if not info["present"] or info["foreign_table"]:
        return None
    existing = await existing_columns(conn, sheet)
    pairs = [(f, c) for f, c in zip(info["fields"], info["columns"]) if c in existing]
    outputs = set(info["outputs"])
    names = "$2::text[]"
    cols = "".join(f", ({shown_cell(quote_ident(c), f'({names})[{i + 1}]')})::text AS c{i}"
                   for i, (_, c) in enumerate(pairs))
    report = ""
    if cells:
        attempts = "_attempts" if "_attempts" in existing else "0"
        report = ", " + cells_json([(quote_ident(c), f"({names})[{i + 1}]")
                                    for i, (f, c) in enumerate(pairs) if f in outputs],
                                   attempts) + " AS cells"
    optional = "".join(f", {name}" if name in existing else f", NULL AS {name}"
                       for name in _OPTIONAL)
    sql = _ROWS.format(optional=optional, cols=cols, cells=report, t=sheet.qualified)
    records = await conn.fetch(sql, keys, [f for f, _ in pairs])
    found = []
    for r in records:
        values = {field: r[f"c{i}"] for i, (field, _) in enumerate(pairs)}
        found.append(RowView(
            r["_key"], r["_status"], r["_error"], r["_cause"], r["_attempts"], r["_failed_runs"],
            r["_failed_epoch"], r["_run_id"], r["_input_index"], r["_created_at"],
            r["_updated_at"], {f: v for f, v in values.items() if f not in outputs},
            {f: v for f, v in values.items() if f in outputs},
            canonical.loads(r["cells"]) if cells else {}))
    return found


_RUNS = """
SELECT run_id, epoch, created_at FROM {runs}
 WHERE org_id = $1 AND play = $2 AND (run_id = ANY($3::text[]) OR epoch = $4::bigint)
 ORDER BY epoch DESC LIMIT 100
"""


async def touching_runs(port: Port, org: str, play: str, row: RowView) -> list[TouchingRun]:
    """The runs that touched `row` (see the module docstring), newest first."""
    roles: dict[str, list[str]] = {}
    if row.run_id:
        roles.setdefault(row.run_id, []).append("wrote it last")
    for field, cell in sorted(row.cells.items()):
        run_id = cell.get("run_id") if isinstance(cell, dict) else None
        if isinstance(run_id, str) and run_id:
            done = cell.get("status") == "completed"
            roles.setdefault(run_id, []).append(f"{'wrote' if done else 'failed'} {field}")
    sql = _RUNS.format(runs=table(port, "runs"))

    async def op(conn: Connection) -> list[TouchingRun]:
        records = await conn.fetch(sql, org, play, list(roles), row.failed_epoch)
        out = []
        for r in records:
            mine = list(roles.get(r["run_id"], ()))
            if row.failed_epoch is not None and r["epoch"] == row.failed_epoch:
                mine.append("failed it last")
            out.append(TouchingRun(r["run_id"], r["epoch"], r["created_at"], tuple(mine)))
        return out

    return await read(port, op)
