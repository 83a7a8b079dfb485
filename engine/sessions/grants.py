"""What a database session is granted, by operation: the GRANT statements `engine.sessions.mint`
runs for a new session role (no I/O here). Row-level security (`engine.sessions.isolation`)
then keeps the shared tables' rows to the session's own scope.

Operations and what they grant (plus USAGE on the schema and SELECT on `meta` and on its own
`session_scopes` row, which `open_tenant` and the policies read):
    rows.read     SELECT on the sheet, its counters, its column registry rows and its reuse
                  membership (`sheet_reuse`: which rows each run reused, for reads by run)
    rows.upsert   SELECT, INSERT, UPDATE on the sheet and its counters (its deltas among them:
                  a map's own writes overlap, `engine.sheets.write_group`); SELECT on the
                  columns of `shared_maps` that say whether a shared map of the sheet is live;
                  the row-version sequence
    rows.append   the same (an append is an admission of new rows)
    rows.replace  the same, plus TRUNCATE on its own sheet table (a replacement empties it)
    receipts      SELECT, INSERT, UPDATE on the play's user receipts
    array_input   SELECT, INSERT, UPDATE on the play's array-input facts (retiring them, which
                  deletes, goes over the gateway)
On the tables every org shares these are column privileges (naming every column): they allow
the same statements, but LOCK TABLE needs a privilege on the table itself, so a session can
never lock a shared table. No DELETE anywhere.
"""

from __future__ import annotations

from typing import Iterable

from .isolation import SCOPES_TABLE
from ..sql import qualified, quote_ident

OPERATIONS = ("rows.read", "rows.upsert", "rows.append", "rows.replace", "receipts", "array_input")
WRITE_OPERATIONS = frozenset({"rows.upsert", "rows.append", "rows.replace"})
ROW_OPERATIONS = frozenset({"rows.read"}) | WRITE_OPERATIONS
SHARED_TABLES = ("meta", SCOPES_TABLE, "work_receipts", "sheet_summary", "sheet_column_summary",
                 "sheet_columns", "sheet_reuse", "sheet_counter_deltas", "sheet_column_deltas")

# What a write group's turn reads of `shared_maps` (`engine.sheets.sheet_txn`).
SHARED_MAP_COLUMNS = "org_id, play, table_namespace, state"

# The columns of the shared tables, for column privileges ($1 schema, $2 table names).
COLUMNS = """
SELECT c.relname::text AS table_name, array_agg(a.attname::text ORDER BY a.attnum) AS columns
  FROM pg_catalog.pg_attribute a
  JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = $1 AND c.relname = ANY($2::text[]) AND a.attnum > 0 AND NOT a.attisdropped
 GROUP BY c.relname
"""


def grants(schema: str, operations: Iterable[str], sheet_table: str | None, role: str,
           columns: dict[str, list[str]]) -> list[str]:
    """The GRANT statements of a session role with `operations` (see the module docstring);
    `columns` are the shared tables' columns (`COLUMNS`)."""
    r = quote_ident(role)
    t = lambda name: qualified(schema, name)  # noqa: E731

    def on(privileges: str, name: str) -> str:
        cols = "(" + ", ".join(quote_ident(c) for c in columns[name]) + ")"
        listed = ", ".join(f"{p} {cols}" for p in privileges.split(", "))
        return f"GRANT {listed} ON {t(name)} TO {r}"

    out = [f"GRANT USAGE ON SCHEMA {quote_ident(schema)} TO {r}",
           on("SELECT", "meta"), on("SELECT", SCOPES_TABLE)]
    ops = set(operations)
    if ops & WRITE_OPERATIONS:
        sheet = "SELECT, INSERT, UPDATE, TRUNCATE" if "rows.replace" in ops else "SELECT, INSERT, UPDATE"
        out += [
            f"GRANT {sheet} ON {t(sheet_table)} TO {r}",
            on("SELECT, INSERT, UPDATE", "sheet_summary"),
            on("SELECT, INSERT, UPDATE", "sheet_column_summary"),
            on("SELECT", "sheet_columns"),
            # counter deltas: added by the map's write group, folded by zeroing (no DELETE,
            # which would let a session LOCK the table: `engine.sheets.counters`)
            on("SELECT, INSERT, UPDATE", "sheet_counter_deltas"),
            on("SELECT, INSERT, UPDATE", "sheet_column_deltas"),
            # whether a shared map of its sheet is live (a write group's turn asks)
            f"GRANT SELECT ({SHARED_MAP_COLUMNS}) ON {t('shared_maps')} TO {r}",
            f"GRANT USAGE ON SEQUENCE {t('row_versions')} TO {r}",
        ]
    elif "rows.read" in ops:
        out += [f"GRANT SELECT ON {t(sheet_table)} TO {r}", on("SELECT", "sheet_summary"),
                on("SELECT", "sheet_column_summary"), on("SELECT", "sheet_columns"),
                on("SELECT", "sheet_counter_deltas"), on("SELECT", "sheet_column_deltas")]
    if "rows.read" in ops:
        out.append(on("SELECT", "sheet_reuse"))
    if ops & {"receipts", "array_input"}:
        out.append(on("SELECT, INSERT, UPDATE", "work_receipts"))
    return out
