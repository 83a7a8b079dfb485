"""Physical layout of sheets and the transaction every sheet write runs in.

How it works
- A sheet is one table per (org, play, normalized table namespace) in the tenant schema, named
  `sheet_<namespace prefix>_<hash>`; each field is one `jsonb` column. Physical names are at
  most 63 bytes and never collide with the system columns (which start with `_`).
- Which column holds which field is decided by the sheet's column registry (`sheet_columns`),
  never by a hash alone: a field's first choice is `f_<readable prefix>_<12 hex of its hash>`,
  and when that name is already registered to another field (48 bits collide in seconds) the
  extension allocates the next free candidate. A unique index on (sheet, column name) makes
  the database refuse any sharing. Writers learn the mapping of the fields they touch from the
  same statement that takes the sheet lock (no extra round trip); a field not registered yet
  sends the writer down the exclusive path, which registers it.
- Table names get the same guarantee: `sheet_summary.table_name` is unique, filled by the lock
  statement, so two (org, play, namespace) whose table names collide are refused with
  `ConflictError` (they would otherwise share one table); readers check the owner too.
  Tables leave 30% of each page free (fillfactor 70) so completions can update rows in place
  (HOT updates, no new index entry per row). Besides the primary key a sheet has one index, on
  its row order (`ORDER_INDEX_COLUMNS`); an older sheet gets it the way it gets later system
  columns (below).
- Every write transaction (`run_sheet_transaction`) first sets, for the transaction only: its
  statement timeout (sent on its own, so even the lock waits below are bounded);
  `plan_cache_mode = force_custom_plan` (a generic plan cannot see the sizes of the unnest
  arrays and may pick a join that rescans the sheet per row); `work_mem` of 32 MB (a
  10,000-row chunk's CTEs stay in memory); hash and merge joins off (every join of these
  statements is a batch of primary-key probes, and hashing the whole sheet per chunk costs more
  than probing; the input-index repair looks rows up through the row-order index).
  Then one statement takes the sheet's advisory lock and locks the sheet's `sheet_summary` row
  (creating it if absent). Holding the summary row serializes the writers of one sheet: each
  later statement of the transaction sees every earlier writer committed, so counter deltas
  computed from the rows it reads are exact, and there is no lock-order cycle between writers
  (they all lock the summary row first, then sheet rows, then column-summary rows).
- System columns added in later releases (`LATER_SYSTEM_COLUMNS`) are added to an older sheet
  the same way as missing field columns: `ensure_sheet` (every map starts with it) and any
  writer that hits the missing column add them under the exclusive lock; adding a column with a
  constant default rewrites nothing, so an existing tenant migrates with no manual step.
- Normal writers hold the advisory lock shared. A writer whose statements hit a missing table or
  column rolls back and retries once under the exclusive lock, where it creates the table and
  any missing columns (and registers them) before writing; if even that finds a missing relation
  the schema bootstrap is repaired and it retries once more.
"""

from __future__ import annotations

import hashlib
import re
import time
import itertools
from typing import Any, Awaitable, Callable, Iterable, Iterator, Literal, Mapping, TypeVar

import attrs

from ..actions import action
from ..codecs import PLAY_SCOPE, STR, record
from ..errors import (
    ConflictError, DatabaseError, InsufficientPrivilegeError, InvalidInputError,
    MissingRelationError,
)
from ..pg import Connection
from ..ports import SHEET_LANE, Port, sequence_literal, table
from ..schema import derive_lock_key
from ..scopes import PlayScope, check_scope, normalize_namespace
from ..sql import quote_ident

from .model import CONTRACT, MAX_SHEET_FIELDS, SheetContract, with_row_statuses

T = TypeVar("T")
LockMode = Literal["shared", "exclusive"]
LANE = SHEET_LANE  # the lane of every sheet checkout
MAX_NAME_PREFIX = 36
_JUNK = re.compile(r"[^a-z0-9_]+")

SYSTEM_COLUMNS = (
    "_key", "_status", "_run_id", "_write_version", "_input_index", "_attempt_id",
    "_attempt_seq", "_attempt_expires_at", "_cell_meta", "_error", "_version", "_created_at",
    "_updated_at", "_attempts", "_failed_runs", "_failed_epoch",
)

# System columns added after the first release, with their definitions: a sheet created before
# them gets them (under the exclusive lock) the first time a writer or `ensure_sheet` needs them.
LATER_SYSTEM_COLUMNS = {
    "_attempts": "bigint NOT NULL DEFAULT 0",     # calls of the map function, across runs
    "_failed_runs": "integer NOT NULL DEFAULT 0",  # runs in which the row failed (give-up)
    "_failed_epoch": "bigint",                     # the last run counted in `_failed_runs`
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
    """Where one sheet lives: its table, counters identity and advisory lock key."""

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
    def lock_key(self) -> int:
        digest = hashlib.sha256(f"runplane.sheet\x00{self.schema}\x00{self.table}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    @property
    def counter_args(self) -> tuple[str, str, str]:
        return (self.org_id, self.play, self.namespace)


class BindParams:
    """Allocates `$n` bind positions while a statement is built (values stay binds)."""

    def __init__(self, first: int) -> None:
        self.values: list[Any] = []
        self.first = first

    def add(self, value: Any, cast: str) -> str:
        self.values.append(value)
        return f"${self.first + len(self.values) - 1}::{cast}"


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


@attrs.frozen
class SheetTxn:
    """What a sheet write transaction learned when it took the sheet lock."""

    server_version: int
    columns: SheetColumns
    exclusive: bool = False  # under the exclusive lock (the table and columns were prepared)


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
    """The sheet's advisory-lock key: derived with the schema's lock secret (what the port read
    when it opened), so no one without it can tell which key guards which sheet; a database
    session, which may not read the secret, was given its own sheet's key. A port that has
    neither (opened without a schema check) falls back to `layout.lock_key`, of public names."""
    given = port.sheet_lock_keys.get(layout.table)
    if given is not None:
        return given
    secret = port.lock_secret
    if secret is not None:
        return derive_lock_key(secret, "runplane.sheet", layout.schema, layout.table)
    return layout.lock_key


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
) WITH (fillfactor = 70)
""")

# The sheet's one index besides its primary key: the row order of reads (input index, nulls
# last, then creation, then key), which keyset pages walk, and the lookup by input index of the
# completion's repair path. No column in it changes when a row completes, so completions stay
# HOT updates (no new index entry per row).
ORDER_INDEX_COLUMNS = "_input_index, _created_at, _key"
_CREATE_ORDER_INDEX = "CREATE INDEX IF NOT EXISTS {name} ON {t} ({columns})"

_EXISTING_COLUMNS = """
SELECT coalesce(array_agg(attname::text), '{}'::text[])
  FROM pg_attribute
 WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped
"""

_REGISTERED_COLUMNS = """
SELECT field, column_name FROM {registry}
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3
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

# The registered columns of some fields, in their order (NULL for a field not registered).
COLUMNS_OF_FIELDS = """ARRAY(SELECT c.column_name
                  FROM unnest({fields}::text[]) WITH ORDINALITY AS u(field, ord)
                  LEFT JOIN {registry} AS c
                         ON c.org_id = {org} AND c.play = {play} AND c.table_namespace = {ns}
                        AND c.field = u.field
                 ORDER BY u.ord)"""


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
        fields="$4", registry=table(port, "sheet_columns"), org="$1", play="$2", ns="$3")
    names = await conn.fetchval(sql, *layout.counter_args, fields)
    if any(name is None for name in names):
        return None
    return SheetColumns(dict(zip(fields, names)))


async def prepare_columns(
    conn: Connection, port: Port, layout: SheetLayout, fields: Iterable[str]
) -> SheetColumns:
    """Create the sheet table and any missing field columns; register the new fields.

    Runs only under the sheet's exclusive advisory lock, inside the caller's transaction;
    returns the registered column of every field in `fields`.
    """
    fields = list(dict.fromkeys(fields))
    later = "".join(f",\n    {name} {kind}" for name, kind in LATER_SYSTEM_COLUMNS.items())
    await conn.execute(_CREATE_TABLE.format(
        t=layout.qualified, seq=sequence_literal(port, "row_versions"), later=later,
    ))
    await conn.execute(_CREATE_ORDER_INDEX.format(
        name=quote_ident(layout.table + "_ord"), t=layout.qualified, columns=ORDER_INDEX_COLUMNS))
    existing = await existing_columns(conn, layout)
    registry = table(port, "sheet_columns")
    registered = {r["field"]: r["column_name"] for r in await conn.fetch(
        _REGISTERED_COLUMNS.format(registry=registry), *layout.counter_args)}
    new = allocate_columns(fields, registered, existing)
    names = {**registered, **new}
    if new and len(names) > MAX_SHEET_FIELDS:
        raise InvalidInputError(
            f"sheet {layout.namespace!r} would have {len(names)} fields; a sheet holds at most "
            f"{MAX_SHEET_FIELDS}")
    adds = [f"ADD COLUMN IF NOT EXISTS {name} {kind}"
            for name, kind in LATER_SYSTEM_COLUMNS.items() if name not in existing]
    adds += [f"ADD COLUMN IF NOT EXISTS {quote_ident(names[f])} jsonb"
             for f in fields if names[f] not in existing]
    if adds:
        await conn.execute(f"ALTER TABLE {layout.qualified} {', '.join(adds)}")
    if new:
        await conn.execute(
            _REGISTER_FIELDS.format(registry=registry),
            *layout.counter_args, list(new), list(new.values()),
        )
    return SheetColumns({f: names[f] for f in fields})


# -- the write transaction --------------------------------------------------------------------
# Transaction-local settings, sent before the lock so the lock wait is bounded by the timeout.
# It also returns the transaction's id (every sheet transaction writes: it claims its summary
# row), which spares COMMIT a round trip to learn it (`Connection.note_transaction_id`).
_SETTINGS = """
SELECT set_config('statement_timeout', $1, true),
       set_config('plan_cache_mode', 'force_custom_plan', true),
       set_config('work_mem', '32MB', true),
       set_config('enable_hashjoin', 'off', true),
       set_config('enable_mergejoin', 'off', true),
       txid_current()::text AS xid
"""

# Both lock statements upsert the sheet's summary row, claiming its table name (unique: a
# colliding sheet fails with 23505 here, before touching any row). The shared one also reads the
# registered columns of the fields ($6); registry rows never change once committed, so what its
# snapshot shows is right, and a field it does not show sends the writer down the exclusive path.
_LOCK_SHARED = """
WITH sheet_lock AS (SELECT pg_advisory_xact_lock_shared($1::bigint) AS v),
claimed AS (
    INSERT INTO {summary} AS s (org_id, play, table_namespace, table_name)
    SELECT $2, $3, $4, $5 FROM sheet_lock
    ON CONFLICT (org_id, play, table_namespace)
        DO UPDATE SET updated_at = now(), table_name = coalesce(s.table_name, EXCLUDED.table_name)
    RETURNING 1
)
SELECT current_setting('server_version_num')::integer AS server_version,
       {columns} AS columns
"""

_LOCK_EXCLUSIVE = "SELECT pg_advisory_xact_lock($1::bigint)"

_LOCK_SUMMARY = """
INSERT INTO {summary} AS s (org_id, play, table_namespace, table_name)
VALUES ($1, $2, $3, $4)
ON CONFLICT (org_id, play, table_namespace)
    DO UPDATE SET updated_at = now(), table_name = coalesce(s.table_name, EXCLUDED.table_name)
RETURNING current_setting('server_version_num')::integer
"""

TABLE_NAME_CONSTRAINT = "sheet_summary_table_name"


class _UnregisteredField(MissingRelationError):
    """A field the writer needs has no registered column yet (retry under the exclusive lock)."""


def _table_name_taken(exc: DatabaseError, layout: SheetLayout) -> ConflictError | None:
    if exc.sqlstate == "23505" and TABLE_NAME_CONSTRAINT in str(exc):
        return ConflictError(
            f"sheet {layout.namespace!r} of play {layout.play!r} would share the table "
            f"{layout.table} with another sheet (the names' hashes collide); use another "
            "table namespace"
        )
    return None


@attrs.define(eq=False)
class PhaseClock:
    """Mutable per-call telemetry: elapsed ms and failures per phase, plus retries."""

    ms: dict[str, float] = attrs.field(factory=dict)
    failures: dict[str, int] = attrs.field(factory=dict)
    column_retries: int = 0

    def add(self, phase: str, seconds: float, failed: bool = False) -> None:
        self.ms[phase] = self.ms.get(phase, 0.0) + seconds * 1000.0
        if failed:
            self.failures[phase] = self.failures.get(phase, 0) + 1

    async def measure(self, phase: str, awaitable: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            result = await awaitable
        except BaseException:
            self.add(phase, time.perf_counter() - started, failed=True)
            raise
        self.add(phase, time.perf_counter() - started)
        return result


def _permit_wait_seconds(port: Port) -> float | None:
    try:
        stats = port.permits()
        return sum(stats[name].wait_seconds for name in (SHEET_LANE, "connections") if name in stats)
    except Exception:  # telemetry only: a port without usable stats has no split
        return None


async def _transaction_once(
    port: Port,
    layout: SheetLayout,
    fields: list[str],
    op: Callable[[Connection, SheetTxn], Awaitable[T]],
    mode: LockMode,
    timeout_ms: int,
    clock: PhaseClock,
) -> T:
    waited_before = _permit_wait_seconds(port)
    started = time.perf_counter()
    checked_out = False
    try:
        async with port.connection(SHEET_LANE) as conn:
            checked_out = True
            elapsed = time.perf_counter() - started
            waited_after = _permit_wait_seconds(port)
            waited = 0.0
            if waited_before is not None and waited_after is not None:
                waited = min(max(waited_after - waited_before, 0.0), elapsed)
            clock.add("permit_wait", waited)
            clock.add("connect", elapsed - waited)
            async with conn.transaction(on_phase=clock.add):
                settings = await conn.fetchrow(_SETTINGS, str(timeout_ms))
                conn.note_transaction_id(settings["xid"])
                sheet = await _lock_sheet(conn, port, layout, fields, mode)
                return await op(conn, sheet)
    except BaseException:
        if not checked_out:  # the checkout itself failed (re-raised below)
            clock.add("connect", time.perf_counter() - started, failed=True)
        raise


async def _lock_sheet(
    conn: Connection, port: Port, layout: SheetLayout, fields: list[str], mode: LockMode
) -> SheetTxn:
    """Take the sheet lock and claim its summary row; learn the columns of `fields`."""
    summary = table(port, "sheet_summary")
    try:
        if mode == "shared":
            columns = COLUMNS_OF_FIELDS.format(
                fields="$6", registry=table(port, "sheet_columns"), org="$2", play="$3", ns="$4")
            record = await conn.fetchrow(
                _LOCK_SHARED.format(summary=summary, columns=columns),
                sheet_lock_key(port, layout), *layout.counter_args, layout.table, fields,
            )
            names = record["columns"]
            if any(name is None for name in names):
                raise _UnregisteredField("a field has no registered column yet")
            return SheetTxn(record["server_version"], SheetColumns(dict(zip(fields, names))))
        await conn.execute(_LOCK_EXCLUSIVE, sheet_lock_key(port, layout))
        server_version = await conn.fetchval(
            _LOCK_SUMMARY.format(summary=summary), *layout.counter_args, layout.table
        )
        try:
            columns = await prepare_columns(conn, port, layout, fields)
        except InsufficientPrivilegeError as exc:
            raise InsufficientPrivilegeError(
                f"sheet {layout.namespace!r} needs a new table or column, which this "
                "login may not create (a database session runs no DDL: let the gateway "
                f"or the schema owner prepare the sheet) ({exc})", sqlstate=exc.sqlstate,
            ) from exc
        return SheetTxn(server_version, columns, exclusive=True)
    except MissingRelationError:
        raise
    except DatabaseError as exc:
        conflict = _table_name_taken(exc, layout)
        if conflict is not None:
            raise conflict from exc
        raise


async def run_sheet_transaction(
    port: Port,
    layout: SheetLayout,
    fields: Iterable[str],
    op: Callable[[Connection, SheetTxn], Awaitable[T]],
    *,
    timeout_ms: int,
    clock: PhaseClock | None = None,
    mode: LockMode = "shared",
) -> T:
    """Run `op(conn, sheet)` in one sheet write transaction (see the module docstring).

    `fields` are the fields whose columns `op` may reference (`sheet.columns(field)`); under the
    exclusive lock they are created and registered first. `op` must be safe to run again from scratch (it is, after a rollback).
    """
    fields = list(fields)
    clock = clock if clock is not None else PhaseClock()
    repaired = False
    while True:
        try:
            return await _transaction_once(port, layout, fields, op, mode, timeout_ms, clock)
        except MissingRelationError:
            if mode == "shared":
                mode = "exclusive"
                clock.column_retries += 1
                continue
            if repaired:
                raise
            repaired = True
            await port.repair_schema()


# -- ensure_sheet -----------------------------------------------------------------------------
_ENSURE_COLUMN_COUNTERS = """
INSERT INTO {column_summary} (org_id, play, table_namespace, field)
SELECT $1, $2, $3, f FROM unnest($4::text[]) AS f
ON CONFLICT DO NOTHING
"""

# The shared path's one statement: the counters, and whether the table has every later system
# column and the row-order index (false when it lacks one, or does not exist: the exclusive path
# creates what is missing).
_ENSURE_SHARED = """
WITH counters AS (
    INSERT INTO {column_summary} (org_id, play, table_namespace, field)
    SELECT $1, $2, $3, f FROM unnest($4::text[]) AS f
    ON CONFLICT DO NOTHING
)
SELECT count(*) = cardinality($6::text[]) AND to_regclass($7) IS NOT NULL FROM pg_attribute
 WHERE attrelid = to_regclass($5) AND attname = ANY($6::text[]) AND NOT attisdropped
"""

ENSURE_STATEMENT_TIMEOUT_MS = 60_000


LAYOUT = record(SheetLayout, schema=STR, org_id=STR, play=STR, namespace=STR, table=STR)


@action("sheets.ensure_sheet", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "contract": CONTRACT,
}, result=LAYOUT, deadline_s=60.0)
async def ensure_sheet(
    port: Port, scope: PlayScope, table_namespace: str, contract: SheetContract
) -> SheetLayout:
    """Create the sheet table, its contract columns and its counter rows (idempotent).

    Returns where the sheet lives. A sheet whose contract fields all have registered columns
    (every map after the first: its table exists, since fields are registered in the
    transaction that creates it) takes only the shared lock, so a map starting does not wait
    for the writers of the sheet; otherwise (or with no fields to tell) the exclusive lock.
    """
    check_scope(port, scope)
    if not isinstance(contract, SheetContract):
        raise InvalidInputError("contract must be a SheetContract")
    layout = layout_for(port, scope, table_namespace)
    column_summary = table(port, "sheet_column_summary")
    sql = _ENSURE_COLUMN_COUNTERS.format(column_summary=column_summary)
    shared_sql = _ENSURE_SHARED.format(column_summary=column_summary)
    later = list(LATER_SYSTEM_COLUMNS)

    async def op(conn: Connection, sheet: SheetTxn) -> None:
        if not sheet.exclusive:
            complete = await conn.fetchval(shared_sql, *layout.counter_args,
                                           list(contract.outputs), layout.regclass_text, later,
                                           layout.order_index)
            if not complete:
                raise MissingRelationError("the sheet's table lacks a system column or index")
        elif contract.outputs:
            await conn.execute(sql, *layout.counter_args, list(contract.outputs))

    await run_sheet_transaction(
        port, layout, contract.fields, op, timeout_ms=ENSURE_STATEMENT_TIMEOUT_MS,
        mode="shared" if contract.fields else "exclusive",
    )
    return layout
