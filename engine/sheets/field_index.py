"""Indexes of one input field of a sheet: finding a row by an input value.

How it works
- `create_field_index(port, scope, table_namespace, field)` (what `runplane index PLAY TABLE
  FIELD` runs) creates one index on the physical column that holds `field` (the column
  registry's to say, `sheet_columns`). It is a hash index on the `jsonb` column: equality is all
  a search by value needs, a hash entry has no size limit (a btree entry past ~2.7 kB would make
  a later write of a long input value fail), and jsonb equality compares numbers as numbers
  (`1.0` equals `1`). Only input fields are indexed: an output column changes when a row
  completes, and an index on it would turn every completion into a non-HOT update.
- The name is deterministic and at most 63 bytes (`field_index_name`: the sheet's table name,
  cut, then a hash of table and column), so creating it again finds it (idempotent) and readers
  (the console) find it without a registry. It is built `CONCURRENTLY` (writers of the sheet keep
  writing) when the connection is outside a transaction; a checkout that runs inside one (an
  execution role, a transaction pooler) builds it plainly, holding off the sheet's writers for
  the build. A concurrent build that failed leaves an invalid index behind: it is dropped and
  built again.
- `search_values(text)` is what a typed value matches (pure): the JSON string equal to the text,
  and the JSON number when the text is one.
Bad input (an unknown table or field, an output field) raises `InvalidInputError` before any DDL.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math

import attrs

from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import SHEET_LANE, Port
from ..sql import quote_ident
from ..values.scopes import PlayScope, check_scope
from .layout import SheetLayout, foreign_table_error, layout_for
from .reading import registered_fields

MAX_NAME_BYTES = 63
_TABLE_PART = 40  # of the index name; the rest is `_v_` and 12 hex


class IndexBuild(enum.Enum):
    """What `create_field_index` did."""

    CREATED = "created"            # built, without blocking writers (CONCURRENTLY)
    CREATED_LOCKED = "created (writers waited for the build)"  # inside a transaction
    EXISTED = "already there"


@attrs.frozen
class FieldIndex:
    """The index of `field` of a sheet: its name and column, and what creating it did."""

    field: str
    column: str
    name: str
    build: IndexBuild


def field_index_name(sheet: SheetLayout, column: str) -> str:
    """The index name of one column of a sheet (unqualified, at most 63 bytes)."""
    digest = hashlib.sha256(f"{sheet.table}\x00{column}".encode()).hexdigest()[:12]
    return f"{sheet.table[:_TABLE_PART]}_v_{digest}"


def search_values(text: str) -> list[str]:
    """The JSON texts a typed `text` matches: the JSON string `text`, and the number
    it spells when it is a JSON number (`42`, `-3.5`, `1e3`; not `007`, `NaN`)."""
    found = [json.dumps(text)]
    try:
        number = json.loads(text)
    except ValueError:
        return found
    if isinstance(number, (int, float)) and not isinstance(number, bool) and (
            isinstance(number, int) or math.isfinite(number)):
        found.append(json.dumps(number))
    return found


_VALID = """
SELECT i.indisvalid FROM pg_index AS i WHERE i.indexrelid = to_regclass($1)
"""


async def index_state(conn: Connection, sheet: SheetLayout, column: str) -> bool | None:
    """Whether the column's index is there and valid (None: not there; False: a failed build)."""
    name = f"{quote_ident(sheet.schema)}.{quote_ident(field_index_name(sheet, column))}"
    return await conn.fetchval(_VALID, name)


async def input_column(conn: Connection, port: Port, sheet: SheetLayout, field: str) -> str:
    """The physical column of the input `field` (`InvalidInputError` for an unknown table or
    field, or an output field)."""
    info = await conn.fetchrow(registered_fields(port), *sheet.counter_args, sheet.qualified,
                               sheet.table)
    if info["foreign_table"]:
        raise foreign_table_error(sheet)
    if not info["present"]:
        raise InvalidInputError(f"table {sheet.namespace!r} of play {sheet.play!r} has no "
                                "rows yet (run the play first)")
    columns = dict(zip(info["fields"], info["columns"]))
    if field not in columns:
        raise InvalidInputError(f"field {field!r} is not a field of table {sheet.namespace!r} "
                                f"(its fields: {', '.join(sorted(columns)) or 'none'})")
    if field in set(info["outputs"]):
        raise InvalidInputError(f"field {field!r} is an output of table {sheet.namespace!r}: "
                                "only input fields are indexed (an index on an output would "
                                "slow every completion)")
    return columns[field]


async def create_field_index(port: Port, scope: PlayScope, table_namespace: str,
                             field: str) -> FieldIndex:
    """Create (once) the index of the input `field` (see the module docstring)."""
    check_scope(port, scope)
    if not isinstance(field, str) or not field:
        raise InvalidInputError("field must be a non-empty string")
    sheet = layout_for(port, scope, table_namespace)
    async with port.connection(SHEET_LANE) as conn:
        column = await input_column(conn, port, sheet, field)
        name = field_index_name(sheet, column)
        qualified = f"{quote_ident(sheet.schema)}.{quote_ident(name)}"
        state = await index_state(conn, sheet, column)
        if state:
            return FieldIndex(field, column, name, IndexBuild.EXISTED)
        inside = conn.in_transaction
        how = "" if inside else " CONCURRENTLY"
        if state is False:  # a concurrent build that failed: drop it, build again
            await conn.execute(f"DROP INDEX{how} IF EXISTS {qualified}")
        await conn.execute(f"CREATE INDEX{how} IF NOT EXISTS {quote_ident(name)} ON "
                           f"{sheet.qualified} USING hash ({quote_ident(column)})")
    return FieldIndex(field, column, name,
                      IndexBuild.CREATED_LOCKED if inside else IndexBuild.CREATED)
