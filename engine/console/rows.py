"""The console's reads of one sheet: a keyset page of its rows, its column counters and the
commonest causes of its failed rows (see `queries` for how every console read is bounded).

Rows come in the sheet's row order `(_input_index, _created_at, _key)`, which the row-order index
serves; rows whose input index is null come last, read by a second statement on
`(_created_at, _key)` once the indexed rows are exhausted, so each statement stays an index range.
A status filter or a key prefix narrows a page without changing its order; so does a cause
(the failures page's filter), whose rows the sheet's cause index holds in row order. An output
cell that is not completed shows as null (`engine.sheets.reading.shown_cell`, as every reader of
a sheet).
"""

from __future__ import annotations

import attrs

from ..runs import row_calls
from ..canonical import JsonObject
from ..pg import Connection, Record
from ..ports import Port, table
from ..sheets.counters import column_source, summary_source
from ..sheets.model import RowStatus
from ..sheets.reading import shown_cell
from ..sql import quote_ident
from ..sheets.audit import cause_counts, cause_counts_sql, sheets_with_causes
from ..sheets.causes import ErrorCause, group_causes
from .queries import (CAUSE_GROUPS, MAX_FIELDS, ROWS_PAGE, TOP_ERRORS, TableCounters, _counters,
                      _present, cause_sql, layout, read, scan)

FAILURE_CAUSES = 20  # causes listed on a table's failures page


@attrs.frozen
class Cursor:
    """Where a page of rows ends, in the sheet's row order."""

    input_index: int | None
    created: str
    key: str


@attrs.frozen
class RowsPage:
    fields: list[str]
    outputs: set[str]
    rows: list[JsonObject]
    next: Cursor | None
    columns: list[tuple[str, int, int]]
    counters: TableCounters | None


_FIELDS = """
SELECT r.field, r.column_name,
       EXISTS (SELECT 1 FROM {column_summary} AS c WHERE c.org_id = r.org_id AND c.play = r.play
                  AND c.table_namespace = r.table_namespace AND c.field = r.field) AS output
  FROM {registry} AS r
 WHERE r.org_id = $1 AND r.play = $2 AND r.table_namespace = $3
 ORDER BY r.position, r.field LIMIT {limit}
"""

_COLUMN_COUNTERS = """
SELECT field, completed, failed FROM {column_summary} AS c
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3 ORDER BY field LIMIT {limit}
"""

_ONE_TABLE = """
SELECT table_namespace, total, queued, running AS leased, {in_call} AS running, completed, failed,
       updated_at FROM {summary} AS s
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3
"""

_ROWS = """
SELECT _key, _status, _error, _input_index, _created_at::text AS created, _attempts{cols}
  FROM {t}
 WHERE {where} AND ($1::text IS NULL OR _status = $1::text)
   AND ($2::text IS NULL OR starts_with(_key, $2::text))
 ORDER BY _input_index, _created_at, _key LIMIT $3
"""

_INDEXED_FIRST = "_input_index IS NOT NULL"
_INDEXED_AFTER = "(_input_index, _created_at, _key) > ($4::bigint, $5::text::timestamptz, $6::text)"
_UNINDEXED_FIRST = "_input_index IS NULL"
_UNINDEXED_AFTER = "_input_index IS NULL AND (_created_at, _key) > ($4::text::timestamptz, $5::text)"


def _of_cause(cause: str | None, extra: tuple) -> str:
    """The condition keeping the rows of one stored cause (its bind follows the cursor's)."""
    return "" if cause is None else f" AND _cause = ${4 + len(extra)}::text"


def _cause_arg(cause: str | None) -> tuple:
    return () if cause is None else (cause,)


async def table_exists(port: Port, org: str, play: str, namespace: str) -> TableCounters | None:
    sql = _ONE_TABLE.format(summary=summary_source(port),
                            in_call=row_calls.in_call_sql(port, "s"))

    async def op(conn: Connection) -> TableCounters | None:
        record = await conn.fetchrow(sql, org, play, namespace)
        return None if record is None else _counters(record)

    return await read(port, op)


@attrs.frozen
class RowsQuery:
    """Which of a sheet's rows one page holds: those with `status` (a stored `_status`), whose
    key starts with `key_prefix`, failed with the stored `cause`, after the cursor `after`, at
    most `limit` of them (None filters nothing). A status that is no `RowStatus` raises
    `ValueError`."""

    status: RowStatus | None = attrs.field(
        default=None, converter=lambda value: None if value is None else RowStatus(value))
    key_prefix: str | None = None
    cause: str | None = None
    after: Cursor | None = None
    limit: int = ROWS_PAGE


async def rows_page(port: Port, org: str, play: str, namespace: str,
                    query: RowsQuery = RowsQuery()) -> RowsPage:
    """One keyset page of a sheet's rows in row order (`query`: which), with its fields and
    counters; with a `cause`, only the failed rows of that stored cause (the cause index's
    range)."""
    sheet = layout(port, org, play, namespace)
    status = None if query.status is None else query.status.value
    key_prefix, cause, after, limit = query.key_prefix, query.cause, query.after, query.limit
    fields_sql = _FIELDS.format(registry=table(port, "sheet_columns"),
                                column_summary=column_source(port),
                                limit=MAX_FIELDS)
    columns_sql = _COLUMN_COUNTERS.format(column_summary=column_source(port),
                                          limit=MAX_FIELDS)
    one_sql = _ONE_TABLE.format(summary=summary_source(port),
                            in_call=row_calls.in_call_sql(port, "s"))

    async def op(conn: Connection) -> RowsPage:
        record = await conn.fetchrow(one_sql, *sheet.counter_args)
        info = None if record is None else _counters(record)
        registered = await conn.fetch(fields_sql, *sheet.counter_args)
        columns = [(r["field"], r["completed"], r["failed"])
                   for r in await conn.fetch(columns_sql, *sheet.counter_args)]
        fields = [r["field"] for r in registered]
        outputs = {r["field"] for r in registered if r["output"]}
        if info is None or not await _present(conn, port, sheet):
            return RowsPage(fields, outputs, [], None, columns, info)
        if cause is not None and not await sheets_with_causes(conn, [sheet.qualified]):
            return RowsPage(fields, outputs, [], None, columns, info)  # no cause stored yet
        names = [fields] if fields else []  # the last bind: the field names, for their cells

        def statement(where: str, extra: tuple) -> str:
            bind = f"${4 + len(extra) + len(_cause_arg(cause))}::text[]"
            cols = "".join(
                f", ({shown_cell(quote_ident(r['column_name']), f'({bind})[{i + 1}]')})::text"
                f" AS c{i}" for i, r in enumerate(registered))
            return _ROWS.format(cols=cols, t=sheet.qualified,
                                where=where + _of_cause(cause, extra))

        found: list[Record] = []
        if after is None or after.input_index is not None:
            where, extra = ((_INDEXED_FIRST, ()) if after is None else
                            (_INDEXED_AFTER, (after.input_index, after.created, after.key)))
            found = list(await conn.fetch(statement(where, extra), status, key_prefix,
                                          limit + 1, *extra, *_cause_arg(cause), *names))
        if len(found) <= limit:
            last_null = after if after is not None and after.input_index is None else None
            where, extra = ((_UNINDEXED_FIRST, ()) if last_null is None else
                            (_UNINDEXED_AFTER, (last_null.created, last_null.key)))
            found += await conn.fetch(statement(where, extra), status, key_prefix,
                                      limit + 1 - len(found), *extra, *_cause_arg(cause), *names)
        rows = []
        for r in found[:limit]:
            row = {field: r[f"c{i}"] for i, field in enumerate(fields)}
            row.update(_key=r["_key"], _status=r["_status"], _error=r["_error"],
                       _input_index=r["_input_index"], _attempts=r["_attempts"],
                       _created=r["created"])
            rows.append(row)
        following = None
        if len(found) > limit:
            last = rows[-1]
            following = Cursor(last["_input_index"], last["_created"], last["_key"])
        return RowsPage(fields, outputs, rows, following, columns, info)

    return await read(port, op)


async def top_errors(port: Port, org: str, play: str, namespace: str,
                     run_id: str | None = None, *,
                     limit: int = TOP_ERRORS) -> list[ErrorCause] | None:
    """The `limit` commonest causes of the table's failed rows (`sheets.causes`; None when
    counting them ran past the console's scan timeout). A table's causes (no `run_id`) are
    counted from its partial cause index (its failed rows only, never a scan of the sheet) when
    that accounts for every failed row of its counters; otherwise (rows failed before causes
    were stored, one run's rows) they are a scan under the scan timeout."""
    sheet = layout(port, org, play, namespace)
    counters_sql = _ONE_TABLE.format(summary=summary_source(port),
                                     in_call=row_calls.in_call_sql(port, "s"))

    def fold(records: list[Record]) -> list[ErrorCause]:
        return group_causes(cause_counts(records))[:limit]

    async def op(conn: Connection) -> list[ErrorCause] | None:
        if not await _present(conn, port, sheet):
            return []
        if run_id is None and await sheets_with_causes(conn, [sheet.qualified]):
            stored = await scan(conn, cause_counts_sql(sheet.qualified, True, CAUSE_GROUPS,
                                                       stored_only=True), None)
            counters = await conn.fetchrow(counters_sql, *sheet.counter_args)
            failed = 0 if counters is None else counters["failed"]
            if stored is not None and sum(r["n"] for r in stored) == failed:
                return fold(stored)
        (sql,) = await cause_sql(conn, [sheet])
        found = await scan(conn, sql, run_id)
        return None if found is None else fold(found)

    return await read(port, op)
