"""Finding a sheet's rows by an input value: exact match on one input field.

How it works
- A typed value matches a stored JSON value equal to it as text, or as a number when the text
  spells one (`sheets.field_index.search_values`: `42` finds `"42"` and `42`, `007` only `"007"`).
- With the field's index (`runplane index PLAY TABLE FIELD`, `sheets.field_index`; a valid one,
  found by its deterministic name) the matches are one index lookup per candidate value, in row
  order, at most `MATCHES` of them (one more is read to tell there are more).
- Without one, the search is a bounded scan: the first `SCAN_ROWS` rows in row order (a range of
  the row-order index), in one statement under the console's scan timeout. The answer says how
  many rows it looked at and whether that was all of them, so the page can say the search was not
  exact and name the command that makes it so; a scan past its time answers `timed_out`.
- Only input fields are searched (an output is not what finds a row; `InvalidInputError` → the
  route's 400).
"""

from __future__ import annotations

import attrs

from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import Port, table
from ..sheets.field_index import field_index_name, index_state, input_column, search_values
from ..sheets.reading import registered_fields
from ..sql import quote_ident
from .queries import _present, layout, read, scan

MATCHES = 50
SCAN_ROWS = 100_000
MAX_VALUE_CHARS = 2000


@attrs.frozen
class SearchResult:
    """What a search found: the keys of the matching rows in row order (at most `MATCHES`;
    `more`: there are others), whether the field's index answered (`indexed`) and, without it,
    how many rows the scan looked at (`scanned`; `complete`: that was every row) or that it ran
    past its time (`timed_out`)."""

    field: str
    value: str
    keys: list[str]
    more: bool
    indexed: bool
    scanned: int | None = None
    complete: bool = True
    timed_out: bool = False


_BY_INDEX = """
SELECT _key FROM {t} WHERE {matches}
 ORDER BY _input_index ASC NULLS LAST, _created_at ASC, _key ASC LIMIT $1
"""

_BY_SCAN = """
SELECT count(*) AS scanned,
       (array_agg(_key ORDER BY _input_index ASC NULLS LAST, _created_at, _key)
          FILTER (WHERE hit))[1:$1] AS keys
  FROM (SELECT _key, _input_index, _created_at, {matches} AS hit FROM {t}
         ORDER BY _input_index ASC NULLS LAST, _created_at ASC, _key ASC LIMIT $2) AS head
"""


def _matches(column: str, values: list[str], first: int) -> str:
    """`col = $first::jsonb OR …`: one equality per value, binds from `first` on (each a lookup
    of a hash index; a bitmap OR of them)."""
    col = quote_ident(column)
    return "(" + " OR ".join(f"{col} = ${first + i}::jsonb" for i in range(len(values))) + ")"


async def find_rows(port: Port, org: str, play: str, namespace: str, field: str,
                    value: str) -> SearchResult | None:
    """The rows whose input `field` equals `value` (see the module docstring); None when the
    sheet has no table."""
    if not field or len(value) > MAX_VALUE_CHARS:
        raise InvalidInputError("a search needs a field and a value of at most "
                                f"{MAX_VALUE_CHARS} characters")
    sheet = layout(port, org, play, namespace)
    values = search_values(value)

    async def op(conn: Connection) -> SearchResult | None:
        if not await _present(conn, port, sheet):
            return None
        column = await input_column(conn, port, sheet, field)
        if await index_state(conn, sheet, column):
            records = await conn.fetch(_BY_INDEX.format(
                t=sheet.qualified, matches=_matches(column, values, 2)), MATCHES + 1, *values)
            keys = [r["_key"] for r in records]
            return SearchResult(field, value, keys[:MATCHES], len(keys) > MATCHES, True)
        found = await scan(conn, _BY_SCAN.format(
            t=sheet.qualified, matches=_matches(column, values, 3)),
                           MATCHES + 1, SCAN_ROWS, *values)
        if found is None:
            return SearchResult(field, value, [], False, False, None, False, timed_out=True)
        scanned, keys = found[0]["scanned"], list(found[0]["keys"] or [])
        return SearchResult(field, value, keys[:MATCHES], len(keys) > MATCHES, False, scanned,
                            scanned < SCAN_ROWS)

    return await read(port, op)


def input_fields(fields: list[str], outputs: set[str]) -> list[str]:
    """The fields a search may name: the inputs, in the sheet's order."""
    return [f for f in fields if f not in outputs]


async def sheet_inputs(port: Port, org: str, play: str, namespace: str) -> list[str]:
    """The sheet's input fields, in its order (one read of its registry)."""
    sheet = layout(port, org, play, namespace)

    async def op(conn: Connection) -> list[str]:
        info = await conn.fetchrow(registered_fields(port), *sheet.counter_args,
                                   sheet.qualified, sheet.table)
        return input_fields(list(info["fields"]), set(info["outputs"]))

    return await read(port, op)


_COLUMNS = """
SELECT field, column_name FROM {registry}
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3 AND field = ANY($4::text[])
"""
_VALID_INDEXES = """
SELECT coalesce(array_agg(n.name), '{}') FROM unnest($1::text[]) AS n(name)
 WHERE EXISTS (SELECT 1 FROM pg_index AS i WHERE i.indexrelid = to_regclass(n.name)
                  AND i.indisvalid)
"""


async def indexed_fields(port: Port, org: str, play: str, namespace: str,
                         fields: list[str]) -> set[str]:
    """Those of `fields` with a valid index (`runplane index`), in one read."""
    if not fields:
        return set()
    sheet = layout(port, org, play, namespace)
    sql = _COLUMNS.format(registry=table(port, "sheet_columns"))

    async def op(conn: Connection) -> set[str]:
        named = {f"{quote_ident(sheet.schema)}.{quote_ident(field_index_name(sheet, r['column_name']))}":
                 r["field"] for r in await conn.fetch(sql, *sheet.counter_args, fields)}
        valid = await conn.fetchval(_VALID_INDEXES, list(named))
        return {named[name] for name in valid}

    return await read(port, op)
