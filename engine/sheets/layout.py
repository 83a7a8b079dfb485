"""Physical layout of sheets and the transaction every sheet write runs in.

How it works
- A sheet is one table per (org, play, normalized table namespace) in the tenant schema, named
  `sheet_<namespace prefix>_<hash>`; each field is one `jsonb` column named
  `f_<readable prefix>_<hash of the field>`. Both names are pure functions of their inputs,
  at most 63 bytes, and can never collide with the system columns (which start with `_`).
  `sheet_columns` records which column holds which field, so readers can map columns back.
  Tables leave 30% of each page free (fillfactor 70) so completions can update rows in place
  (HOT updates, no new index entry per row).
- Every write transaction (`run_sheet_transaction`) first sets, for the transaction only: its
  statement timeout (sent on its own, so even the lock waits below are bounded);
  `plan_cache_mode = force_custom_plan` (a generic plan cannot see the sizes of the unnest
  arrays and may pick a join that rescans the sheet per row); `work_mem` of 32 MB (a
  10,000-row chunk's CTEs stay in memory); hash and merge joins off (every join of these
  statements is a batch of primary-key probes, and hashing the whole sheet per chunk costs more
  than probing; the input-index repair, the one join on a non-key column, turns them back on).
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
from typing import Any, Awaitable, Callable, Iterable, Literal, TypeVar

import attrs

from ..actions import action
from ..codecs import PLAY_SCOPE, STR, record
from ..errors import InsufficientPrivilegeError, InvalidInputError, MissingRelationError
from ..pg import Connection
from ..ports import SHEET_LANE, Port, sequence_literal, table
from ..scopes import PlayScope, check_scope, normalize_namespace
from ..sql import quote_ident

from .model import CONTRACT, SheetContract

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


def column_name(field: str) -> str:
    """The physical column of a field: `f_<readable>_<hash>` (never a system column)."""
    readable = _readable(field)
    return f"f_{readable}_{_hash(field)[:12]}" if readable else f"f_{_hash(field)[:12]}"


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
    """The quoted physical column of `field`."""
    return quote_ident(column_name(field))


def layout_for(port: Port, scope: PlayScope, table_namespace: str) -> SheetLayout:
    namespace = normalize_namespace(table_namespace)
    return SheetLayout(
        schema=port.schema,
        org_id=scope.org_id,
        play=scope.play,
        namespace=namespace,
        table=table_name(scope.org_id, scope.play, namespace),
    )


# -- DDL (exclusive lock only) ----------------------------------------------------------------
_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS {t} (
    _key text PRIMARY KEY,
    _status text NOT NULL DEFAULT 'pending',
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
"""

_EXISTING_COLUMNS = """
SELECT coalesce(array_agg(attname::text), '{}'::text[])
  FROM pg_attribute
 WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped
"""

_REGISTER_FIELDS = """
INSERT INTO {registry} AS r (org_id, play, table_namespace, field, column_name, position)
SELECT $1, $2, $3, u.field, u.column_name,
       (SELECT coalesce(max(position), 0) FROM {registry}
         WHERE org_id = $1 AND play = $2 AND table_namespace = $3) + u.ord
  FROM unnest($4::text[], $5::text[]) WITH ORDINALITY AS u(field, column_name, ord)
 WHERE NOT EXISTS (SELECT 1 FROM {registry} AS e
                    WHERE e.org_id = $1 AND e.play = $2 AND e.table_namespace = $3
                      AND e.field = u.field)
ON CONFLICT DO NOTHING
"""


async def existing_columns(conn: Connection, layout: SheetLayout) -> set[str]:
    """The physical columns the sheet's table has now (empty when the table does not exist)."""
    return set(await conn.fetchval(_EXISTING_COLUMNS, layout.regclass_text))


async def prepare_columns(conn: Connection, port: Port, layout: SheetLayout, fields: Iterable[str]) -> None:
    """Create the sheet table and any missing field columns; register the fields.

    Runs only under the sheet's exclusive advisory lock, inside the caller's transaction.
    """
    fields = list(dict.fromkeys(fields))
    later = "".join(f",\n    {name} {kind}" for name, kind in LATER_SYSTEM_COLUMNS.items())
    await conn.execute(_CREATE_TABLE.format(
        t=layout.qualified, seq=sequence_literal(port, "row_versions"), later=later,
    ))
    existing = await existing_columns(conn, layout)
    missing = [f for f in fields if column_name(f) not in existing]
    adds = [f"ADD COLUMN IF NOT EXISTS {name} {kind}"
            for name, kind in LATER_SYSTEM_COLUMNS.items() if name not in existing]
    adds += [f"ADD COLUMN IF NOT EXISTS {column(f)} jsonb" for f in missing]
    if adds:
        await conn.execute(f"ALTER TABLE {layout.qualified} {', '.join(adds)}")
    if fields:
        await conn.execute(
            _REGISTER_FIELDS.format(registry=table(port, "sheet_columns")),
            *layout.counter_args, fields, [column_name(f) for f in fields],
        )


# -- the write transaction --------------------------------------------------------------------
# Transaction-local settings, sent before the lock so the lock wait is bounded by the timeout.
_SETTINGS = """
SELECT set_config('statement_timeout', $1, true),
       set_config('plan_cache_mode', 'force_custom_plan', true),
       set_config('work_mem', '32MB', true),
       set_config('enable_hashjoin', 'off', true),
       set_config('enable_mergejoin', 'off', true)
"""

_LOCK_SHARED = """
WITH sheet_lock AS (SELECT pg_advisory_xact_lock_shared($1::bigint) AS v)
INSERT INTO {summary} AS s (org_id, play, table_namespace)
SELECT $2, $3, $4 FROM sheet_lock
ON CONFLICT (org_id, play, table_namespace) DO UPDATE SET updated_at = now()
RETURNING current_setting('server_version_num')::integer
"""

_LOCK_EXCLUSIVE = "SELECT pg_advisory_xact_lock($1::bigint)"

_LOCK_SUMMARY = """
INSERT INTO {summary} AS s (org_id, play, table_namespace)
VALUES ($1, $2, $3)
ON CONFLICT (org_id, play, table_namespace) DO UPDATE SET updated_at = now()
RETURNING current_setting('server_version_num')::integer
"""


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


def _permit_wait_seconds(port: Any) -> float | None:
    permits = getattr(port, "permits", None)
    if permits is None:
        return None
    try:
        stats = permits()
        return sum(stats[name].wait_seconds for name in (SHEET_LANE, "connections") if name in stats)
    except Exception:  # telemetry only: a port without usable stats has no split
        return None


async def _transaction_once(
    port: Port,
    layout: SheetLayout,
    fields: list[str],
    op: Callable[[Connection, int], Awaitable[T]],
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
                summary = table(port, "sheet_summary")
                await conn.execute(_SETTINGS, str(timeout_ms))
                if mode == "shared":
                    server_version = await conn.fetchval(
                        _LOCK_SHARED.format(summary=summary), layout.lock_key, *layout.counter_args
                    )
                else:
                    await conn.execute(_LOCK_EXCLUSIVE, layout.lock_key)
                    try:
                        await prepare_columns(conn, port, layout, fields)
                    except InsufficientPrivilegeError as exc:
                        raise InsufficientPrivilegeError(
                            f"sheet {layout.namespace!r} needs a new table or column, which this "
                            "login may not create (a database session runs no DDL: let the gateway "
                            f"or the schema owner prepare the sheet) ({exc})", sqlstate=exc.sqlstate,
                        ) from exc
                    server_version = await conn.fetchval(
                        _LOCK_SUMMARY.format(summary=summary), *layout.counter_args
                    )
                return await op(conn, server_version)
    except BaseException:
        if not checked_out:  # the checkout itself failed (re-raised below)
            clock.add("connect", time.perf_counter() - started, failed=True)
        raise


async def run_sheet_transaction(
    port: Port,
    layout: SheetLayout,
    fields: Iterable[str],
    op: Callable[[Connection, int], Awaitable[T]],
    *,
    timeout_ms: int,
    clock: PhaseClock | None = None,
    mode: LockMode = "shared",
) -> T:
    """Run `op(conn, server_version_num)` in one sheet write transaction (see the module
    docstring).

    `fields` are the fields whose columns `op` may reference; under the exclusive lock they are
    created first. `op` must be safe to run again from scratch (it is, after a rollback).
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

ENSURE_STATEMENT_TIMEOUT_MS = 60_000


LAYOUT = record(SheetLayout, schema=STR, org_id=STR, play=STR, namespace=STR, table=STR)


@action("sheets.ensure_sheet", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "contract": CONTRACT,
}, result=LAYOUT, deadline_s=60.0)
async def ensure_sheet(
    port: Port, scope: PlayScope, table_namespace: str, contract: SheetContract
) -> SheetLayout:
    """Create the sheet table, its contract columns and its counter rows (idempotent).

    Runs under the sheet's exclusive lock; returns where the sheet lives.
    """
    check_scope(port, scope)
    if not isinstance(contract, SheetContract):
        raise InvalidInputError("contract must be a SheetContract")
    layout = layout_for(port, scope, table_namespace)
    sql = _ENSURE_COLUMN_COUNTERS.format(column_summary=table(port, "sheet_column_summary"))

    async def op(conn: Connection, _server_version: int) -> None:
        if contract.outputs:
            await conn.execute(sql, *layout.counter_args, list(contract.outputs))

    await run_sheet_transaction(
        port, layout, contract.fields, op, timeout_ms=ENSURE_STATEMENT_TIMEOUT_MS,
        mode="exclusive",
    )
    return layout
