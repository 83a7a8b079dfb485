"""Sheets read by hand: a `SELECT` with readable column names, and a view per sheet.

How it works
- A sheet's table and columns have hashed names (`layout`); which column holds which field is
  the column registry's to say (`sheet_columns`). `sheet_select` turns a sheet's registered
  columns into one `SELECT` whose aliases are the field names (in registry order) after the
  readable system columns (`READABLE_SYSTEM_COLUMNS`: `_key`, `_status`, `_error`, …). A cell
  shows its value only when it is completed, as on every read path (`reading.shown_cell`): a
  failed or re-admitted cell reads as null.
- `sync_views` keeps one view per sheet in the schema `<schema>_views`, named
  `"<org>/<play>/<table>"` (past 63 bytes: a prefix and a hash of the whole name, as any alias
  past PostgreSQL's identifier limit), each `WITH (security_invoker = true)`, so a reader sees
  through a view only what the sheet's own grants and row policies let them see. In one
  transaction it (re)creates every sheet's view from the registry as it is now (a map that
  added a column since gets it) and drops the views of sheets that are gone; it only ever
  drops views it made (their comment says so), never anything else in that schema.
- A write that creates a sheet's table or adds a column (`column_registry.prepare_columns`)
  refreshes that sheet's view in the same transaction (`refresh_view`, in a savepoint) when
  the views schema exists, so the views stay in step with the sheets.
- Identifiers go through `sql.quote_ident`; nothing here writes a sheet.
Who calls: `runplane sql` (`sheet_select`, read-only) and `runplane psql` / `runplane views`
(`sync_views`, which creates the views schema on first use).
"""

from __future__ import annotations

import hashlib
import logging

import attrs

from ..errors import DatabaseError
from ..pg import Connection
from ..ports import RECEIPTS_LANE, Port, table
from ..sql import quote_ident
from .layout import table_name
from .reading import shown_cell

log = logging.getLogger("runplane.sheets")

MAX_IDENTIFIER_BYTES = 63  # PostgreSQL's NAMEDATALEN - 1
HASH_CHARS = 10
VIEW_COMMENT = "runplane sheet view"  # marks the views `sync_views` owns

# The system columns a person reads, in this order, before the fields.
READABLE_SYSTEM_COLUMNS = ("_key", "_status", "_error", "_run_id", "_attempts", "_input_index",
                           "_created_at", "_updated_at")


@attrs.frozen
class SheetColumns:
    """One sheet as the registry holds it: its table and (field, column) pairs in order."""

    org_id: str
    play: str
    namespace: str
    table: str
    fields: tuple[tuple[str, str], ...]
    system: tuple[str, ...] = READABLE_SYSTEM_COLUMNS

    @property
    def view_name(self) -> str:
        return identifier(f"{self.org_id}/{self.play}/{self.namespace}")


def identifier(name: str) -> str:
    """`name` as PostgreSQL keeps it: itself within 63 bytes, else its longest prefix that fits
    with `~` and a hash of the whole name (so two long names never meet)."""
    raw = name.encode("utf-8")
    if len(raw) <= MAX_IDENTIFIER_BYTES:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:HASH_CHARS]
    prefix = raw[:MAX_IDENTIFIER_BYTES - HASH_CHARS - 1].decode("utf-8", errors="ignore")
    return f"{prefix}~{digest}"


def views_schema(schema: str) -> str:
    return identifier(f"{schema}_views")


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def sheet_select(schema: str, sheet: SheetColumns) -> str:
    """A `SELECT` over the sheet with readable aliases (see the module docstring)."""
    lines = [quote_ident(name) for name in sheet.system]
    # A cell shows only when completed, as on every read path (`reading.shown_cell`); a view
    # takes no binds, so the field name is a literal here.
    lines += [f"{shown_cell(quote_ident(column), _literal(field))} AS "
              f"{quote_ident(identifier(field))}" for field, column in sheet.fields]
    columns = ",\n       ".join(lines)
    return (f"SELECT {columns}\n  FROM {quote_ident(schema)}.{quote_ident(sheet.table)}\n"
            " ORDER BY _input_index, _created_at, _key")


# Sheets whose table exists, with their registered fields in registry order.
_SHEETS = """
SELECT s.org_id, s.play, s.table_namespace, s.table_name,
       coalesce(array_agg(c.field ORDER BY c.position, c.field)
                FILTER (WHERE c.field IS NOT NULL), '{{}}') AS fields,
       coalesce(array_agg(c.column_name ORDER BY c.position, c.field)
                FILTER (WHERE c.field IS NOT NULL), '{{}}') AS columns
  FROM {summary} AS s
  LEFT JOIN {registry} AS c USING (org_id, play, table_namespace)
 WHERE ($1::text IS NULL OR s.org_id = $1) AND ($2::text IS NULL OR s.play = $2)
   AND ($3::text IS NULL OR s.table_namespace = $3)
 GROUP BY s.org_id, s.play, s.table_namespace, s.table_name
 ORDER BY s.org_id, s.play, s.table_namespace
"""

# The columns a table has (none: no such table).
_COLUMNS = """
SELECT attname FROM pg_attribute
 WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped
"""


async def read_sheets(port: Port, org_id: str | None = None, play: str | None = None,
                      namespace: str | None = None) -> list[SheetColumns]:
    """The sheets of the schema (of one org, play or table when given) whose table exists, with
    the columns it has (a sheet from before a later system column lacks it until written)."""
    async with port.connection(RECEIPTS_LANE) as conn:
        return await _read_sheets(conn, port, org_id, play, namespace)


async def _read_sheets(conn: Connection, port: Port, org_id: str | None, play: str | None,
                       namespace: str | None) -> list[SheetColumns]:
    sql = _SHEETS.format(summary=table(port, "sheet_summary"),
                         registry=table(port, "sheet_columns"))
    found = []
    for row in await conn.fetch(sql, org_id, play, namespace):
        name = row["table_name"] or table_name(row["org_id"], row["play"], row["table_namespace"])
        present = {column["attname"] for column in await conn.fetch(
            _COLUMNS, f"{quote_ident(port.schema)}.{quote_ident(name)}")}
        if not present:
            continue
        found.append(SheetColumns(
            row["org_id"], row["play"], row["table_namespace"], name,
            tuple(pair for pair in zip(row["fields"], row["columns"]) if pair[1] in present),
            tuple(c for c in READABLE_SYSTEM_COLUMNS if c in present)))
    return found


async def _create_view(conn: Connection, port: Port, sheet: SheetColumns) -> None:
    view = f"{quote_ident(views_schema(port.schema))}.{quote_ident(sheet.view_name)}"
    await conn.execute(f"CREATE VIEW {view} WITH (security_invoker = true) AS\n"
                       f"{sheet_select(port.schema, sheet)}")
    await conn.execute(f"COMMENT ON VIEW {view} IS '{VIEW_COMMENT}'")


async def refresh_view(conn: Connection, port: Port, org_id: str, play: str,
                       namespace: str, *, views_present: bool = False) -> None:
    """Keep one sheet's view in step after a map added a column or created its table: inside
    the caller's (sheet write) transaction, when `<schema>_views` exists, (re)create the view of
    that sheet (`views_present`: the caller has just read that it exists). Best effort, in a
    savepoint: a login that may not create there, or a view
    someone made depend on, leaves the view as it was (`runplane views` recreates them all)."""
    target = views_schema(port.schema)
    if not views_present and not await conn.fetchval(
            "SELECT to_regnamespace($1) IS NOT NULL", target):
        return
    try:
        async with conn.transaction():
            for sheet in await _read_sheets(conn, port, org_id, play, namespace):
                await conn.execute(f"DROP VIEW IF EXISTS {quote_ident(target)}."
                                   f"{quote_ident(sheet.view_name)}")
                await _create_view(conn, port, sheet)
    except DatabaseError as exc:
        log.info("the view of sheet %s/%s/%s was not refreshed (`runplane views` does it): %s",
                 org_id, play, namespace, exc)


_OWNED_VIEWS = """
SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE n.nspname = $1 AND c.relkind = 'v' AND obj_description(c.oid, 'pg_class') = $2
"""


async def sync_views(port: Port) -> list[SheetColumns]:
    """(Re)create every sheet's view in `<schema>_views` and drop the views of sheets that are
    gone, in one transaction; returns the sheets viewed."""
    sheets = await read_sheets(port)
    target = views_schema(port.schema)
    quoted = quote_ident(target)
    async with port.connection(RECEIPTS_LANE) as conn:
        async with conn.transaction():
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
            for row in await conn.fetch(_OWNED_VIEWS, target, VIEW_COMMENT):
                await conn.execute(f"DROP VIEW IF EXISTS {quoted}.{quote_ident(row['relname'])}")
            for sheet in sheets:
                await _create_view(conn, port, sheet)
    return sheets
