"""Operator reads of sheets: failed rows, the commonest errors and causes, rows per run.

How it works
- These are plain reads for people looking at a play (`runplane failures`, `runs`, the failure
  table that ends `run` and `demo`): no lock, one snapshot per statement, nothing created. A
  sheet that does not exist reads as empty, so a read-only caller never needs the schema
  repaired. Each is an action (`engine.actions`), so it works through a gateway as well.
- Inputs of a failed row are its registered fields that are not outputs; outputs are the fields
  with a column counter row (`sheet_column_summary`: the contract's outputs and every output a
  completion wrote).
- Failed rows and error counts filter `_status = 'failed'` (optionally one run's rows: those it
  wrote last); rows per run group by `_run_id`. Each is one scan of the sheet, fine for an
  operator command, never used on a run's hot path.
- Causes (`sheets.causes`): failed rows are counted by their stored `_cause` in SQL
  (`cause_counts_sql`, which the console reads too); rows failed before the column existed (a
  null `_cause`, or a sheet without the column yet) are counted by message, and `group_causes`
  gives each its message's cause, so they still group. `error_counts` keeps the commonest
  messages (`top`, `distinct`) and adds the commonest causes (`causes`, `distinct_causes`).
"""

from __future__ import annotations

from typing import Iterable

import attrs

from ..limits.bounds import is_int
from .. import canonical
from ..actions import action
from ..values.codecs import INT, PLAY_SCOPE, RAW, STR, TEXT, dict_of, list_of, optional, record
from ..errors import InvalidInputError
from ..canonical import JsonObject
from ..pg import Connection, Record
from ..ports import SHEET_LANE, Port, table, with_connection
from ..values.scopes import PlayScope, check_scope
from ..sql import quote_ident

from .causes import CauseCount, ErrorCause, cause_of, group_causes
from .counters import column_source
from .layout import FOREIGN_TABLE, foreign_table_error, layout_for, table_present
from .model import with_row_statuses


@attrs.frozen
class FailedRow:
    """A failed row: its key, its input fields, the stored error, the calls it took and its
    cause (`sheets.causes`: stored with the row, or its message's for a row failed before)."""

    key: str
    inputs: JsonObject
    error: str | None
    run_id: str | None
    input_index: int | None
    attempts: int | None = None
    cause: str | None = None


@attrs.frozen
class ErrorCount:
    """How many failed rows hold one error message (None: rows failed without a message)."""

    error: str | None
    count: int


@attrs.frozen
class ErrorCounts:
    """The commonest error messages of a sheet's failed rows, with the totals behind them, and
    the commonest causes (`sheets.causes`) with how many distinct causes there are."""

    failed: int
    distinct: int
    top: tuple[ErrorCount, ...]
    causes: tuple[ErrorCause, ...] = ()
    distinct_causes: int = 0


@attrs.frozen
class RunRows:
    """Rows of a sheet that a run wrote last, by status."""

    pending: int = 0
    running: int = 0
    enriched: int = 0
    failed: int = 0


FAILED_ROW = record(FailedRow, key=STR, inputs=RAW, error=optional(STR), run_id=optional(STR),
                    input_index=optional(INT), attempts=optional(INT), cause=optional(STR))
ERROR_COUNTS = record(
    ErrorCounts, failed=INT, distinct=INT,
    top=list_of(record(ErrorCount, error=optional(STR), count=INT), as_tuple=True),
    causes=list_of(record(ErrorCause, pattern=STR, count=INT, variants=INT,
                          example=optional(STR)), as_tuple=True),
    distinct_causes=INT)
RUN_ROWS = record(RunRows, pending=INT, running=INT, enriched=INT, failed=INT)

_INPUT_COLUMNS = """
SELECT to_regclass($4) IS NOT NULL AS present,
       {foreign} AS foreign_table,
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($4)
                  AND attname = '_attempts' AND NOT attisdropped) AS has_attempts,
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($4)
                  AND attname = '_cause' AND NOT attisdropped) AS has_cause,
       coalesce(array_agg(r.field ORDER BY r.position, r.field)
                FILTER (WHERE r.field IS NOT NULL), '{{}}') AS fields,
       coalesce(array_agg(r.column_name ORDER BY r.position, r.field)
                FILTER (WHERE r.field IS NOT NULL), '{{}}') AS columns
  FROM (SELECT 1) AS one
  LEFT JOIN {registry} AS r
    ON r.org_id = $1 AND r.play = $2 AND r.table_namespace = $3
   AND NOT EXISTS (SELECT 1 FROM {column_summary} AS c
                    WHERE c.org_id = r.org_id AND c.play = r.play
                      AND c.table_namespace = r.table_namespace AND c.field = r.field)
"""

_FAILED_ROWS = with_row_statuses("""
SELECT _key, _error, _run_id, _input_index{attempts}, {cause} AS cause{cols} FROM {t}
 WHERE _status = {FAILED} AND ($2::text IS NULL OR _run_id = $2::text)
 ORDER BY _input_index ASC NULLS LAST, _created_at ASC, _key ASC
 LIMIT $1
""")

_ERROR_COUNTS = with_row_statuses("""
WITH grouped AS (
    SELECT _error AS error, count(*) AS n FROM {t}
     WHERE _status = {FAILED} AND ($1::text IS NULL OR _run_id = $1::text)
     GROUP BY _error
)
SELECT error, n, (SELECT sum(n) FROM grouped)::bigint AS failed,
       (SELECT count(*) FROM grouped) AS distinct_errors
  FROM grouped ORDER BY n DESC, error ASC NULLS LAST LIMIT $2
""")

# Failed rows counted by stored cause, or by message where none was stored (`{cause}` is
# `_cause`, or NULL for a sheet from before the column); `$1` a run id or NULL. `groups` is how
# many groups there are before the limit. One home: the console reads it too.
_CAUSE_COUNTS = with_row_statuses("""
SELECT {cause} AS cause, CASE WHEN {cause} IS NULL THEN _error END AS message, count(*) AS n,
       count(DISTINCT _error) + (count(*) FILTER (WHERE _error IS NULL) > 0)::int AS variants,
       mode() WITHIN GROUP (ORDER BY _error) AS example, count(*) OVER () AS groups
  FROM {t}
 WHERE _status = {FAILED} AND ($1::text IS NULL OR _run_id = $1::text){stored}
 GROUP BY 1, 2 ORDER BY n DESC, cause ASC NULLS LAST, message ASC NULLS LAST LIMIT {limit}
""")

# Which of some sheets (`$1`, qualified names) have the `_cause` column.
_WITH_CAUSES = """
SELECT coalesce(array_agg(u.t), '{}') FROM unnest($1::text[]) AS u(t)
 WHERE EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(u.t)
                  AND attname = '_cause' AND NOT attisdropped)
"""

CAUSE_GROUPS_READ = 2000  # groups read before folding; past it the rarest are left out


def cause_counts_sql(qualified: str, has_cause: bool, limit: int = CAUSE_GROUPS_READ, *,
                     stored_only: bool = False) -> str:
    """The statement counting the failed rows of the sheet `qualified` by cause (see above);
    `stored_only`: only rows with a stored cause, a range of the sheet's partial cause index
    (the failed rows) instead of a scan of the whole sheet."""
    stored = " AND _cause IS NOT NULL" if stored_only and has_cause else ""
    return _CAUSE_COUNTS.format(cause="_cause" if has_cause else "NULL::text", t=qualified,
                                limit=int(limit), stored=stored)


def cause_counts(records: Iterable[Record]) -> list[CauseCount]:
    """The records of `cause_counts_sql` as counts `group_causes` folds."""
    return [CauseCount(r["cause"], r["message"], r["n"], r["variants"], r["example"])
            for r in records]


async def sheets_with_causes(conn: Connection, qualified: list[str]) -> set[str]:
    """Which of these sheets (qualified names) have the `_cause` column yet."""
    return set(await conn.fetchval(_WITH_CAUSES, qualified)) if qualified else set()


# A sheet's rows by status, per run (`$1` the run ids; the console reads it too).
RUN_ROWS_SQL = with_row_statuses("""
SELECT _run_id,
       count(*) FILTER (WHERE _status = {PENDING}) AS pending,
       count(*) FILTER (WHERE _status = {RUNNING}) AS running,
       count(*) FILTER (WHERE _status = {ENRICHED}) AS enriched,
       count(*) FILTER (WHERE _status = {FAILED}) AS failed
  FROM {t} WHERE _run_id = ANY($1::text[]) GROUP BY _run_id
""")

def _check_limit(limit: object) -> None:
    if not is_int(limit, 1):
        raise InvalidInputError(f"limit must be a positive integer, got {limit!r}")


def _check_run_id(run_id: object) -> str | None:
    if run_id is None:
        return None
    if not isinstance(run_id, str) or not run_id.strip():
        raise InvalidInputError("run_id must be a non-empty string or None")
    return run_id.strip()


@action("sheets.failed_rows", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "run_id": optional(STR), "limit": INT,
}, result=list_of(FAILED_ROW), writes=False)
async def failed_rows(
    port: Port, scope: PlayScope, table_namespace: str, *, run_id: str | None = None,
    limit: int = 20,
) -> list[FailedRow]:
    """Up to `limit` failed rows in input order (only `run_id`'s when given)."""
    check_scope(port, scope)
    _check_limit(limit)
    run_id = _check_run_id(run_id)
    layout = layout_for(port, scope, table_namespace)
    columns_sql = _INPUT_COLUMNS.format(
        registry=table(port, "sheet_columns"),
        column_summary=column_source(port),
        foreign=FOREIGN_TABLE.format(summary=table(port, "sheet_summary"), t="$5", o="$1",
                                     p="$2", n="$3"),
    )

    async def op(conn: Connection) -> list[FailedRow]:
        info = await conn.fetchrow(columns_sql, *layout.counter_args, layout.qualified,
                                   layout.table)
        if info["foreign_table"]:
            raise foreign_table_error(layout)
        if not info["present"]:
            return []
        pairs = list(zip(info["fields"], info["columns"]))
        cols = "".join(f", {quote_ident(c)}::text AS c{i}" for i, (_, c) in enumerate(pairs))
        attempts = ", _attempts" if info["has_attempts"] else ""
        cause = "_cause" if info["has_cause"] else "NULL::text"
        sql = _FAILED_ROWS.format(attempts=attempts, cause=cause, cols=cols, t=layout.qualified)
        records = await conn.fetch(sql, limit, run_id)
        return [
            FailedRow(
                key=record["_key"],
                inputs={field: canonical.loads(record[f"c{i}"])
                        for i, (field, _) in enumerate(pairs) if record[f"c{i}"] is not None},
                error=record["_error"],
                run_id=record["_run_id"],
                input_index=record["_input_index"],
                attempts=record["_attempts"] if info["has_attempts"] else None,
                cause=record["cause"] if record["cause"] is not None
                else cause_of(record["_error"]),
            )
            for record in records
        ]

    return await with_connection(port, SHEET_LANE, op)


@action("sheets.error_counts", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "run_id": optional(STR), "limit": INT,
}, result=ERROR_COUNTS, writes=False)
async def error_counts(
    port: Port, scope: PlayScope, table_namespace: str, *, run_id: str | None = None,
    limit: int = 5,
) -> ErrorCounts:
    """The `limit` commonest error messages and causes of failed rows (only `run_id`'s when
    given). Causes are exact while the failed rows hold at most `CAUSE_GROUPS_READ` causes and
    messages without a stored cause; past that the rarest groups are left out."""
    check_scope(port, scope)
    _check_limit(limit)
    run_id = _check_run_id(run_id)
    layout = layout_for(port, scope, table_namespace)

    async def op(conn: Connection) -> ErrorCounts:
        if not await table_present(conn, port, layout):
            return ErrorCounts(0, 0, ())
        records = await conn.fetch(_ERROR_COUNTS.format(t=layout.qualified), run_id, limit)
        if not records:
            return ErrorCounts(0, 0, ())
        has_cause = layout.qualified in await sheets_with_causes(conn, [layout.qualified])
        read = max(limit, CAUSE_GROUPS_READ)
        groups = await conn.fetch(cause_counts_sql(layout.qualified, has_cause, read), run_id)
        causes = group_causes(cause_counts(groups))
        unread = max(0, groups[0]["groups"] - len(groups)) if groups else 0
        return ErrorCounts(
            failed=records[0]["failed"],
            distinct=records[0]["distinct_errors"],
            top=tuple(ErrorCount(record["error"], record["n"]) for record in records),
            causes=tuple(causes[:limit]),
            distinct_causes=len(causes) + unread,
        )

    return await with_connection(port, SHEET_LANE, op)


@action("sheets.run_rows", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "run_ids": list_of(TEXT),
}, result=dict_of(RUN_ROWS), writes=False)
async def run_rows(
    port: Port, scope: PlayScope, table_namespace: str, run_ids: list[str]
) -> dict[str, RunRows]:
    """Rows of the sheet each listed run wrote last, by status (runs with none are absent)."""
    check_scope(port, scope)
    layout = layout_for(port, scope, table_namespace)
    run_ids = list(dict.fromkeys(run_ids))

    async def op(conn: Connection) -> dict[str, RunRows]:
        if not run_ids or not await table_present(conn, port, layout):
            return {}
        records = await conn.fetch(RUN_ROWS_SQL.format(t=layout.qualified), run_ids)
        return {
            record["_run_id"]: RunRows(record["pending"], record["running"],
                                       record["enriched"], record["failed"])
            for record in records
        }

    return await with_connection(port, SHEET_LANE, op)
