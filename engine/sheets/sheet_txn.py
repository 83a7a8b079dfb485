"""The transaction every sheet write runs in, and its lock protocol.

How it works
- Every write transaction (`run_sheet_transaction`) first sets, for the transaction only: its
  statement timeout (sent in BEGIN's message: no round trip of its own, and even the lock
  waits below are bounded);
  `plan_cache_mode = force_custom_plan` (a generic plan cannot see the sizes of the unnest
  arrays and may pick a join that rescans the sheet per row); `work_mem` of 32 MB (a
  10,000-row chunk's CTEs stay in memory); hash and merge joins and sequential scans off (every
  join of these statements is a batch of primary-key probes, and hashing or scanning the whole
  sheet per chunk costs more than probing, whatever stale statistics say of a sheet that was
  emptied and refilled; the input-index repair looks rows up through the row-order index; a
  statement with no index path still scans).
  Then one statement locks the sheet's `sheet_summary` row (creating it if absent, claiming its
  unique table name): that row lock is the sheet lock. If the sheet has counter deltas of
  concurrent writers, the next statement folds them into it (`counters`). Holding the
  summary row serializes the writers of one sheet:
  each later statement of the transaction sees every earlier writer committed, so counter
  deltas computed from the rows it reads are exact, and there is no lock-order cycle between
  writers (they all lock the summary row first, then sheet rows, then column-summary rows).
  Claiming the row adds one to its `writes`, so a sheet whose `writes` has not moved (and which
  has no counter deltas) has not been written since (`lists`, recorded lists). The value a
  transaction left is noted, once it committed, in the write ledger a map keeps
  (`write_ledger`: proof that nobody else wrote the sheet while the map ran).
- The sheet lock is a row lock, not an advisory lock, so that no other login can hold it:
  advisory keys are visible to every login in `pg_locks` and any login may take any key, while
  a row of `sheet_summary` can be locked only by a login that can see it (database sessions
  see their own org's rows only: row-level security). runplane takes no advisory lock on any
  write path (docs/guide/operations.md, "A database session").
- A **concurrent** transaction (`concurrent=True`: the unit writes of a shared map whose
  published rows have no duplicate) holds the summary row `FOR SHARE` instead: it excludes
  every ordinary writer but not the map's other workers, and adds its counter deltas to its
  own rows (`counters`). Their deltas stay exact without serializing because such writers never
  change a row another could change at the same time: each writes only the rows of units it
  holds (a unit's earlier holder, whose lease was taken over, fails its lease check in the
  same transaction and rolls back, and the new holder's statements wait on its row locks), and
  the map's rows have distinct keys. A sheet whose summary row is missing, or a field without
  a column, sends it down the exclusive path as an ordinary writer.
- A transaction of a **write group** (`write_group`: the writes of one plain map in one
  process) may hold the summary row `FOR SHARE` too, beside the group's other transactions:
  its lock statement claims the row only while `writes` still holds the group's token and no
  shared map of the sheet is waiting or open, and adds its counter deltas to its own rows as a
  concurrent writer does; when the row is not claimed it runs again the ordinary way.
- Normal writers learn the registered columns of the fields they touch in the same statement
  that claims the summary row. One that finds a field with no registered column goes on under
  the exclusive path in the same transaction (its upsert holds the summary row just as that
  path's does), where it creates the table and any missing columns and registers them
  (`column_registry.prepare_columns`) before writing. A concurrent writer that finds one, and
  a writer whose statements hit a missing table or column, rolls back and retries once under
  the exclusive path; if even that finds a missing relation the schema bootstrap is repaired
  and it retries once more.
- The operation `op(conn, sheet)` runs inside; it must be safe to run again from scratch. A
  shared map's unit writes add a `UnitGuard`: a hook that runs last inside, and the choice of
  a concurrent transaction.
Who calls: admission, completion, the write modes and `ensure_sheet`.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable, Iterable, Literal, Sequence, TypeVar

import attrs

from ..errors import ConflictError, DatabaseError, InsufficientPrivilegeError, MissingRelationError
from ..pg import Connection
from ..ports import SHEET_LANE, Port, table

from .column_registry import COLUMNS_OF_FIELDS, prepare_columns
from .counters import fold_statement, folds_by_zeroing, has_deltas
from .layout import SheetColumns, SheetLayout
from .model import FencedRow
from .statements import BindParams, Statement
from .telemetry import PhaseClock, permit_wait_seconds
from .write_group import Turn, WriteGroup, refuse_groups
from .write_ledger import note_commit

T = TypeVar("T")
LockMode = Literal["shared", "exclusive"]


# Runs last inside a unit write's transaction: `within(conn, committed_keys, fenced)`.
Within = Callable[[Connection, frozenset[str], dict[str, FencedRow]], Awaitable[None]]


@attrs.frozen
class UnitGuard:
    """How a shared map's unit write runs its sheet transaction: `within(conn, committed_keys,
    fenced)` runs last inside it (the units' lease check or settlement: what it raises rolls
    the write back, and it may run more than once, the transaction being retried from
    scratch); `concurrent` makes it a concurrent transaction (module docstring)."""

    within: Within | None = None
    concurrent: bool = False


@attrs.frozen
class SheetTxn:
    """What a sheet write transaction learned when it took the sheet lock."""

    server_version: int
    columns: SheetColumns
    exclusive: bool = False  # under the exclusive lock (the table and columns were prepared)
    concurrent: bool = False  # counters go to this backend's delta rows (module docstring)
    writes: int | None = None  # the summary row's `writes` this transaction left (ordinary ones)
    found_deltas: bool = False  # the sheet had counter deltas of concurrent writers
    group: bool = False  # a write group's transaction (`write_group`)


# Transaction-local settings, sent with BEGIN (one message, so one round trip) and so before
# the lock: the lock wait is bounded by the timeout. `{timeout_ms}` is an int.
_SETTINGS = """
SELECT set_config('statement_timeout', '{timeout_ms}', true),
       set_config('plan_cache_mode', 'force_custom_plan', true),
       set_config('work_mem', '32MB', true),
       set_config('enable_hashjoin', 'off', true),
       set_config('enable_mergejoin', 'off', true),
       set_config('enable_seqscan', 'off', true)"""

# Every lock statement also returns the transaction's id (every sheet transaction writes: it
# claims or locks its summary row), which spares COMMIT a round trip to learn it
# (`Connection.note_transaction_id`).
_XID = "txid_current()::text AS xid"

def lock_shared_statement(port: Port, layout: SheetLayout, fields: list[str],
                          concurrent: bool = False, group_token: int | None = None
                          ) -> Statement:
    """Upsert (lock) the sheet's summary row, claiming its
    table name (unique: a colliding sheet fails with 23505 here, before touching any row), and
    read the registered columns of `fields`: registry rows never change once committed, so what
    its snapshot shows is right, and a field it does not show sends the writer down the
    exclusive path. `_LOCK_SUMMARY` claims the row the same way on the exclusive path."""
    binds = BindParams()
    org, play, namespace = (binds.add(value, "text") for value in layout.counter_args)
    table_name = binds.add(layout.table, "text")
    columns = COLUMNS_OF_FIELDS.format(
        fields=binds.add(fields, "text[]"), registry=table(port, "sheet_columns"), org=org,
        play=play, ns=namespace)
    summary = table(port, "sheet_summary")
    if group_token is not None:  # a write group's turn: while nobody else wrote since its token
        token = binds.add(group_token, "bigint")
        return binds.statement(f"""
WITH claimed AS (
    SELECT s.table_name FROM {summary} AS s
     WHERE s.org_id = {org} AND s.play = {play} AND s.table_namespace = {namespace}
       AND s.table_name = {table_name} AND s.writes = {token}
       AND NOT EXISTS (SELECT 1 FROM {table(port, "shared_maps")} AS m
                        WHERE m.org_id = {org} AND m.play = {play}
                          AND m.table_namespace = {namespace} AND m.state IN {_LIVE_MAPS})
       FOR SHARE OF s
)
SELECT current_setting('server_version_num')::integer AS server_version,
       {columns} AS columns, (SELECT count(*) FROM claimed) AS claimed, {_XID}
""")
    if concurrent:  # the summary row held shared; it must exist (else: the exclusive path)
        return binds.statement(f"""
WITH claimed AS (
    SELECT s.table_name FROM {summary} AS s
     WHERE s.org_id = {org} AND s.play = {play} AND s.table_namespace = {namespace}
       AND s.table_name = {table_name}
       FOR SHARE OF s
)
SELECT current_setting('server_version_num')::integer AS server_version,
       {columns} AS columns, (SELECT count(*) FROM claimed) AS claimed, {_XID}
""")
    return binds.statement(f"""
WITH claimed AS (
    INSERT INTO {summary} AS s (org_id, play, table_namespace, table_name)
    VALUES ({org}, {play}, {namespace}, {table_name})
    ON CONFLICT (org_id, play, table_namespace)
        DO UPDATE SET updated_at = now(), writes = s.writes + 1,
                      table_name = coalesce(s.table_name, EXCLUDED.table_name)
    RETURNING s.writes
)
SELECT current_setting('server_version_num')::integer AS server_version,
       {columns} AS columns, (SELECT count(*) FROM claimed) AS claimed,
       (SELECT writes FROM claimed) AS writes,
       {has_deltas(port, org, play, namespace)} AS has_deltas, {_XID}
""")


_LOCK_SUMMARY = """
INSERT INTO {summary} AS s (org_id, play, table_namespace, table_name)
VALUES ($1, $2, $3, $4)
ON CONFLICT (org_id, play, table_namespace)
    DO UPDATE SET updated_at = now(), writes = s.writes + 1,
                  table_name = coalesce(s.table_name, EXCLUDED.table_name)
RETURNING current_setting('server_version_num')::integer AS server_version, s.writes,
          {has_deltas} AS has_deltas, """ + _XID + """
"""

TABLE_NAME_CONSTRAINT = "sheet_summary_table_name"
_LIVE_MAPS = "('waiting', 'open')"  # shared-map states whose writers may come (`shared.maps`)


class _NotInTurn(Exception):
    """A write group's transaction found its token gone (another writer wrote the sheet), a
    shared map of the sheet live, or a field without a column: it runs the ordinary way."""


class _UnregisteredField(MissingRelationError):
    """A field the writer needs has no registered column yet (retry under the exclusive lock)."""


class _TableNameTaken(Exception):
    """The summary row's table name is taken: by another sheet (a hash collision), or by this
    sheet's own row that a concurrent first write inserted meanwhile (`ON CONFLICT` arbitrates
    on the primary key only, so that race surfaces on the table-name index). Tried once more;
    a second time it is the collision."""

    def __init__(self, conflict: ConflictError) -> None:
        super().__init__(str(conflict))
        self.conflict = conflict


def _table_name_taken(exc: DatabaseError, layout: SheetLayout) -> ConflictError | None:
    if exc.sqlstate == "23505" and TABLE_NAME_CONSTRAINT in str(exc):
        return ConflictError(
            f"sheet {layout.namespace!r} of play {layout.play!r} would share the table "
            f"{layout.table} with another sheet (the names' hashes collide); use another "
            "table namespace"
        )
    return None


async def _transaction_once(
    port: Port,
    layout: SheetLayout,
    fields: list[str],
    op: Callable[[Connection, SheetTxn], Awaitable[T]],
    mode: LockMode,
    timeout_ms: int,
    clock: PhaseClock,
    concurrent: bool = False,
    group_token: int | None = None,
    learned: list[SheetTxn] | None = None,
) -> T:
    waited_before = permit_wait_seconds(port)
    started = time.perf_counter()
    checked_out = False
    try:
        async with port.connection(SHEET_LANE) as conn:
            checked_out = True
            elapsed = time.perf_counter() - started
            waited_after = permit_wait_seconds(port)
            waited = 0.0
            if waited_before is not None and waited_after is not None:
                waited = min(max(waited_after - waited_before, 0.0), elapsed)
            clock.add("permit_wait", waited)
            clock.add("connect", elapsed - waited)
            settings = _SETTINGS.format(timeout_ms=int(timeout_ms))
            async with conn.transaction(on_phase=clock.add, begin_with=settings):
                sheet = await _lock_sheet(conn, port, layout, fields, mode, concurrent,
                                          group_token)
                if learned is not None:
                    learned.append(sheet)
                if sheet.exclusive and mode == "shared":  # it prepared columns after all
                    clock.column_retries += 1
                result = await op(conn, sheet)
        note_commit(layout.counter_args, sheet.writes, sheet.found_deltas,  # committed
                    group=sheet.group)
        return result
    except BaseException:
        if not checked_out:  # the checkout itself failed (re-raised below)
            clock.add("connect", time.perf_counter() - started, failed=True)
        raise


async def _lock_sheet(
    conn: Connection, port: Port, layout: SheetLayout, fields: list[str], mode: LockMode,
    concurrent: bool = False, group_token: int | None = None,
) -> SheetTxn:
    """Take the sheet lock and claim its summary row; learn the columns of `fields`."""
    summary = table(port, "sheet_summary")
    try:
        if group_token is not None:
            statement = lock_shared_statement(port, layout, fields, group_token=group_token)
            record = await conn.fetchrow(statement.sql, *statement.args)
            conn.note_transaction_id(record["xid"])
            names = record["columns"]
            if not record["claimed"] or any(name is None for name in names):
                raise _NotInTurn()
            return SheetTxn(record["server_version"], SheetColumns(dict(zip(fields, names))),
                            concurrent=True, group=True)
        if mode == "shared":
            statement = lock_shared_statement(port, layout, fields, concurrent)
            record = await conn.fetchrow(statement.sql, *statement.args)
            conn.note_transaction_id(record["xid"])
            names = record["columns"]
            if not record["claimed"]:  # concurrent, and the summary row is missing
                raise _UnregisteredField("the sheet has no summary row yet")
            if any(name is None for name in names):
                if concurrent:  # the summary row is held shared: no DDL under it
                    raise _UnregisteredField("a field has no registered column yet")
                # The upsert above holds the summary row as the exclusive path's does: go on
                # there in this transaction (its statements read the registry afresh).
                return SheetTxn(record["server_version"],
                                await _prepare(conn, port, layout, fields), exclusive=True,
                                writes=record["writes"], found_deltas=record["has_deltas"])
            if not concurrent and record["has_deltas"]:
                await conn.execute(fold_statement(port), *layout.counter_args)
            return SheetTxn(record["server_version"], SheetColumns(dict(zip(fields, names))),
                            concurrent=concurrent,
                            writes=None if concurrent else record["writes"],
                            found_deltas=not concurrent and record["has_deltas"])
        locked = await conn.fetchrow(
            _LOCK_SUMMARY.format(summary=summary,
                                 has_deltas=has_deltas(port, "$1::text", "$2::text", "$3::text")),
            *layout.counter_args, layout.table
        )
        conn.note_transaction_id(locked["xid"])
        return SheetTxn(locked["server_version"], await _prepare(conn, port, layout, fields),
                        exclusive=True,
                        writes=locked["writes"], found_deltas=locked["has_deltas"])
    except MissingRelationError:
        raise
    except DatabaseError as exc:
        conflict = _table_name_taken(exc, layout)
        if conflict is not None:
            raise _TableNameTaken(conflict) from exc
        raise


async def _prepare(conn: Connection, port: Port, layout: SheetLayout, fields: list[str]
                   ) -> SheetColumns:
    """`prepare_columns` under the held summary row; a login without DDL rights is told why."""
    try:
        return await prepare_columns(conn, port, layout, fields)
    except InsufficientPrivilegeError as exc:
        raise InsufficientPrivilegeError(
            f"sheet {layout.namespace!r} needs a new table or column, which this "
            "login may not create (a database session runs no DDL: let the gateway "
            f"or the schema owner prepare the sheet) ({exc})", sqlstate=exc.sqlstate,
        ) from exc


async def run_sheet_transaction(
    port: Port,
    layout: SheetLayout,
    fields: Iterable[str],
    op: Callable[[Connection, SheetTxn], Awaitable[T]],
    *,
    timeout_ms: int,
    clock: PhaseClock | None = None,
    mode: LockMode = "shared",
    concurrent: bool = False,
    group: WriteGroup | None = None,
    keys: Sequence[str] = (),
    learned: list[SheetTxn] | None = None,
) -> T:
    """Run `op(conn, sheet)` in one sheet write transaction (see the module docstring).

    `fields` are the fields whose columns `op` may reference (`sheet.columns(field)`); under the
    exclusive lock they are created and registered first. `op` must be safe to run again from
    scratch (it is, after a rollback). `concurrent`: see the module docstring; `sheet.concurrent`
    tells `op` where its counter deltas go. `group`: the write group the transaction belongs
    to (`write_group`), `keys` the sheet rows it writes. `learned` gets what each attempt
    learned at the lock (the last one's is the committed transaction's).
    """
    fields = list(fields)
    clock = clock if clock is not None else PhaseClock()
    if group is not None and mode == "shared" and not concurrent:
        return await _in_group(port, layout, fields, op, timeout_ms, clock, group, keys)
    repaired = raced = False
    while True:
        try:
            return await _transaction_once(port, layout, fields, op, mode, timeout_ms, clock,
                                           concurrent, learned=learned)
        except _TableNameTaken as exc:
            if raced:
                raise exc.conflict from exc.__cause__
            raced = True  # a concurrent first write of this sheet: its row is there now
        except MissingRelationError:
            if mode == "shared":
                mode = "exclusive"
                clock.column_retries += 1
                continue
            if repaired:
                raise
            repaired = True
            await port.repair_schema()


async def _in_group(
    port: Port, layout: SheetLayout, fields: list[str],
    op: Callable[[Connection, SheetTxn], Awaitable[T]], timeout_ms: int, clock: PhaseClock,
    group: WriteGroup, keys: Sequence[str],
) -> T:
    """One transaction of `group`: in the group's turn when `group.enter` says so and the lock
    statement confirms it, the ordinary way otherwise (`write_group`)."""
    ordinary = False
    while True:
        txn = await group.enter(keys, ordinary=ordinary)
        learned: list[SheetTxn] = []
        committed = False
        try:
            if txn.turn is Turn.GROUP:
                result = await _transaction_once(port, layout, fields, op, "shared", timeout_ms,
                                                 clock, group_token=txn.token, learned=learned)
            else:
                result = await run_sheet_transaction(port, layout, fields, op,
                                                     timeout_ms=timeout_ms, clock=clock,
                                                     learned=learned)
            committed = True
            return result
        except (_NotInTurn, MissingRelationError):
            if txn.turn is Turn.ORDINARY:
                raise
            ordinary = True  # rolled back: run it the ordinary way
        except InsufficientPrivilegeError:
            if txn.turn is Turn.ORDINARY or not folds_by_zeroing(port):
                raise
            # A database session minted before sessions could write deltas: its group's
            # statements are refused; it writes the ordinary way from now on.
            refuse_groups(port)
            ordinary = True
        finally:
            group.leave(txn, committed=committed,
                        writes=learned[-1].writes if committed and learned else None)
