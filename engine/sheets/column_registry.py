"""The column registry of sheets: which physical column holds which field, and the DDL.

How it works
- Which column holds which field is decided by the sheet's column registry (`sheet_columns`),
  never by a hash alone: a field's first choice is `layout.column_name(field)`, and when that
  name is already registered to another field (48 bits collide in seconds) the next free
  candidate is allocated (`allocate_columns`). A unique index on (sheet, column name) makes
  the database refuse any sharing.
- Writers learn the mapping of the fields they touch from the statement that takes the sheet
  lock (`sheet_txn`, with `COLUMNS_OF_FIELDS`); a field not registered yet sends the writer
  down the exclusive path, where `prepare_columns` creates the table, its row-order and cause
  indexes, any missing system or field columns, and registers the new fields.
- `resolve_columns` reads the registered columns of some fields (the probe, which takes no
  lock).
Who calls: `sheet_txn` (under the exclusive lock only, for the DDL), the probe.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import Port, sequence_literal, table
from ..sql import quote_ident

from .layout import (
    CAUSE_INDEX_COLUMNS, CAUSE_INDEX_PREDICATE, LATER_SYSTEM_COLUMNS, ORDER_INDEX_COLUMNS,
    SHEET_FILLFACTOR,
    SheetColumns, SheetLayout, column_candidates,
)
from .model import MAX_SHEET_FIELDS, with_row_statuses
from .views import refresh_view, views_schema

# -- DDL (exclusive lock only) ----------------------------------------------------------------
_CREATE_TABLE = with_row_statuses("""
CREATE TABLE IF NOT EXISTS {t} (
    _key text PRIMARY KEY,
    _status text NOT NULL DEFAULT {PENDING},
    _run_id text,
    _write_version bigint NOT NULL,
    _input_index bigint,
    _attempt_id text,
    _attempt_seq integer,
    _attempt_expires_at timestamptz,
    _cell_meta jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    _error text,
    _version bigint NOT NULL DEFAULT nextval({seq}::regclass),
    _created_at timestamptz NOT NULL DEFAULT now(),
    _updated_at timestamptz NOT NULL DEFAULT now(){later}
) WITH (fillfactor = {fillfactor})
""")

_CREATE_ORDER_INDEX = "CREATE INDEX IF NOT EXISTS {name} ON {t} ({columns})"
_CREATE_CAUSE_INDEX = "CREATE INDEX IF NOT EXISTS {name} ON {t} ({columns}) WHERE {predicate}"

# What `prepare_columns` decides its DDL from, in one read: whether the table exists and its
# columns, the fields registered for the sheet (with their columns), whether views are kept.
_PREPARE_READ = """
SELECT to_regclass($4) IS NOT NULL AS table_exists,
       (SELECT coalesce(array_agg(attname::text), '{{}}'::text[]) FROM pg_attribute
         WHERE attrelid = to_regclass($4) AND attnum > 0 AND NOT attisdropped) AS existing,
       ARRAY(SELECT field FROM {registry}
              WHERE org_id = $1 AND play = $2 AND table_namespace = $3 ORDER BY field) AS fields,
       ARRAY(SELECT column_name FROM {registry}
              WHERE org_id = $1 AND play = $2 AND table_namespace = $3 ORDER BY field) AS columns,
       to_regnamespace($5) IS NOT NULL AS views
"""

# No ON CONFLICT: under the exclusive lock nothing else registers, so a conflict is a bug that
# must fail the transaction (the unique index on the column name is the last line of defence).
_REGISTER_FIELDS = """
INSERT INTO {registry} (org_id, play, table_namespace, field, column_name, position)
SELECT $1, $2, $3, u.field, u.column_name,
       (SELECT coalesce(max(position), 0) FROM {registry}
         WHERE org_id = $1 AND play = $2 AND table_namespace = $3) + u.ord
  FROM unnest($4::text[], $5::text[]) WITH ORDINALITY AS u(field, column_name, ord)
"""

# The registered columns of some fields, in their order (NULL for a field not registered);
# `{fields}` is a text[] bind (cast), `{org}` `{play}` `{ns}` text binds.
COLUMNS_OF_FIELDS = """ARRAY(SELECT c.column_name
                  FROM unnest({fields}) WITH ORDINALITY AS u(field, ord)
                  LEFT JOIN {registry} AS c
                         ON c.org_id = {org} AND c.play = {play} AND c.table_namespace = {ns}
                        AND c.field = u.field
                 ORDER BY u.ord)"""


def allocate_columns(
    fields: Iterable[str], registered: Mapping[str, str], existing: set[str]
) -> dict[str, str]:
    """Columns for the `fields` not in `registered` (field -> column), none shared.

    A field takes its first candidate unless another field holds that name; later candidates
    must also be absent from the table (`existing`). The first candidate may already exist
    unregistered: a sheet from before the registry recorded every column, whose column it is.
    """
    taken = set(registered.values())
    out: dict[str, str] = {}
    for field in fields:
        if field in registered or field in out:
            continue
        for n, name in enumerate(column_candidates(field)):
            if name not in taken and (n == 0 or name not in existing):
                break
        out[field] = name
        taken.add(name)
    return out


async def resolve_columns(
    conn: Connection, port: Port, layout: SheetLayout, fields: Iterable[str]
) -> SheetColumns | None:
    """The registered columns of `fields` (one read), or None when one is not registered."""
    fields = list(fields)
    sql = "SELECT " + COLUMNS_OF_FIELDS.format(
        fields="$4::text[]", registry=table(port, "sheet_columns"), org="$1", play="$2", ns="$3")
    names = await conn.fetchval(sql, *layout.counter_args, fields)
    if any(name is None for name in names):
        return None
    return SheetColumns(dict(zip(fields, names)))


async def prepare_columns(
    conn: Connection, port: Port, layout: SheetLayout, fields: Iterable[str]
) -> SheetColumns:
    """Create the sheet table and any missing field columns; register the new fields.

    Runs only on the exclusive path (the sheet's summary row held), inside the caller's
    transaction;
    returns the registered column of every field in `fields`.
    """
    fields = list(dict.fromkeys(fields))
    registry = table(port, "sheet_columns")
    found = await conn.fetchrow(_PREPARE_READ.format(registry=registry),
                                *layout.counter_args, layout.regclass_text,
                                views_schema(port.schema))
    existing = set(found["existing"])
    registered = dict(zip(found["fields"], found["columns"]))
    new = allocate_columns(fields, registered, existing)
    names = {**registered, **new}
    if new and len(names) > MAX_SHEET_FIELDS:
        raise InvalidInputError(
            f"sheet {layout.namespace!r} would have {len(names)} fields; a sheet holds at most "
            f"{MAX_SHEET_FIELDS}")
    adds = [f"{name} {kind}" for name, kind in LATER_SYSTEM_COLUMNS.items()
            if name not in existing]
    adds += [f"{quote_ident(names[f])} jsonb" for f in fields if names[f] not in existing]
    if found["table_exists"]:
        ddl = [f"ALTER TABLE {layout.qualified} "
               + ", ".join(f"ADD COLUMN IF NOT EXISTS {add}" for add in adds)] if adds else []
    else:  # a new sheet: every column in its CREATE, so no ALTER rewrites the catalog after
        later = "".join(f",\n    {add}" for add in adds)
        ddl = [_CREATE_TABLE.format(t=layout.qualified, seq=sequence_literal(port, "row_versions"),
                                    later=later, fillfactor=SHEET_FILLFACTOR)]
    ddl.append(_CREATE_ORDER_INDEX.format(
        name=quote_ident(layout.table + "_ord"), t=layout.qualified, columns=ORDER_INDEX_COLUMNS))
    ddl.append(_CREATE_CAUSE_INDEX.format(  # after `_cause` exists on an older sheet
        name=quote_ident(layout.table + "_err"), t=layout.qualified, columns=CAUSE_INDEX_COLUMNS,
        predicate=CAUSE_INDEX_PREDICATE))
    await conn.execute(";\n".join(ddl))  # no bind values: one round trip for them all
    if new:
        await conn.execute(
            _REGISTER_FIELDS.format(registry=registry),
            *layout.counter_args, list(new), list(new.values()),
        )
    if (new or adds) and found["views"]:  # the sheet's readable view keeps in step
        await refresh_view(conn, port, *layout.counter_args, views_present=True)
    return SheetColumns({f: names[f] for f in fields})
