"""Recorded lists: an unchanged rerun of a list, answered in one statement.

How it works
- Every sheet write transaction adds one to its sheet's `sheet_summary.writes` as it claims the
  summary row (`sheet_txn`); the writers of a shared map add counter deltas instead, which stay
  until an ordinary writer (which adds one) folds them. So while `writes` holds one value and
  the sheet has no deltas, no row of the sheet has changed.
- A map of a list that ends with every row of the list a cache hit for it (the rows it
  completed plus the rows it found cached; nothing failed, blocked, fenced or repeated) records
  the list (`record_list`, one statement): the list's digest (`list_digest`), its rows' keys
  (16-byte digests) and the sheet's `writes`, provided that in that statement's snapshot every
  key is a cache hit (the probe's own predicate, `dispositions.cached_predicate`) and the
  sheet has no deltas. The same statement deletes the sheet's records of another `writes`
  (stale: the sheet changed since).
- A later map of the same list (`replay_list`) is answered by one statement when a record of its
  digest holds the sheet's current `writes`, the sheet has no deltas and the map has staged
  nothing (a wake of a map that began staging resumes its staging instead): every row is still a
  cache hit, so the statement records the run's membership (`sheet_reuse`, from the recorded
  key digests) and returns the row count, and the map reports every row cached without keying
  or probing one. That statement commits asynchronously (`synchronous_commit` off for it: no
  wait for the WAL flush). A server crash can lose it only before a later synchronous commit
  (the WAL is written in order, and the run's retirement commits synchronously): the run is then
  not finished, and its wake maps the list again. Anything else (no record, a write since) takes the ordinary path, which
  records the list again when it ends with every row a cache hit.
- The digest is SHA-256 over the namespace, the contract and the rows, pickled (protocol 5) in
  the pickler's fast mode, which keeps no memo: no back-references, so equal lists of core
  types give equal bytes whatever else holds their objects. A list holding anything else (an
  `Occurrence`, a datetime, a dict subclass: the pickler refuses whatever it would have to
  reduce) has none and takes the ordinary path; two lists that differ in a value, a type or
  the order of a row's keys have different digests (an unchanged list rebuilt in another key
  order misses, never the reverse). With a memo (pickle's default, or `marshal` from format 3)
  an object something else also holds is written as a back-reference, so the bytes change
  with what the caller keeps (a function that keeps the rows it was handed made every rerun
  miss, `tests/test_list_replay.py`). Against `marshal` format 2 (no back-references; used
  before) it takes 0.68–0.74 of the time (`benchmarks/list_digest.py`, 10,000 and 100,000
  rows); a list recorded under a `marshal` digest is not found, and the rerun that misses it
  records it again. Pickle documents `fast` as deprecated: the digest tests (equal values
  shared or not give one digest; a cycle gives none) fail if it stops turning the memo off.
- Only plain maps on a direct port use it (`recordable`): no `force`, no cell policies (their
  freshness depends on the clock), not a gateway or a database session (which has no grant on
  `sheet_lists`), at most `MAX_RECORDED_ROWS` rows (recording checks every key once).
- A map that proves every row of its list a hit itself (`write_ledger`: nobody else wrote the
  sheet since its first write, and every outcome gave its outputs values) records with
  `proven_writes`: the statement checks no key, only that the sheet's `writes` is still the
  map's last (`actors.list_replay`). Otherwise:
- Recording checks the keys as one `_key = ANY(array)` index scan (keys are distinct, `_key`
  is the primary key): PostgreSQL sorts the array and walks the index once in key order, ~2 µs
  a key against ~4.5 µs for a lookup per key (100,000 keys into a 100,000- or 1,000,000-row
  sheet). The array is built in the statement, so the planner sees no row count to prefer a
  scan of the sheet (a hash join is faster when the list is most of the sheet, and ten times
  slower for 10,000 keys of 1,000,000 rows).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Sequence

from ..actions import routes_remote
from ..array_input import facts
from ..ports import Port, table, with_connection
from ..values.scopes import MapScope

from .dispositions import cached_predicate, output_binds
from .column_registry import COLUMNS_OF_FIELDS
from .counters import has_deltas
from .layout import LANE, SheetColumns, column_name, layout_for
from .reuse import split_keys
from .sheet_txn import run_sheet_transaction
from .sheet_write import SheetWrite
from .statements import BindParams, Statement

MAX_RECORDED_ROWS = 100_000
DIGEST_PROTOCOL = 5  # pickled in fast mode: no memo, so the bytes depend on the values only


class _CorePickler(pickle.Pickler):
    """Pickles None, booleans, exact ints, floats, strings, bytes, lists, tuples, dicts and sets
    only (what the C pickler writes itself); anything it would reduce is refused."""

    def reducer_override(self, obj: object) -> object:
        raise ValueError(f"not a core type: {type(obj).__name__}")


def _never_recorded(port: Port, write: SheetWrite, rows: int) -> bool:
    """`recordable` through a remote port: never (a rerun through a gateway probes)."""
    return False


@routes_remote(_never_recorded)
def recordable(port: Port, write: SheetWrite, rows: int) -> bool:
    """Whether a list map of `rows` rows with `write` may be replayed and recorded (on a
    direct port only: the action layer answers False for a remote one)."""
    return (0 < rows <= MAX_RECORDED_ROWS and not write.force and not write.cell_policies
            and not port.settings.sheet_lock_keys)


def list_digest(write: SheetWrite, rows: Sequence[object]) -> bytes | None:
    """The digest of a list of rows mapped with `write` (see the module docstring), or None
    when a value is not of a core type (the pickler refuses it), or nests too deep (or in a
    cycle); a row that is not a dict never matches a record, as the ordinary path that
    records lists refuses it."""
    contract = write.contract
    buffer = io.BytesIO()
    pickler = _CorePickler(buffer, DIGEST_PROTOCOL)
    pickler.fast = True  # no memo: no back-references
    try:
        pickler.dump((write.table_namespace, contract.inputs, contract.outputs, rows))
    except (ValueError, RecursionError, pickle.PicklingError):
        return None
    return hashlib.sha256(buffer.getbuffer()).digest()


# $1 org, $2 play, $3 namespace, $4 list digest, $5 run id, $6 epoch, $7 the keys of the map's
# begin and seal facts (`engine.array_input.facts`)
_REPLAY = """
WITH hit AS (
    SELECT l.row_count, l.digests
      FROM {lists} AS l
      JOIN {summary} AS s
        ON s.org_id = l.org_id AND s.play = l.play AND s.table_namespace = l.table_namespace
     WHERE l.org_id = $1 AND l.play = $2 AND l.table_namespace = $3 AND l.digest = $4
       AND s.writes = l.writes AND NOT {deltas}
       AND NOT EXISTS (SELECT 1 FROM {facts} AS f WHERE f.k = ANY($7::bytea[]))
), membership AS (
    INSERT INTO {reuse} (org_id, play, table_namespace, run_id, epoch, digests, keys)
    SELECT $1, $2, $3, $5, $6, h.digests, NULL FROM hit AS h
    RETURNING 1
)
SELECT h.row_count, set_config('synchronous_commit', 'off', true) FROM hit AS h
"""


async def replay_list(port: Port, write: SheetWrite, digest: bytes, scope: MapScope
                      ) -> int | None:
    """If the list of `digest` is recorded, the sheet has not changed since and nothing of the
    map `scope` is staged (no begin or seal fact: a wake that began staging resumes it), record
    the run's membership of its rows and return how many there are (one statement, committed
    asynchronously: see the module docstring); else None."""
    write.check_port(port)
    run = write.run
    sql = _REPLAY.format(lists=table(port, "sheet_lists"), summary=table(port, "sheet_summary"),
                         reuse=table(port, "sheet_reuse"), facts=table(port, "work_receipts"),
                         deltas=has_deltas(port, "$1::text", "$2::text", "$3::text"))
    staged = [facts.begin_key(scope), facts.seal_key(scope)]
    return await with_connection(port, LANE, lambda conn: conn.fetchval(
        sql, run.scope.org_id, run.scope.play, write.table_namespace, digest, run.scope.run_id,
        run.epoch, staged))


def record_statement(port: Port, write: SheetWrite, digest: bytes, key_digests: bytes,
                     proven_writes: int | None = None) -> Statement:
    """The statement recording a list (see the module docstring): `key_digests` its rows' keys
    as 16-byte digests, distinct, in any order. Returns a row when it recorded. With
    `proven_writes` (the sheet's `writes` after the map's last write, nobody else having
    written it since the map's first: `write_ledger`) it checks no key: it records only if
    the sheet's `writes` is still that value (and it has no deltas)."""
    layout = layout_for(port, write.run.scope.play_scope, write.table_namespace)
    columns = SheetColumns({f: column_name(f) for f in write.contract.outputs})
    binds = BindParams()
    org, play, ns = (binds.add(value, "text") for value in layout.counter_args)
    list_digest = binds.add(digest, "bytea")
    digests = binds.add(key_digests, "bytea")
    count = binds.add(len(key_digests) // 16, "integer")
    registered = COLUMNS_OF_FIELDS.format(
        fields=binds.add(list(write.contract.outputs), "text[]"),
        registry=table(port, "sheet_columns"), org=org, play=play, ns=ns)
    expected = binds.add([columns.names[f] for f in write.contract.outputs], "text[]")
    lists = table(port, "sheet_lists")
    if proven_writes is None:
        outputs = output_binds(write.contract, {}, binds, columns)
        hits = f"""SELECT count(*) AS n
      FROM {layout.qualified} AS s
     WHERE s._key = ANY(ARRAY(SELECT encode(substring({digests} FROM i * 16 + 1 FOR 16), 'hex')
                                FROM generate_series(0, length({digests}) / 16 - 1) AS i))
       AND {cached_predicate("s", outputs)}"""
        unchanged = "true"
    else:
        hits = f"SELECT {count} AS n"  # proven: every row is as the map left it
        unchanged = f"s.writes = {binds.add(proven_writes, 'bigint')}"
    return binds.statement(f"""
WITH sheet AS (
    SELECT s.writes FROM {table(port, "sheet_summary")} AS s
     WHERE s.org_id = {org} AND s.play = {play} AND s.table_namespace = {ns}
       AND NOT {has_deltas(port, org, play, ns)} AND {registered} = {expected} AND {unchanged}
), hits AS (
    {hits}
), stale AS (
    DELETE FROM {lists} AS l USING sheet
     WHERE l.org_id = {org} AND l.play = {play} AND l.table_namespace = {ns}
       AND l.writes <> sheet.writes AND l.digest <> {list_digest}
)
INSERT INTO {lists} (org_id, play, table_namespace, digest, writes, row_count, digests)
SELECT {org}, {play}, {ns}, {list_digest}, sheet.writes, {count}, {digests}
  FROM sheet, hits
 WHERE hits.n = {count}
ON CONFLICT (org_id, play, table_namespace, digest) DO UPDATE
   SET writes = EXCLUDED.writes, row_count = EXCLUDED.row_count, digests = EXCLUDED.digests,
       created_at = now()
RETURNING 1
""")


async def record_list(port: Port, write: SheetWrite, digest: bytes, keys: Sequence[str],
                      proven_writes: int | None = None) -> bool:
    """Record the list of `digest` whose rows have `keys` (distinct) if every row is a cache
    hit now (one statement; with `proven_writes`, if the sheet is unchanged since the map that
    proved every row a hit: `record_statement`); returns whether it was recorded (never for
    keys that are not row-key digests: 32 hexadecimal digits)."""
    write.check_port(port)
    key_digests, other_keys = split_keys(keys)
    if key_digests is None or other_keys is not None:
        return False
    statement = record_statement(port, write, digest, key_digests, proven_writes)
    return await with_connection(port, LANE, lambda conn: conn.fetchval(
        statement.sql, *statement.args)) is not None


FOLD_TIMEOUT_MS = 30_000


async def fold_deltas(port: Port, write: SheetWrite) -> None:
    """One ordinary sheet transaction of `write`'s sheet that writes nothing: its lock folds
    the counter deltas it finds (`counters`), and it adds one to `writes`. A list map whose
    write group left deltas (`write_group`) runs it before it records the list, whose statement
    wants none; run inside the map's ledger (`write_ledger.keeping`), it extends the proof."""
    write.check_port(port)
    layout = layout_for(port, write.run.scope.play_scope, write.table_namespace)

    async def nothing(_conn, _sheet) -> None:
        return None

    await run_sheet_transaction(port, layout, (), nothing, timeout_ms=FOLD_TIMEOUT_MS)
