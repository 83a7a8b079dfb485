"""An org's rows copied from one server to another: COPY, then counts and digests compared.

How it works
- `plan(source, schema, org)` lists what to copy (`TableCopy`): the rows of the org in every
  table keyed by `org_id` (but `session_scopes`: database sessions are roles of one server and
  are minted again on the target), its receipts (`work_receipts` by key prefix) and its own
  sheet tables whole. Columns are named from the source, so a target whose columns were added
  in another order still lines up.
- `prepare_target` bootstraps the schema on the target, lifts any fence of the org there, and
  clears what an earlier, interrupted copy left (the org's rows and sheet tables), then creates
  the org's sheet tables as the source's catalog describes them (columns, defaults,
  constraints, indexes, storage options).
- `copy_rows` streams each table with binary COPY (`engine.pg.transfer`) inside one target
  transaction: all of the org's rows arrive or none. `copy_verified` compares, per table, the
  row count and an order-free digest (the sum of the first 60 bits of each row's md5) on both
  servers (`ConflictError` naming the first table that differs); it reads the source's digests
  on a second connection while the copy streams (the source is fenced: they cannot change), so
  the fence lasts the copy and the target's digests, not the source's as well. `advance_sequences` moves every
  sequence of the target's schema past the source's (run epochs stay increasing for the org).
- `copy_views` recreates the org's sheet views (`runplane views`) on the target
  (`org_views`); `drop_org` drops them first.
- `drop_org(conn, schema, org)`: the org's rows, views and sheet tables deleted from a server,
  and its fence there lifted, in one transaction (`--drop-source`).
"""

from __future__ import annotations

import time
from typing import Sequence

import attrs
import trio

from .. import pg, schema as schema_ddl
from ..errors import ConflictError
from ..pg.transfer import copy_between
from ..sql import qualified, quote_ident
from . import fence, org_views

_COLUMNS = """
SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,
       pg_catalog.pg_get_expr(d.adbin, d.adrelid) AS dflt
  FROM pg_catalog.pg_attribute AS a
  LEFT JOIN pg_catalog.pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum
"""
_CONSTRAINTS = """SELECT conname, pg_catalog.pg_get_constraintdef(oid) AS def
  FROM pg_catalog.pg_constraint WHERE conrelid = $1::regclass ORDER BY conname"""
_INDEXES = """SELECT pg_catalog.pg_get_indexdef(i.indexrelid) AS def FROM pg_catalog.pg_index AS i
 WHERE i.indrelid = $1::regclass
   AND i.indexrelid NOT IN (SELECT conindid FROM pg_catalog.pg_constraint
                             WHERE conrelid = $1::regclass)"""
_SEQUENCES = """SELECT relname FROM pg_catalog.pg_class
 WHERE relnamespace = $1::regnamespace AND relkind = 'S' ORDER BY relname"""


@attrs.frozen
class TableCopy:
    """One table's share of an org: its columns (source order) and the rows' filter."""

    schema: str
    name: str
    columns: tuple[str, ...]
    where: str = "true"
    args: tuple[object, ...] = ()
    sheet: bool = False

    def select(self) -> str:
        cols = ", ".join(quote_ident(c) for c in self.columns)
        return f"SELECT {cols} FROM {qualified(self.schema, self.name)} WHERE {self.where}"

    def digest(self) -> str:
        cols = ", ".join(quote_ident(c) for c in self.columns)
        return (f"SELECT count(*) AS n, coalesce(sum(('x' || substr(md5(ROW({cols})::text), 1, "
                f"15))::bit(60)::bigint), 0) AS d FROM {qualified(self.schema, self.name)}"
                f" WHERE {self.where}")


async def _columns(conn: pg.Connection, schema: str, name: str) -> tuple[str, ...]:
    rows = await conn.fetch(_COLUMNS, qualified(schema, name))
    return tuple(row["attname"] for row in rows)


async def plan(source: pg.Connection, schema: str, org: str) -> list[TableCopy]:
    """What of `org` to copy from `source` (see the module docstring)."""
    tables = await fence.org_tables(source, schema, org)
    copies = [TableCopy(schema, name, await _columns(source, schema, name), "org_id = $1",
                        (org,)) for name in tables.shared if name not in fence.NOT_COPIED]
    prefix = fence.receipt_prefix(org)
    copies.append(TableCopy(schema, fence.RECEIPTS_TABLE,
                            await _columns(source, schema, fence.RECEIPTS_TABLE),
                            "k >= $1 AND k < $2", (prefix, prefix + b"\xff")))
    copies += [TableCopy(schema, name, await _columns(source, schema, name), sheet=True)
               for name in tables.sheets]
    return copies


async def table_ddl(source: pg.Connection, schema: str, name: str) -> list[str]:
    """CREATE TABLE and CREATE INDEX statements for `name` as the source's catalog has it."""
    t = qualified(schema, name)
    parts = []
    for row in await source.fetch(_COLUMNS, t):
        part = f"{quote_ident(row['attname'])} {row['type']}"
        if row["dflt"] is not None:
            part += f" DEFAULT {row['dflt']}"
        parts.append(part + (" NOT NULL" if row["attnotnull"] else ""))
    parts += [f"CONSTRAINT {quote_ident(row['conname'])} {row['def']}"
              for row in await source.fetch(_CONSTRAINTS, t)]
    options = await source.fetchval(
        "SELECT reloptions FROM pg_catalog.pg_class WHERE oid = $1::regclass", t)
    with_options = f" WITH ({', '.join(options)})" if options else ""
    statements = [f"CREATE TABLE {t} ({', '.join(parts)}){with_options}"]
    return statements + [row["def"] for row in await source.fetch(_INDEXES, t)]


async def drop_org(conn: pg.Connection, schema: str, org: str,
                   also: Sequence[str] = ()) -> None:
    """Delete `org`'s rows and sheet tables (and the tables named in `also`, if they exist)
    from `schema` on `conn`'s server, its fence there lifted."""
    tables = await fence.org_tables(conn, schema, org)
    if not tables.shared:
        return  # no runplane schema there: nothing of the org
    present = await conn.fetch(
        "SELECT t FROM unnest($1::text[]) AS t WHERE to_regclass($2 || '.' || quote_ident(t))"
        " IS NOT NULL", list(also), quote_ident(schema))
    dropping = tuple(sorted(set(tables.sheets) | {row["t"] for row in present}))
    prefix = fence.receipt_prefix(org)
    deletes = [f"DELETE FROM {qualified(schema, name)} WHERE org_id = {fence.literal(org)}"
               for name in tables.shared if name not in fence.NOT_COPIED]
    low, high = prefix.hex(), (prefix + b"\xff").hex()
    deletes.append(f"DELETE FROM {qualified(schema, fence.RECEIPTS_TABLE)}"
                   f" WHERE k >= '\\x{low}'::bytea AND k < '\\x{high}'::bytea")
    views = org_views.view_names(schema, await org_views.org_views(conn, schema, org))
    await fence.remove(conn, schema, org, dropping=dropping, then=deletes, views=views)


async def prepare_target(source: pg.Connection, target: pg.Connection,
                         copies: Sequence[TableCopy], org: str) -> None:
    """The target's schema ready for the org's rows (see the module docstring)."""
    schema = copies[0].schema
    sheets = [copy.name for copy in copies if copy.sheet]
    await schema_ddl.bootstrap(target, schema)
    await drop_org(target, schema, org, also=sheets)  # an interrupted move's leftovers too
    ddl = [statement for name in sheets for statement in await table_ddl(source, schema, name)]
    if ddl:  # new tables: nothing else holds them
        await fence.bounded(target, ddl, fence.Locks())


async def copy_views(source: pg.Connection, target: pg.Connection, schema: str,
                     org: str) -> int:
    """The org's sheet views recreated on the target as the source has them
    (`org_views`); how many."""
    views = await org_views.org_views(source, schema, org)
    if views:
        await fence.bounded(target, org_views.create_statements(schema, views), fence.Locks())
    return len(views)


async def copy_rows(source: pg.Connection, target: pg.Connection,
                    copies: Sequence[TableCopy]) -> float:
    """Every table's rows streamed from source to target in one target transaction; returns
    the seconds it took."""
    started = time.perf_counter()
    async with target.transaction():
        for copy in copies:
            await copy_between(source, target, copy.select(), copy.args,
                               (copy.schema, copy.name), copy.columns)
    return time.perf_counter() - started


Digest = tuple[int, int]  # a table's row count and order-free digest


async def digests(conn: pg.Connection, copies: Sequence[TableCopy]) -> list[Digest]:
    """Each table's count and digest on `conn`'s server, in `copies`' order."""
    found = []
    for copy in copies:
        row = await conn.fetchrow(copy.digest(), *copy.args)
        found.append((row["n"], row["d"]))
    return found


def compare(copies: Sequence[TableCopy], mine: Sequence[Digest],
            theirs: Sequence[Digest]) -> dict[str, int]:
    """Row counts by table when both servers' counts and digests agree, else ConflictError
    naming the first table that differs."""
    for copy, (n, d), (their_n, their_d) in zip(copies, mine, theirs, strict=True):
        if (n, d) != (their_n, their_d):
            raise ConflictError(
                f"the copy of {copy.name} differs: {n} rows on the source, {their_n} on the "
                "target (or their digests differ)")
    return {copy.name: n for copy, (n, _) in zip(copies, mine)}


async def copy_verified(source: pg.Connection, reader: pg.Connection, target: pg.Connection,
                        copies: Sequence[TableCopy]) -> tuple[dict[str, int], float]:
    """`copy_rows`, with the source's digests read meanwhile on `reader` (a second connection
    to the fenced source: what it reads cannot change), then the target's compared with them;
    returns the rows by table and the copy's seconds."""
    mine: list[Digest] = []

    async def read_source() -> None:
        mine.extend(await digests(reader, copies))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_source)
        copy_s = await copy_rows(source, target, copies)
    return compare(copies, mine, await digests(target, copies)), copy_s


async def advance_sequences(source: pg.Connection, target: pg.Connection, schema: str) -> None:
    """Every sequence of the target's `schema` at least where the source's is."""
    for row in await source.fetch(_SEQUENCES, quote_ident(schema)):
        seq = qualified(schema, row["relname"])
        last = await source.fetchval(f"SELECT last_value FROM {seq}")
        await target.execute(
            f"SELECT setval($1::regclass, greatest($2::bigint,"
            f" (SELECT last_value FROM {seq})), true)", seq, last)
