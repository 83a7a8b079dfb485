"""Physical layout of sheets: where a sheet lives and what its columns are called.

How it works
- A sheet is one table per (org, play, normalized table namespace) in the tenant schema, named
  `sheet_<namespace prefix>_<hash>` (`table_name`); each field is one `jsonb` column. Physical
  names are at most 63 bytes and never collide with the system columns (which start with `_`).
- A field's first-choice column is `f_<readable prefix>_<12 hex of its hash>`
  (`column_name`); which candidate a field holds is the column registry's to say
  (`column_registry`), never this module's.
- Table names are unique too: `sheet_summary.table_name` is unique, filled by the lock
  statement (`sheet_txn`), so two (org, play, namespace) whose table names collide are refused
  with `ConflictError` (they would otherwise share one table); readers check the owner too
  (`FOREIGN_TABLE`, `table_present`).
- Tables leave 65% of each page free (`SHEET_FILLFACTOR`) so that a completion's new version
  of every row fits on the row's own page: a HOT update, which touches no index and no other
  page. Besides the primary key a sheet has an index on its row order
  (`ORDER_INDEX_COLUMNS`) and a partial one of failed rows by cause (`CAUSE_INDEX_COLUMNS`),
  neither holding a column that a completed row's update changes. System columns added in later releases (`LATER_SYSTEM_COLUMNS`) are
  added to an older sheet under the exclusive lock the first time a writer needs them.
- `sheet_lock_key` is a secret-derived key recorded with a database session's scope; it marks a
  session's own sheet (`PortSettings.sheet_lock_keys`) and locks nothing (the sheet lock is its summary
  row, `sheet_txn`).
Related modules: `column_registry` (allocating and registering columns, the DDL),
`sheet_txn` (the write transaction and its lock protocol), `telemetry` (per-phase timings),
`ensure` (`ensure_sheet`).
This module does no I/O but the two reads of a sheet's table (`table_present`,
`existing_columns`).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from typing import Iterator, Mapping

import attrs

from ..errors import ConflictError
from ..pg import Connection
from ..ports import SHEET_LANE, Port, table
from ..lock_keys import derive_lock_key
from ..values.scopes import PlayScope, normalize_namespace
from ..sql import quote_ident


LANE = SHEET_LANE  # the lane of every sheet checkout
MAX_NAME_PREFIX = 36
_JUNK = re.compile(r"[^a-z0-9_]+")

SYSTEM_COLUMNS = (
    "_key", "_status", "_run_id", "_write_version", "_input_index", "_attempt_id",
    "_attempt_seq", "_attempt_expires_at", "_cell_meta", "_error", "_version", "_created_at",
    "_updated_at", "_attempts", "_failed_runs", "_failed_epoch",
)

# A completed row holds its outputs and their cell meta (about 100 bytes a field) beside its
# inputs: 1.5-3x the row admission wrote. At fillfactor 70 a page had room for a quarter of its
# rows' completed versions; the rest moved to other pages, each adding an entry to every index.
# At 35 every completion was HOT in two shapes measured (100,000 rows of two inputs and one
# output: the table 65 MB either way, its indexes 15 MB not 25; 20,000 rows of three inputs
# and three outputs: the table 27 MB not 25, its indexes 3 MB not 5). Rows with wide inputs
# and small outputs leave pages emptier than they need.
SHEET_FILLFACTOR = 35

# System columns added after the first release, with their definitions: a sheet created before
# them gets them (under the exclusive lock) the first time a writer or `ensure_sheet` needs them.
LATER_SYSTEM_COLUMNS = {
    "_attempts": "bigint NOT NULL DEFAULT 0",     # calls of the map function, across runs
    "_failed_runs": "integer NOT NULL DEFAULT 0",  # runs in which the row failed (give-up)
    "_failed_epoch": "bigint",                     # the last run counted in `_failed_runs`
    "_cause": "text",                              # a failed row's cause (`sheets.causes`)
}


def _hash(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()


def _readable(text: str) -> str:
    return _JUNK.sub("_", text.lower()).strip("_")[:MAX_NAME_PREFIX].strip("_")


def table_name(org_id: str, play: str, namespace: str) -> str:
    """The sheet table of (org, play, normalized namespace): `sheet_<ns>_<hash>`."""
    return f"sheet_{_readable(namespace) or 'x'}_{_hash(org_id, play, namespace)[:16]}"


def column_name(field: str, n: int = 0) -> str:
    """The `n`-th candidate physical column of a field: `f_<readable>_<hash>` (never a system
    column). Candidate 0 is the first choice; which candidate a field holds is the registry's
    to say (`prepare_columns`), never this function's."""
    readable = _readable(field)
    digest = _hash(field)[:12] if n == 0 else _hash(field, str(n))[:12]
    return f"f_{readable}_{digest}" if readable else f"f_{digest}"


def column_candidates(field: str) -> Iterator[str]:
    """The physical names a field may take, in order of preference."""
    return (column_name(field, n) for n in itertools.count())


@attrs.frozen
class SheetLayout:
    """Where one sheet lives: its table and counters identity."""

    schema: str
    org_id: str
    play: str
    namespace: str
    table: str

    @property
    def qualified(self) -> str:
        return f"{quote_ident(self.schema)}.{quote_ident(self.table)}"

    @property
    def regclass_text(self) -> str:
        return self.qualified

    @property
    def order_index(self) -> str:
        """The qualified name of the sheet's row-order index (`ORDER_INDEX_COLUMNS`); at most
        63 bytes unqualified (a table name is at most 59)."""
        return f"{quote_ident(self.schema)}.{quote_ident(self.table + '_ord')}"

    @property
    def cause_index(self) -> str:
        """The qualified name of the sheet's index of failed rows by cause
        (`CAUSE_INDEX_COLUMNS`); like `order_index`, at most 63 bytes unqualified."""
        return f"{quote_ident(self.schema)}.{quote_ident(self.table + '_err')}"

    @property
    def lock_key(self) -> int:
        digest = hashlib.sha256(f"runplane.sheet\x00{self.schema}\x00{self.table}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    @property
    def counter_args(self) -> tuple[str, str, str]:
        return (self.org_id, self.play, self.namespace)


def column(field: str) -> str:
    """The quoted first-choice column of `field` (what its column is unless it collided)."""
    return quote_ident(column_name(field))


@attrs.frozen
class SheetColumns:
    """The registered physical column of each field a statement touches."""

    names: Mapping[str, str]

    def __call__(self, field: str) -> str:
        """The quoted physical column of `field` (KeyError when not resolved: a bug)."""
        return quote_ident(self.names[field])


def layout_for(port: Port, scope: PlayScope, table_namespace: str) -> SheetLayout:
    namespace = normalize_namespace(table_namespace)
    return SheetLayout(
        schema=port.schema,
        org_id=scope.org_id,
        play=scope.play,
        namespace=namespace,
        table=table_name(scope.org_id, scope.play, namespace),
    )


def sheet_lock_key(port: Port, layout: SheetLayout) -> int:
    """The sheet's recorded key (it locks nothing: see the module docstring), derived with the
    schema's lock secret the port read when it opened; a database session, which may not read
    the secret, was given its own sheet's. A port with neither falls back to `layout.lock_key`."""
    given = port.settings.sheet_lock_keys.get(layout.table)
    if given is not None:
        return given
    secret = port.settings.lock_secret
    if secret is not None:
        return derive_lock_key(secret, "runplane.sheet", layout.schema, layout.table)
    return layout.lock_key


# The sheet's one index besides its primary key: the row order of reads (input index, nulls
# last, then creation, then key), which keyset pages walk, and the lookup by input index of the
# completion's repair path. No column in it changes when a row completes, so completions stay
# HOT updates (no new index entry per row).
ORDER_INDEX_COLUMNS = "_input_index, _created_at, _key"

# The index of failed rows by cause, in row order: the console's failures filtered by cause
# walk it as a keyset range. Partial on `_cause IS NOT NULL`, so only failed rows have entries
# (a row's `_cause` is set with its `_error` by a failed completion and cleared with it), and
# `_status` is not one of its columns: a completion that does not change `_cause` (every
# completed row) stays a HOT update. An entry is bounded: a cause is at most
# `causes.MAX_CAUSE_BYTES` and a key `limits.MAX_KEY_BYTES`.
CAUSE_INDEX_COLUMNS = "_cause, _input_index, _created_at, _key"
CAUSE_INDEX_PREDICATE = "_cause IS NOT NULL"

_EXISTING_COLUMNS = """
SELECT coalesce(array_agg(attname::text), '{}'::text[])
  FROM pg_attribute
 WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped
"""


# Whether another sheet holds this sheet's table name (`$t` the name, `$o $p $n` our sheet).
FOREIGN_TABLE = """EXISTS (SELECT 1 FROM {summary} WHERE table_name = {t}
                   AND (org_id, play, table_namespace) <> ({o}, {p}, {n}))"""

_TABLE_PRESENT = """
SELECT to_regclass($1) IS NOT NULL AS present,
       """ + FOREIGN_TABLE.format(summary="{summary}", t="$2", o="$3", p="$4", n="$5") + """ AS foreign_table
"""


def foreign_table_error(layout: SheetLayout) -> ConflictError:
    """What reading a sheet whose table name another sheet holds raises (never its rows)."""
    return ConflictError(
        f"sheet {layout.namespace!r} of play {layout.play!r} has the table name of another "
        "sheet (the names' hashes collide); it holds no rows of this one")


async def table_present(conn: Connection, port: Port, layout: SheetLayout) -> bool:
    """Whether the sheet's table exists; `ConflictError` when it is another sheet's."""
    record = await conn.fetchrow(_TABLE_PRESENT.format(summary=table(port, "sheet_summary")),
                                 layout.qualified, layout.table, *layout.counter_args)
    if record["foreign_table"]:
        raise foreign_table_error(layout)
    return record["present"]


async def existing_columns(conn: Connection, layout: SheetLayout) -> set[str]:
    """The physical columns the sheet's table has now (empty when the table does not exist)."""
    return set(await conn.fetchval(_EXISTING_COLUMNS, layout.regclass_text))
