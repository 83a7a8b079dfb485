"""Datasets: a sheet's rows out, in pages, in constant memory.

How it works
- `dataset(port, scope, table_namespace, *, status=None, run_id=None, fields=None,
  cells=False)` checks its input (before any query) and returns a `Dataset`: a description, not
  a read. `status` keeps the rows of one status (`pending`, `running`, `enriched`, `failed`);
  `run_id` the rows that run last wrote and those it reused (its cache hits,
  `engine.sheets.reuse`), as `read_rows(run_id=)` reads them; `fields` the fields read (default:
  every field of the sheet, in its order); `cells` adds `_cells` to each row, as
  `read_rows(cells=True)` does. Every way of reading it (`iterate`, `pages`, `peek`,
  `materialize`, `to_arrow`, `to_pandas`, `copy_lines`) also takes `cells=` (None: the
  dataset's own), so `MapResult.dataset` reads cells too. An output cell that is not completed
  reads as null everywhere (`reading.shown_cell`).
- `Dataset.iterate(page_rows=1000)` reads keyset pages in the sheet's row order (input index,
  nulls last; creation; key), one statement a page, each on its own connection checkout (no
  transaction is held between pages). It does not read one snapshot: while other runs write, a
  row never appears twice and no row present when iteration began is skipped, unless a
  concurrent run re-admits it at another input index (then it may be read twice or not at
  all). Rows added behind the cursor are not read. The columns read are fixed when iteration
  begins (a field added meanwhile is not read).
- `count`, `peek`, `materialize`, `to_arrow` and `to_pandas` build on it; the last two need
  the `frames` extra (`engine.sheets.frames`). `copy_lines` is the bulk path for a direct
  port: every row's JSON line in one `COPY (SELECT …) TO STDOUT` (one statement, one snapshot).
- Through a gateway the pages travel as the action `sheets.read_page` (each request resolves the
  columns and reads one page) and the count as `sheets.count`; over a database session
  (`rows.read`) the same actions run against the database directly.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import attrs

from ..limits.bounds import is_int
from ..actions import action, routes_remote
from ..values.codecs import BOOL, INT, PLAY_SCOPE, STR, dict_of, list_of, optional
from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import SHEET_LANE, Port, with_connection
from ..values.scopes import PlayScope, check_scope
from . import frames
from .dataset_pages import (
    CURSOR, PAGE, RAW_LINES, DatasetPage, Filters, PageCursor, SheetRead, check_filters,
    check_page_rows, count_statement, fetch_page, lines_statement, resolve,
)
from .counters import summary_source
from .layout import layout_for
from .model import RowStatus

_COUNTERS = """
SELECT total, queued, running, completed, failed FROM {summary} AS s
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3
"""


@action("sheets.read_page", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "after": optional(CURSOR), "limit": INT,
    "status": optional(STR), "run_id": optional(STR), "fields": optional(list_of(STR)),
    "cells": BOOL,
}, result=PAGE, writes=False)
async def read_page(
    port: Port,
    scope: PlayScope,
    table_namespace: str,
    *,
    after: PageCursor | None = None,
    limit: int = 1000,
    status: str | None = None,
    run_id: str | None = None,
    fields: list[str] | None = None,
    cells: bool = False,
) -> DatasetPage:
    """The keyset page of at most `limit` rows after `after` (None: the first page); with
    `cells`, each row has `_cells` (an optional input: a request without it reads as before)."""
    check_scope(port, scope)
    filters = check_filters(status, run_id, fields, cells)
    check_page_rows(limit)
    layout = layout_for(port, scope, table_namespace)

    async def op(conn: Connection) -> DatasetPage:
        read = await resolve(conn, port, layout, filters)
        return await fetch_page(conn, read, filters, after, limit)

    return await with_connection(port, SHEET_LANE, op)


@action("sheets.count", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "status": optional(STR),
    "run_id": optional(STR),
}, result=INT, writes=False)
async def count(port: Port, scope: PlayScope, table_namespace: str, *,
                status: str | None = None, run_id: str | None = None) -> int:
    """How many rows of the sheet match: from the sheet's counters (always equal to a COUNT)
    when no run is named, else one COUNT (a run's rows include those it reused)."""
    check_scope(port, scope)
    filters = check_filters(status, run_id, None)
    layout = layout_for(port, scope, table_namespace)

    async def op(conn: Connection) -> int:
        if filters.run_id is None:
            row = await conn.fetchrow(_COUNTERS.format(summary=summary_source(port)),
                                      *layout.counter_args)
            counter = "total" if filters.status is None else RowStatus(filters.status).counter
            return 0 if row is None else row[counter]
        read = await resolve(conn, port, layout, Filters())
        if not read.present:
            return 0
        sql, values = count_statement(read, filters)
        return await conn.fetchval(sql, *values)

    return await with_connection(port, SHEET_LANE, op)


@action("sheets.field_kinds", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "status": optional(STR),
    "run_id": optional(STR), "fields": optional(list_of(STR)),
}, result=dict_of(STR), writes=False)
async def field_kinds(port: Port, scope: PlayScope, table_namespace: str, *,
                      status: str | None = None, run_id: str | None = None,
                      fields: list[str] | None = None) -> dict[str, str]:
    """Each field's kind over the matching rows (`frames.KINDS`), in field order: what a
    Parquet or Arrow column of it holds. One scan of the sheet."""
    check_scope(port, scope)
    filters = check_filters(status, run_id, fields)
    layout = layout_for(port, scope, table_namespace)

    async def op(conn: Connection) -> dict[str, str]:
        read = await resolve(conn, port, layout, filters)
        kinds = dict.fromkeys(filters.fields or (), "null") | {f: "null" for f, _ in read.pairs}
        if not read.pairs:
            return kinds
        sql, values = frames.kinds_statement(read, filters)
        record = await conn.fetchrow(sql, *values)
        for i, (field, _) in enumerate(read.pairs):
            kinds[field] = frames.kind_of(record[f"t{i}"], record[f"n{i}"])
        return kinds

    return await with_connection(port, SHEET_LANE, op)


@attrs.frozen
class Dataset:
    """The rows of one sheet that match some filters (see the module docstring)."""

    port: Port = attrs.field(repr=False)
    scope: PlayScope
    table_namespace: str
    filters: Filters = Filters()

    @property
    def status(self) -> str | None:
        return self.filters.status

    @property
    def run_id(self) -> str | None:
        return self.filters.run_id

    @property
    def fields(self) -> tuple[str, ...] | None:
        return self.filters.fields

    @property
    def cells(self) -> bool:
        """Whether its rows carry `_cells` unless a read says otherwise."""
        return self.filters.cells

    def _args(self) -> dict[str, str | None]:
        return {"status": self.filters.status, "run_id": self.filters.run_id}

    def _fields_arg(self) -> list[str] | None:
        return None if self.filters.fields is None else list(self.filters.fields)

    def _reading(self, cells: bool | None) -> "Dataset":
        """This dataset read with `cells` (None: as it is)."""
        if cells is None or cells is self.filters.cells:
            return self
        return attrs.evolve(self, filters=check_filters(
            self.filters.status, self.filters.run_id, self.filters.fields, cells))

    async def count(self) -> int:
        """How many rows match (now)."""
        return await count(self.port, self.scope, self.table_namespace, **self._args())

    async def field_kinds(self) -> dict[str, str]:
        """Each field's kind over the matching rows (what an Arrow column of it holds)."""
        return await field_kinds(self.port, self.scope, self.table_namespace, **self._args(),
                                 fields=self._fields_arg())

    async def pages(self, page_rows: int = 1000, *,
                    cells: bool | None = None) -> AsyncIterator[DatasetPage]:
        """The keyset pages, each one statement (see the module docstring)."""
        check_page_rows(page_rows)
        next_page = await _pager(self.port, self._reading(cells), page_rows)
        after = None
        while True:
            page = await next_page(after)
            if page.rows:
                yield page
            if page.rows < page_rows:
                return
            after = page.after

    async def copy_lines(self, output: Callable[[bytes], Awaitable[object]], *,
                         cells: bool | None = None) -> bool:
        """Every matching row's JSON line (UTF-8, newline-terminated) in the sheet's order,
        handed to `output` in chunks by one `COPY ... TO STDOUT`: one statement, one snapshot,
        the text built by the server. False (nothing read) on a remote port, which pages."""
        return await _copy_lines(self.port, self, output, cells)

    async def iterate(self, page_rows: int = 1000, *,
                      cells: bool | None = None) -> AsyncIterator[dict]:
        """Every matching row as a dict (as `read_rows` gives), page by page."""
        loads = frames.loads
        async for page in self.pages(page_rows, cells=cells):
            for line in page.lines():
                yield loads(line)

    async def peek(self, n: int = 10, *, cells: bool | None = None) -> list[dict]:
        """The first `n` matching rows."""
        check_page_rows(n)
        async for page in self.pages(n, cells=cells):
            return [frames.loads(line) for line in page.lines()]
        return []

    async def materialize(self, limit: int | None = None, *,
                          cells: bool | None = None) -> list[dict]:
        """The matching rows as a list (at most `limit` of them; all when None)."""
        if limit is not None and not is_int(limit, 0):
            raise InvalidInputError(f"limit must be an integer >= 0 or None, got {limit!r}")
        out: list[dict] = []
        if limit == 0:
            return out
        page_rows = 1000 if limit is None else min(limit, 1000)
        async for row in self.iterate(page_rows, cells=cells):
            out.append(row)
            if limit is not None and len(out) >= limit:
                break
        return out

    async def to_arrow(self, page_rows: int = 1000, *, cells: bool | None = None) -> Any:
        """A `pyarrow.Table`: a column a field (typed by its kind, nested values as JSON text),
        then `_key`, `_status`, `_error` (and `_cells` as JSON text with `cells`). Needs the
        `frames` extra."""
        pa = frames.require("pyarrow", "Dataset.to_arrow")
        reading = self._reading(cells)
        with_cells = reading.filters.cells
        kinds = await self.field_kinds()
        batches = [frames.record_batch(kinds, [frames.loads(line) for line in page.lines()],
                                       with_cells)
                   async for page in reading.pages(page_rows)]
        return pa.Table.from_batches(batches, schema=frames.arrow_schema(kinds, with_cells))

    async def to_pandas(self, page_rows: int = 1000, *, cells: bool | None = None) -> Any:
        """A `pandas.DataFrame` of the rows as `iterate` gives them (nested values stay Python
        objects). Needs the `frames` extra."""
        pd = frames.require("pandas", "Dataset.to_pandas")
        reading = self._reading(cells)
        rows = [row async for row in reading.iterate(page_rows)]
        system = [k for k in frames.SYSTEM_KEYS
                  if reading.filters.cells or k != frames.CELLS_COLUMN]
        return pd.DataFrame.from_records(rows) if rows else pd.DataFrame(
            columns=[*(self.filters.fields or ()), *system])


PageReader = Callable[[PageCursor | None], Awaitable[DatasetPage]]


async def _remote_pager(port: Port, ds: Dataset, page_rows: int) -> PageReader:
    """`_pager` through a remote port: each page is the action `sheets.read_page` (which
    resolves the columns on every request)."""
    # `cells` travels only when asked for, so a gateway from before it still answers.
    extra = {"cells": True} if ds.filters.cells else {}
    return lambda after: read_page(
        port, ds.scope, ds.table_namespace, after=after, limit=page_rows,
        **ds._args(), fields=ds._fields_arg(), **extra)


@routes_remote(_remote_pager)
async def _pager(port: Port, ds: Dataset, page_rows: int) -> PageReader:
    """How to read the page of `ds` after a cursor on this port: one statement on a
    connection, the columns read once (a remote port pages by action: `_remote_pager`)."""
    check_scope(port, ds.scope)
    layout = layout_for(port, ds.scope, ds.table_namespace)

    async def resolve_once(conn: Connection) -> SheetRead:
        return await resolve(conn, port, layout, ds.filters)

    read = await with_connection(port, SHEET_LANE, resolve_once)

    async def next_page(after: PageCursor | None) -> DatasetPage:
        return await with_connection(port, SHEET_LANE, lambda conn: fetch_page(
            conn, read, ds.filters, after, page_rows))

    return next_page


async def _pages_instead(port: Port, ds: Dataset, output: Callable[[bytes], Awaitable[object]],
                         cells: bool | None) -> bool:
    """`_copy_lines` through a remote port: nothing read (the caller pages instead)."""
    return False


@routes_remote(_pages_instead)
async def _copy_lines(port: Port, ds: Dataset, output: Callable[[bytes], Awaitable[object]],
                      cells: bool | None) -> bool:
    """`Dataset.copy_lines` on a direct port: one `COPY ... TO STDOUT` of the rows' lines."""
    check_scope(port, ds.scope)
    layout = layout_for(port, ds.scope, ds.table_namespace)
    filters = ds._reading(cells).filters

    async def op(conn: Connection) -> None:
        read = await resolve(conn, port, layout, filters)
        if read.present:
            sql, values = lines_statement(read, filters)
            await conn.copy_out(sql, *values, output=output, **RAW_LINES)

    await with_connection(port, SHEET_LANE, op)
    return True


def dataset(port: Port, scope: PlayScope, table_namespace: str, *, status: str | None = None,
            run_id: str | None = None, fields: Sequence[str] | None = None,
            cells: bool = False) -> Dataset:
    """The dataset of a sheet's matching rows (checks the filters; reads nothing yet)."""
    check_scope(port, scope)
    layout_for(port, scope, table_namespace)  # checks the namespace
    return Dataset(port, scope, table_namespace, check_filters(status, run_id, fields, cells))
