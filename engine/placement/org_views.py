"""An org's sheet views on a move: copied to the target with its tables, dropped with its rows.

How it works
- `runplane views` keeps one view per sheet in `<schema>_views`, named "<org>/<play>/<table>"
  (`engine.sheets.views`). `org_views(conn, schema, org)` finds the org's views on a server:
  the names its sheets (`sheet_summary`) give, that exist there and carry the comment
  `runplane views` marks its own views with, with their definitions (`pg_get_viewdef`, whose
  table names are qualified by the schema, which a move keeps).
- `create_statements` recreates them on the target as they were on the source (views schema
  created when missing, `security_invoker = true`, the same comment), so a reader of the views
  finds the moved org's sheets there; a sheet that adds a column later refreshes its own view
  (`views.refresh_view`) as on any server. `drop_statements` drops them, before the sheet
  tables they read are dropped (an interrupted copy's leftovers, `--drop-source`).
- Nothing here runs a statement but reads: the move runs the DDL inside its bounded
  transactions (`fence.bounded`, `fence.remove`).
"""

from __future__ import annotations

from typing import Mapping

from .. import pg
from ..sheets.views import VIEW_COMMENT, identifier, views_schema
from ..sql import qualified, quote_ident

_ORG_SHEETS = "SELECT play, table_namespace FROM {summary} WHERE org_id = $1"

_VIEWS = """
SELECT c.relname, pg_catalog.pg_get_viewdef(c.oid) AS definition
  FROM pg_catalog.pg_class AS c
 WHERE c.relnamespace = to_regnamespace($1) AND c.relkind = 'v' AND c.relname = ANY($2::text[])
   AND pg_catalog.obj_description(c.oid, 'pg_class') = $3
 ORDER BY c.relname
"""


async def org_views(conn: pg.Connection, schema: str, org: str) -> Mapping[str, str]:
    """The org's sheet views on `conn`'s server: view name -> its definition (none when the
    views schema or the runplane schema is missing)."""
    target = views_schema(schema)
    if await conn.fetchval("SELECT to_regnamespace($1)", quote_ident(target)) is None:
        return {}
    summary = qualified(schema, "sheet_summary")
    if await conn.fetchval("SELECT to_regclass($1)", summary) is None:
        return {}
    names = [identifier(f"{org}/{row['play']}/{row['table_namespace']}")
             for row in await conn.fetch(_ORG_SHEETS.format(summary=summary), org)]
    rows = await conn.fetch(_VIEWS, quote_ident(target), names, VIEW_COMMENT)
    return {row["relname"]: row["definition"] for row in rows}


def view_names(schema: str, views: Mapping[str, str]) -> tuple[str, ...]:
    """The views' qualified names (for the move's lock phase)."""
    return tuple(qualified(views_schema(schema), name) for name in sorted(views))


def drop_statements(schema: str, views: Mapping[str, str]) -> list[str]:
    return [f"DROP VIEW IF EXISTS {name}" for name in view_names(schema, views)]


def create_statements(schema: str, views: Mapping[str, str]) -> list[str]:
    """The views created on another server as `org_views` read them (after `drop_statements`
    there: a leftover of an interrupted move is replaced)."""
    if not views:
        return []
    comment = "'" + VIEW_COMMENT.replace("'", "''") + "'"
    target = views_schema(schema)
    statements = [f"CREATE SCHEMA IF NOT EXISTS {quote_ident(target)}"]
    for name, definition in sorted(views.items()):
        view = qualified(target, name)
        statements.append(f"CREATE VIEW {view} WITH (security_invoker = true) AS "
                          f"{definition.rstrip().rstrip(';')}")
        statements.append(f"COMMENT ON VIEW {view} IS {comment}")
    return statements
