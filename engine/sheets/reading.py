"""Reading sheets: rows in input order, and the counters.

How it works
- `read_rows` maps physical columns back to field names through the `sheet_columns` registry
  (a table whose name another sheet holds is refused with `ConflictError`, never read) and
  returns one dict per row: every registered field under its own name, plus `_key`,
  `_status`, `_error`, `_input_index`, `_attempts` (calls of the map function, across runs) and
  `_failed_runs` (runs in which the row failed) — a field whose name equals one of those is
  shadowed by the system value in these dicts. An output cell's value is shown only when the
  cell is completed (`shown_cell`, the one expression every reader of cell values uses): a
  cell that failed, or that `force` re-admitted and was not completed again, reads as null
  (the value stays stored). With `cells=True` each row also has `_cells` (`cells_json`): per
  output field read, `{"status": "completed|failed|pending", "completed_at": ISO-8601 or null,
  "run_id": ..., "attempts": n, "last_value": <the value stored, or null>}`. Outputs are the
  fields with a column counter row (the contract's outputs and every output a completion
  wrote); an output cell with no cell meta reads `pending` when it holds no value. Rows are
  ordered by input index (nulls last), creation time and key. With `run_id`, only that run's
  rows are read — those it last wrote and the cache hits it reused (`engine.sheets.reuse`) —
  and among them only the enriched ones if any exist, else only the failed ones if any exist,
  else all of them.
- `summary` reads the counter rows; a sheet never written reads as all zeros. `summaries` reads
  the counters of every sheet of a play at once (the command line's status). All are plain
  reads: no lock, one snapshot per statement.
"""

from __future__ import annotations

from ..limits.bounds import is_int
from .. import canonical
from ..actions import action
from ..values.codecs import BOOL, INT, PLAY_SCOPE, RAW, STR, dict_of, list_of, optional
from ..errors import InvalidInputError
from ..limits.inputs import identifier_problem
from ..pg import Connection
from ..ports import SHEET_LANE, Port, table, with_connection
from ..values.scopes import PlayScope, check_scope
from ..sql import quote_ident

from .counters import column_source, summary_source
from .layout import FOREIGN_TABLE, existing_columns, foreign_table_error, layout_for
from .model import SUMMARY, SUMMARY_COUNTERS, CellStatus, ColumnSummary, Summary, with_row_statuses
from .reuse import MEMBERS

# Whether the sheet exists (and is its own), its registered fields and their columns in order,
# and which fields are outputs (a column counter row) (`dataset_pages` reads them too).
REGISTERED_FIELDS = """
SELECT to_regclass($4) IS NOT NULL AS present,
       {foreign} AS foreign_table,
       coalesce((SELECT array_agg(field ORDER BY position, field) FROM {registry}
                  WHERE org_id = $1 AND play = $2 AND table_namespace = $3), '{{}}') AS fields,
       coalesce((SELECT array_agg(column_name ORDER BY position, field) FROM {registry}
                  WHERE org_id = $1 AND play = $2 AND table_namespace = $3), '{{}}') AS columns,
       coalesce((SELECT array_agg(field) FROM {column_summary} AS c
                  WHERE org_id = $1 AND play = $2 AND table_namespace = $3), '{{}}') AS outputs
"""


def registered_fields(port: Port) -> str:
    """`REGISTERED_FIELDS` for `port` (binds: org, play, namespace, qualified table, table)."""
    return REGISTERED_FIELDS.format(
        registry=table(port, "sheet_columns"), column_summary=column_source(port),
        foreign=FOREIGN_TABLE.format(summary=table(port, "sheet_summary"), t="$5", o="$1",
                                     p="$2", n="$3"))


# -- cell values: the one home of what a reader shows ------------------------------------------
_COMPLETED = CellStatus.COMPLETED.sql


def shown_cell(column: str, field: str) -> str:
    """SQL: the value a reader shows of the cell in `column` (a quoted column) of the field
    named by `field` (an SQL text expression, a bind): the stored value when the cell is
    completed, else NULL. A cell whose cell meta has no status (an input, an output never
    written) is shown as stored; a `failed` or `pending` one is not. Every path that reads
    cell values (rows, dataset pages and their COPY, field kinds, the console) uses this."""
    return (f"CASE WHEN coalesce(_cell_meta -> {field} ->> 'status', {_COMPLETED}) = {_COMPLETED}"
            f" THEN {column} END")


def _cell_json(column: str, field: str, attempts: str) -> str:
    """SQL: the JSON text of one `_cells` entry (see the module docstring). `attempts` is the
    row's attempts, reported for a written cell whose meta records none."""
    meta = f"(_cell_meta -> {field})"
    empty = f"({column} IS NULL OR {column} = 'null'::jsonb)"
    status = (f"coalesce({meta} ->> 'status', CASE WHEN {empty} THEN {CellStatus.PENDING.sql}"
              f" ELSE {_COMPLETED} END)")
    completed_at = (
        f"CASE WHEN {meta} ->> 'status' = {_COMPLETED}"
        f" AND jsonb_typeof({meta} -> 'completed_at') = 'number'"
        f" THEN to_json(to_char(to_timestamp(({meta} ->> 'completed_at')::float8)"
        """ AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))::text ELSE 'null' END""")
    written = f"CASE WHEN {meta} IS NULL THEN 'null' ELSE ({attempts})::text END"
    return (f"""'{{"status":' || to_json({status})::text"""
            f""" || ',"completed_at":' || {completed_at}"""
            f""" || ',"run_id":' || coalesce(({meta} -> 'run_id')::text, 'null')"""
            f""" || ',"attempts":' || coalesce(({meta} -> 'attempts')::text, {written})"""
            f""" || ',"last_value":' || coalesce({column}::text, 'null') || '}}'""")


def cells_json(cells: list[tuple[str, str]], attempts: str) -> str:
    """SQL: the JSON text of a row's `_cells`, one entry per (quoted column, field-name
    expression) of `cells` (the output fields read, in order); `attempts` the row's attempts
    column (or `0` for a sheet without one)."""
    if not cells:
        return "'{}'"
    parts = [f"to_json({field})::text || ':' || {_cell_json(column, field, attempts)}"
             for column, field in cells]
    return "'{' || " + " || ',' || ".join(parts) + " || '}'"

_POLICY_COLUMNS = ("_attempts", "_failed_runs")

_ORDER = "ORDER BY _input_index ASC NULLS LAST, _created_at ASC, _key ASC"

_READ_ALL = """
SELECT _key, _status, _error, _input_index{policy}{cols}{cells} FROM {t} {order}
 LIMIT $1 OFFSET $2
"""

# A run's rows: those it wrote, and those it reused (`reuse.MEMBERS`).
_READ_RUN = with_row_statuses("""
WITH {members},
members AS MATERIALIZED (
    SELECT * FROM {t} WHERE _run_id = $3
    UNION ALL
    SELECT * FROM reused
),
preferred AS (
    SELECT CASE WHEN EXISTS (SELECT 1 FROM members WHERE _status = {ENRICHED}) THEN {ENRICHED}
                WHEN EXISTS (SELECT 1 FROM members WHERE _status = {FAILED}) THEN {FAILED}
           END AS status
)
SELECT _key, _status, _error, _input_index{policy}{cols}{cells} FROM members
 WHERE (SELECT status FROM preferred) IS NULL OR _status = (SELECT status FROM preferred)
 {order} LIMIT $1 OFFSET $2
""")

_SUMMARY = """
SELECT total, queued, running, completed, failed FROM {summary} AS s
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3
"""

_COLUMN_SUMMARY = """
SELECT field, completed, failed FROM {column_summary} AS c
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3
 ORDER BY field
"""

_PLAY_SUMMARIES = """
SELECT table_namespace, total, queued, running, completed, failed FROM {summary} AS s
 WHERE org_id = $1 AND play = $2
 ORDER BY table_namespace
"""

_PLAY_COLUMN_SUMMARIES = """
SELECT table_namespace, field, completed, failed FROM {column_summary} AS c
 WHERE org_id = $1 AND play = $2
 ORDER BY table_namespace, field
"""

MAX_READ_ROWS = 10_000


def _check_page(limit: object, offset: object) -> int:
    """The limit to use (clamped to 1..`MAX_READ_ROWS`); `InvalidInputError` for a limit or
    offset that is no integer >= 0."""
    for name, value in (("limit", limit), ("offset", offset)):
        if not is_int(value, 0):
            raise InvalidInputError(f"{name} must be an integer >= 0, got {value!r}")
    return min(max(limit, 1), MAX_READ_ROWS)  # type: ignore[type-var]


def check_cells_flag(cells: object) -> None:
    """`cells` must be True or False (`InvalidInputError` before any query)."""
    if not isinstance(cells, bool):
        raise InvalidInputError(f"cells must be True or False, got {cells!r}")


def check_run_id(run_id: object) -> str | None:
    """A run-id filter, stripped; `InvalidInputError` before any query for anything else."""
    if run_id is None:
        return None
    if not isinstance(run_id, str):
        raise InvalidInputError("run_id must be a string or None")
    run_id = run_id.strip()
    problem = identifier_problem(run_id)
    if problem is not None:
        raise InvalidInputError(f"run_id {problem}")
    return run_id


@action("sheets.read_rows", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "run_id": optional(STR), "limit": INT,
    "offset": INT, "cells": BOOL,
}, result=list_of(RAW), writes=False)
async def read_rows(
    port: Port,
    scope: PlayScope,
    table_namespace: str,
    *,
    run_id: str | None = None,
    limit: int = 1000,
    offset: int = 0,
    cells: bool = False,
) -> list[dict]:
    """Rows of a sheet as dicts (see the module docstring); [] when the sheet does not exist.
    `limit` is clamped to 1..10,000 rows: page through larger sheets with `offset`. `cells`:
    each row also has `_cells`."""
    check_scope(port, scope)
    limit = _check_page(limit, offset)
    run_id = check_run_id(run_id)
    check_cells_flag(cells)
    layout = layout_for(port, scope, table_namespace)
    registered = registered_fields(port)

    async def op(conn: Connection) -> list[dict]:
        info = await conn.fetchrow(registered, *layout.counter_args, layout.qualified,
                                   layout.table)
        if info["foreign_table"]:  # another sheet's name collides with ours: never read it
            raise foreign_table_error(layout)
        if not info["present"]:
            return []
        existing = await existing_columns(conn, layout)
        pairs = [(f, c) for f, c in zip(info["fields"], info["columns"]) if c in existing]
        names = "$3::text[]" if run_id is None else "$7::text[]"  # the fields, for their cells
        cols = "".join(f", {shown_cell(quote_ident(c), f'({names})[{i + 1}]')}::text AS c{i}"
                       for i, (_, c) in enumerate(pairs))
        policy = "".join(  # a sheet from before these columns reads as zeros (no DDL here)
            f", {name}" if name in existing else f", 0 AS {name}" for name in _POLICY_COLUMNS
        )
        report = ""
        if cells:
            outputs = set(info["outputs"])
            report = ", " + cells_json(
                [(quote_ident(c), f"({names})[{i + 1}]") for i, (f, c) in enumerate(pairs)
                 if f in outputs],
                "_attempts" if "_attempts" in existing else "0") + " AS cells"
        fields = [[f for f, _ in pairs]] if pairs else []  # no field: no bind
        if run_id is None:
            sql = _READ_ALL.format(cols=cols, policy=policy, t=layout.qualified, order=_ORDER,
                                   cells=report)
            records = await conn.fetch(sql, limit, offset, *fields)
        else:
            members = MEMBERS.format(reuse=table(port, "sheet_reuse"), t=layout.qualified)
            sql = _READ_RUN.format(cols=cols, policy=policy, t=layout.qualified, order=_ORDER,
                                   members=members.strip(), cells=report)
            records = await conn.fetch(sql, limit, offset, run_id, *layout.counter_args,
                                       *fields)
        out = []
        loads = canonical.loads
        for record in records:
            row = {field: loads(record[f"c{i}"]) for i, (field, _) in enumerate(pairs)}
            row["_key"] = record["_key"]
            row["_status"] = record["_status"]
            row["_error"] = record["_error"]
            row["_input_index"] = record["_input_index"]
            row["_attempts"] = record["_attempts"]
            row["_failed_runs"] = record["_failed_runs"]
            if cells:
                row["_cells"] = loads(record["cells"])
            out.append(row)
        return out

    return await with_connection(port, SHEET_LANE, op)


@action("sheets.summary", params={"scope": PLAY_SCOPE, "table_namespace": STR}, result=SUMMARY,
        writes=False)
async def summary(port: Port, scope: PlayScope, table_namespace: str) -> Summary:
    """The counters of a sheet (zeros when it was never written)."""
    check_scope(port, scope)
    layout = layout_for(port, scope, table_namespace)
    summary_sql = _SUMMARY.format(summary=summary_source(port))
    columns_sql = _COLUMN_SUMMARY.format(column_summary=column_source(port))

    async def op(conn: Connection) -> Summary:
        row = await conn.fetchrow(summary_sql, *layout.counter_args)
        columns = await conn.fetch(columns_sql, *layout.counter_args)
        values = dict(row) if row is not None else dict.fromkeys(SUMMARY_COUNTERS, 0)
        return Summary(
            **values,
            columns={r["field"]: ColumnSummary(r["completed"], r["failed"]) for r in columns},
        )

    return await with_connection(port, SHEET_LANE, op)


@action("sheets.summaries", params={"scope": PLAY_SCOPE}, result=dict_of(SUMMARY), writes=False)
async def summaries(port: Port, scope: PlayScope) -> dict[str, Summary]:
    """The counters of every sheet of the play that has counters, by table namespace (sorted).

    The same values `summary` reads for each namespace, in two statements for the whole play.
    """
    check_scope(port, scope)
    summary_sql = _PLAY_SUMMARIES.format(summary=summary_source(port))
    columns_sql = _PLAY_COLUMN_SUMMARIES.format(column_summary=column_source(port))

    async def op(conn: Connection) -> dict[str, Summary]:
        rows = await conn.fetch(summary_sql, scope.org_id, scope.play)
        columns = await conn.fetch(columns_sql, scope.org_id, scope.play)
        per_table: dict[str, dict[str, ColumnSummary]] = {}
        for r in columns:
            per_table.setdefault(r["table_namespace"], {})[r["field"]] = ColumnSummary(
                r["completed"], r["failed"]
            )
        return {
            r["table_namespace"]: Summary(
                **{name: r[name] for name in SUMMARY_COUNTERS},
                columns=per_table.get(r["table_namespace"], {}),
            )
            for r in rows
        }

    return await with_connection(port, SHEET_LANE, op)
