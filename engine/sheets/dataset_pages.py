"""Keyset pages of a sheet: the statements a dataset reads with (no DDL, no lock, no write).

How it works
- A sheet's row order is input index (nulls last), creation time, key; the sheet's order index
  holds exactly that, so a page is one index range scan: the rows after the last one seen, in
  that order, `LIMIT n`. A `PageCursor` is the last row's (input index, created, key). Rows
  with an input index come first (`(_input_index, _created_at, _key) > cursor`), then rows
  without one (`_input_index IS NULL AND (_created_at, _key) > cursor`); one statement reads
  both ranges (`UNION ALL` merged in order under one `LIMIT`: the second range is read past
  its first row only when the first runs out).
- Each row comes back as JSON text built by the server: the fields under their own names (SQL
  NULL and JSON null both read as null; an output cell that is not completed reads as null,
  `reading.shown_cell`), then `_key`, `_status`, `_error`, `_input_index`, `_attempts`,
  `_failed_runs`, and with `cells` `_cells` (`reading.cells_json`) — the same dict `read_rows`
  gives. A page is one text, its rows
  joined by newlines (jsonb and JSON strings never hold a raw newline), with the next cursor
  (the last row's order columns, which come back beside each line).
- Why it is stable while other runs write: nothing moves a row in this order except a re-admission
  at another input index, so a row present when iteration began is read exactly once unless that
  happens; rows added behind the cursor are not read, rows added ahead of it are.
- `resolve` reads, once, the sheet's presence and which column holds which field (a table
  whose name another sheet holds is refused with `ConflictError`, never read).
"""

from __future__ import annotations

import datetime
import json

import attrs

from ..limits.bounds import is_int
from ..values.codecs import INT, STR, TIMESTAMP, optional, record
from ..errors import InvalidInputError

from ..pg import Connection
from ..ports import Port, table
from ..sql import quote_ident
from .statements import BindParams
from .layout import SheetLayout, existing_columns, foreign_table_error
from .model import RowStatus
from .reading import cells_json, check_cells_flag, check_run_id, registered_fields, shown_cell
from .reuse import member_condition

STATUSES = tuple(status.value for status in RowStatus)
MAX_PAGE_ROWS = 10_000
POLICY_COLUMNS = ("_attempts", "_failed_runs")
ORDER = "_input_index, _created_at, _key"

# One page: the rows of the ranges after the cursor, merged in the sheet's order.
_PAGE = """
SELECT i, c, k, line FROM (
    {ranges}
) AS ranges ORDER BY i, c, k LIMIT {limit}
"""

_RANGE = """(SELECT _input_index AS i, _created_at AS c, _key AS k, {line} AS line FROM {t}
      WHERE {where} ORDER BY {order} LIMIT {limit})"""

# A range of a run's rows: the sheet in its order, the run's condition applied above a fence
# (`OFFSET 0`) so the planner reads the order index until `LIMIT` rows pass it, whatever it
# guesses of the condition (a rerun's rows are most of the sheet; a guess of few would choose
# a scan and sort of the whole sheet for every page).
_FILTERED_RANGE = """(SELECT _input_index AS i, _created_at AS c, _key AS k, {line} AS line FROM (
        SELECT * FROM {t} WHERE {where} ORDER BY {order} OFFSET 0) AS s
      WHERE {filters} LIMIT {limit})"""

_COUNT = "SELECT count(*) FROM {t} WHERE {where}"


@attrs.frozen
class PageCursor:
    """Where the last page ended: the last row's input index, creation time and key."""

    input_index: int | None
    created_at: datetime.datetime
    key: str


@attrs.frozen
class DatasetPage:
    """One keyset page: `rows` rows as JSON lines in `text`, and the cursor after the last."""

    rows: int
    text: str
    after: PageCursor | None

    def lines(self) -> list[str]:
        return self.text.split("\n") if self.rows else []


CURSOR = record(PageCursor, input_index=optional(INT), created_at=TIMESTAMP, key=STR)
PAGE = record(DatasetPage, rows=INT, text=STR, after=optional(CURSOR))


@attrs.frozen
class Filters:
    """Which rows a dataset holds (every row, or those of a status, of a run, or both) and
    what of them: `fields` (None: all), and `cells`: whether each row has `_cells`."""

    status: str | None = None  # a `RowStatus` value (it travels as a string)
    run_id: str | None = None
    fields: tuple[str, ...] | None = None
    cells: bool = False


def check_filters(status: object, run_id: object, fields: object,
                  cells: object = False) -> Filters:
    """The filters, checked (before any query); `InvalidInputError` naming the bad one."""
    check_cells_flag(cells)
    if status is not None and status not in STATUSES:
        raise InvalidInputError(f"status must be None or one of {list(STATUSES)}, got {status!r}")
    run_id = check_run_id(run_id)
    if fields is not None:
        if isinstance(fields, (str, bytes)) or not hasattr(fields, "__iter__"):
            raise InvalidInputError("fields must be a list of field names or None")
        fields = tuple(dict.fromkeys(fields))
        bad = [f for f in fields if not isinstance(f, str) or not f or "\x00" in f]
        if bad:
            raise InvalidInputError(f"fields: {bad[0]!r} is not a field name")
    return Filters(status, run_id, fields, cells)


def check_page_rows(page_rows: object) -> int:
    if not is_int(page_rows, 1, MAX_PAGE_ROWS):
        raise InvalidInputError(f"page rows must be an integer from 1 to {MAX_PAGE_ROWS}, "
                                f"got {page_rows!r}")
    return page_rows


@attrs.frozen
class SheetRead:
    """What a page statement needs: the table, the (field, column) pairs read, whether the
    table has the policy counters (a sheet from before them reads zeros; no DDL here), the
    reuse membership table (a run's rows include those it reused), and which of the fields
    read are outputs (their cells make `_cells`)."""

    layout: SheetLayout
    present: bool
    pairs: tuple[tuple[str, str], ...] = ()
    policy: tuple[str, ...] = ()
    reuse: str = ""
    outputs: frozenset[str] = frozenset()


async def resolve(conn: Connection, port: Port, layout: SheetLayout, filters: Filters) -> SheetRead:
    """The sheet's presence and columns (`InvalidInputError` for a field it does not have)."""
    info = await conn.fetchrow(registered_fields(port), *layout.counter_args, layout.qualified,
                               layout.table)
    if info["foreign_table"]:
        raise foreign_table_error(layout)
    registered = dict(zip(info["fields"], info["columns"]))
    wanted = list(registered) if filters.fields is None else list(filters.fields)
    unknown = [f for f in wanted if f not in registered]
    if unknown:
        raise InvalidInputError(
            f"fields: table {layout.namespace!r} of play {layout.play!r} has no field "
            f"{unknown[0]!r}")
    if not info["present"]:
        return SheetRead(layout, False)
    existing = await existing_columns(conn, layout)
    pairs = tuple((f, registered[f]) for f in wanted if registered[f] in existing)
    return SheetRead(layout, True, pairs, tuple(c for c in POLICY_COLUMNS if c in existing),
                     table(port, "sheet_reuse"), frozenset(info["outputs"]))


def field_names(read: SheetRead, binds: BindParams) -> list[str]:
    """Per field read, the SQL naming it (an element of one text[] bind), for its cell meta."""
    if not read.pairs:
        return []
    names = binds.add([field for field, _ in read.pairs], "text[]")
    return [f"({names})[{i + 1}]" for i in range(len(read.pairs))]


def _line(read: SheetRead, binds: BindParams, cells: bool) -> str:
    """The SQL expression of a row's JSON text (see the module docstring)."""
    names = [("{" if i == 0 else ",") + json.dumps(field, ensure_ascii=False) + ":"
             for i, (field, _) in enumerate(read.pairs)]
    names_param = binds.add(names, "text[]") if names else None
    fields = field_names(read, binds)
    parts = [f"({names_param})[{i + 1}]"
             f" || coalesce(({shown_cell(quote_ident(column), fields[i])})::text, 'null')"
             for i, (_, column) in enumerate(read.pairs)]
    opening = "," if parts else "{"
    policy = [f"{name}::text" if name in read.policy else "'0'" for name in POLICY_COLUMNS]
    report = ""
    if cells:
        report = " || ',\"_cells\":' || " + cells_json(
            [(quote_ident(column), fields[i]) for i, (field, column) in enumerate(read.pairs)
             if field in read.outputs],
            "_attempts" if "_attempts" in read.policy else "0")
    parts.append(
        f"'{opening}\"_key\":' || to_json(_key)::text"
        " || ',\"_status\":' || to_json(_status)::text"
        " || ',\"_error\":' || coalesce(to_json(_error)::text, 'null')"
        " || ',\"_input_index\":' || coalesce(_input_index::text, 'null')"
        f" || ',\"_attempts\":' || {policy[0]} || ',\"_failed_runs\":' || {policy[1]}"
        f"{report} || '}}'")
    return " || ".join(parts)


def filter_sql(filters: Filters, binds: BindParams, read: SheetRead) -> list[str]:
    """The WHERE conditions of `filters`; a run's rows are those it wrote and those it
    reused (`reuse.member_condition`)."""
    where = []
    if filters.status is not None:
        where.append(f"_status = {binds.add(filters.status, 'text')}")
    if filters.run_id is not None:
        org, play, namespace = read.layout.counter_args
        where.append(member_condition(
            read.reuse, binds.add(filters.run_id, "text"), binds.add(org, "text"),
            binds.add(play, "text"), binds.add(namespace, "text")))
    return where


def page_statement(read: SheetRead, filters: Filters, after: PageCursor | None,
                   limit: int) -> tuple[str, list[object]]:
    """The statement of the page after `after` and its bind values."""
    binds = BindParams(1)
    limit_param = binds.add(limit, "bigint")
    line = _line(read, binds, filters.cells)
    where = filter_sql(filters, binds, read)
    ranges = []

    def add_range(bounds: list[str]) -> None:
        if filters.run_id is None:
            ranges.append(_RANGE.format(line=line, t=read.layout.qualified, order=ORDER,
                                        where=" AND ".join(bounds + where), limit=limit_param))
        else:
            ranges.append(_FILTERED_RANGE.format(
                line=line, t=read.layout.qualified, order=ORDER, where=" AND ".join(bounds),
                filters=" AND ".join(where), limit=limit_param))

    if after is None or after.input_index is not None:
        indexed = ["_input_index IS NOT NULL"]
        if after is not None:
            indexed.append(f"({ORDER}) > ({binds.add(after.input_index, 'bigint')}, "
                           f"{binds.add(after.created_at, 'timestamptz')}, "
                           f"{binds.add(after.key, 'text')})")
        add_range(indexed)
    unindexed = ["_input_index IS NULL"]
    if after is not None and after.input_index is None:
        unindexed.append(f"(_created_at, _key) > ({binds.add(after.created_at, 'timestamptz')}, "
                         f"{binds.add(after.key, 'text')})")
    add_range(unindexed)
    sql = _PAGE.format(ranges="\n    UNION ALL\n    ".join(ranges), limit=limit_param)
    return sql, binds.values


async def fetch_page(conn: Connection, read: SheetRead, filters: Filters,
                     after: PageCursor | None, limit: int) -> DatasetPage:
    """One page (one statement); an absent sheet has no rows."""
    if not read.present:
        return DatasetPage(0, "", None)
    sql, values = page_statement(read, filters, after, limit)
    records = await conn.fetch(sql, *values)
    if not records:
        return DatasetPage(0, "", None)
    last = records[-1]
    return DatasetPage(len(records), "\n".join([r[3] for r in records]),
                       PageCursor(last[0], last[1], last[2]))


# Every matching row's JSON line in the sheet's order, in one statement (for `COPY ... TO STDOUT`).
_ALL_LINES = "SELECT {line} FROM {t} WHERE {where} ORDER BY _input_index, _created_at, _key"

# COPY's CSV format with a quote and a delimiter that JSON text never holds raw (control
# characters are escaped in JSON), and no newline inside a line: each line comes out verbatim.
RAW_LINES = {"format": "csv", "delimiter": "\x02", "quote": "\x01"}


def lines_statement(read: SheetRead, filters: Filters) -> tuple[str, list[object]]:
    """One statement of every matching row's JSON line, in the sheet's order."""
    binds = BindParams(1)
    line = _line(read, binds, filters.cells)
    where = filter_sql(filters, binds, read) or ["true"]
    return _ALL_LINES.format(line=line, t=read.layout.qualified, where=" AND ".join(where)), \
        binds.values


def count_statement(read: SheetRead, filters: Filters) -> tuple[str, list[object]]:
    binds = BindParams(1)
    where = filter_sql(filters, binds, read) or ["true"]
    return _COUNT.format(t=read.layout.qualified, where=" AND ".join(where)), binds.values
