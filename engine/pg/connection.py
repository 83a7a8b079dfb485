"""Connections and transactions: one checked-out driver connection, in a known state.

How it works
- A `Connection` wraps one driver connection for one checkout. It follows asyncpg's transaction
  model: `transaction()` issues BEGIN/COMMIT/ROLLBACK at depth zero and SAVEPOINT/RELEASE/ROLLBACK
  TO when already inside a transaction (which is always so under an execution role, where the
  checkout itself opened one).
- Invariant: a connection goes back to the pool only in a known, idle state. Its state is one
  field (`Connection.state`, a `ConnectionState`): `FRESH` until the checkout's first statement,
  then `IDLE`, `IN_TRANSACTION` while a top-level transaction of ours is open (`RESOLVING`
  once an explicit `transaction()` ran in it: its COMMIT's reply is resolved, see below), and
  `BROKEN` for good. Any statement that did not end with the server's answer (cancelled
  mid-flight, a lost connection, a driver-state error, anything but an error the server
  reported) and a ROLLBACK that failed or ran past `ROLLBACK_TIMEOUT` make it `BROKEN`; broken
  connections are closed on release, never pooled.
- A connection can go stale while idle (in the pool, or between its connect and its first
  statement): when its backend is terminated, the driver may read the server's farewell (which
  leaves its protocol busy: "cannot switch to state 11; another operation (2) is in progress")
  before it sees the socket close, so `is_closed()` cannot tell. The first statement of a
  checkout that the driver refuses without running it (a protocol-state error, raised before
  the statement is written — at most a side-effect-free parse went out — or a closed-connection
  error raised before its first wait) is therefore run again, once, on a fresh connection;
  nothing ran on the server and the checkout had no state yet, so this is safe. Refused later,
  it raises `StoreUnavailableError` ("the server ended the connection before the statement
  ran"); the connection is broken, never reused.
- Lost commit replies: before the COMMIT of a top-level transaction opened with `transaction()`,
  the transaction's id is read (`txid_current_if_assigned()`; read-only transactions have none),
  unless a statement of the transaction already returned it (`note_transaction_id`: the sheet
  transactions' first statement does, saving the round trip).
  When the connection is lost before COMMIT's reply arrives, a fresh connection asks the server
  for that id's fate (`txid_status`): committed means the transaction took effect exactly once
  and `transaction()` returns normally; aborted raises `StoreUnavailableError` (nothing was
  applied, a retry is safe); an answer that cannot be had raises
  `TransactionStateUnknownError`. A COMMIT that runs past `COMMIT_TIMEOUT` is resolved alike.
  The probe is not a statement of the operation, so the statement hook does not see it.
- COMMIT, ROLLBACK and release run in shielded cancel scopes with deadlines, so teardown always
  finishes and never waits forever. A COMMIT (and the reading of its fate) is not waited on past
  a deadline of the caller's that is still ahead when it starts (`_caller_bound`: a run's
  cut-off of an attempt the database leaves unanswered, a gateway write's deadline): past it
  the outcome is unknown (`TransactionStateUnknownError`) rather than late.

Only the tenant builds connections; engine operations receive them from a checkout.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import asyncpg
import trio

from ..errors import (
    EngineError,
    RollbackFailedError,
    StoreUnavailableError,
    TransactionStateUnknownError,
)
from ..observability import metrics
from .bridge import Driver, NotSent, terminate
from .translation import (
    STATEMENT_TIMEOUT,
    is_driver_error,
    server_answered,
    translate,
    unsent_state_error,
)

ROLLBACK_TIMEOUT = 1.0
COMMIT_TIMEOUT = 10.0
COMMIT_RESOLVE_TIMEOUT = 10.0  # reading a lost COMMIT's outcome on a fresh connection

Record = asyncpg.Record  # rows are read-only mappings/tuples: row["col"] or row[0]
RawConnection = asyncpg.Connection  # the driver's connection a `Connection` wraps

# Which server this is: a failover or a restart changes it. Reading pg_control_system() may
# need a role that can read server state; the start time alone still tells a restart or
# another server (`SERVER_START`).
SERVER_IDENTITY = ("SELECT system_identifier::text || '/' || pg_postmaster_start_time()::text"
                   " FROM pg_control_system()")
SERVER_START = "SELECT '?/' || pg_postmaster_start_time()::text"
SERVER_CHANGE_PROBE_TIMEOUT = 5.0

# hook(sql, send): what `send()` answers is passed along, unseen (a statement's result)
StatementHook = Callable[[str, Callable[[], Awaitable[object]]], Awaitable[object]]

PhaseReport = Callable[[str, float, bool], None]  # (phase, seconds, failed)


@contextlib.contextmanager
def _timed(report: PhaseReport | None, phase: str) -> Iterator[None]:
    """Report how long the block took, and whether it raised, to `report` (if any)."""
    if report is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    except BaseException:
        report(phase, time.perf_counter() - started, True)
        raise
    report(phase, time.perf_counter() - started, False)


Reconnect = Callable[[], Awaitable[RawConnection]]  # a fresh raw connection
CommitStatus = Callable[[str], Awaitable[str | None]]  # txid -> committed|aborted|in progress|None
ServerChanged = Callable[[], Awaitable[bool]]  # is the DSN's server another one than at open?

XID_PROBE = "SELECT txid_current_if_assigned()::text"


class ConnectionState(enum.Enum):
    """Where one checkout's connection is (see the module docstring); `BROKEN` is final."""

    FRESH = "fresh"  # no statement yet: a stale connection may still be replaced
    IDLE = "idle"  # no top-level transaction of ours is open
    IN_TRANSACTION = "in transaction"  # ours is open; a lost COMMIT reply is not resolved
    RESOLVING = "in transaction, commit resolved"  # an explicit transaction() ran inside it
    BROKEN = "broken"  # its state is unknown: closed on release, never pooled


def _caller_bound() -> float:
    """The caller's deadline (`trio.current_effective_deadline()`, read before any shield of
    ours) if it is still ahead, else infinity: a caller already cancelled does not shorten a
    COMMIT, which then finishes as before."""
    outer = trio.current_effective_deadline()
    return outer if outer > trio.current_time() else math.inf


class Connection:
    """One checked-out connection. Not shared between tasks; valid until its checkout ends.

    `statement_hook`, when set, is awaited as `hook(sql, send)` around every statement (BEGIN,
    COMMIT and savepoints included); it must `await send()` to run the statement, and may delay,
    raise or cancel before or after. Tests and simulations install hooks (see
    `simulations.ports`) to count round trips and inject faults; engine code never does.

    `reconnect` replaces a stale connection on the checkout's first statement (see the module
    docstring); `commit_status` reads a transaction's fate on
    a fresh connection when a COMMIT's reply was lost (both supplied by the tenant).
    """

    def __init__(self, raw: RawConnection, driver: Driver, *, reconnect: Reconnect | None = None,
                 commit_status: CommitStatus | None = None,
                 server_changed: ServerChanged | None = None) -> None:
        self._raw = raw
        self._driver = driver
        self._state = ConnectionState.FRESH
        self._depth = 0  # transactions/savepoints we opened (their names count it)
        self._reconnect = reconnect  # used only while FRESH
        self._commit_status = commit_status
        self._server_changed = server_changed
        self._xid: str | None = None  # the open transaction's id, when a statement returned it
        self.statement_hook: StatementHook | None = None
        self.lane = "other"  # the checkout's lane (`runplane_statement_seconds`), set by the tenant

    @property
    def state(self) -> ConnectionState:
        return self._state

    @property
    def broken(self) -> bool:
        return self._state is ConnectionState.BROKEN

    def _settle(self, state: ConnectionState) -> None:
        """Move to `state`, unless the connection is broken (which it stays)."""
        if self._state is not ConnectionState.BROKEN:
            self._state = state

    # -- queries ---------------------------------------------------------------------------
    async def _statement(self, sql: str, method: str, *args: object,
                         **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            if self.statement_hook is None:
                return await self._send(method, args, kwargs)
            return await self.statement_hook(sql, functools.partial(self._send, method, args,
                                                                    kwargs))
        finally:
            metrics.statement_seconds(self.lane, sql, time.perf_counter() - started)

    async def _send(self, method: str, args: tuple[object, ...],
                    kwargs: dict[str, object] | None = None) -> object:
        """Run one driver call; the one choke point every statement passes."""
        if self._state is ConnectionState.BROKEN:
            raise StoreUnavailableError("connection was closed after an earlier failure")
        fresh = self._state is ConnectionState.FRESH
        if fresh:
            self._state = ConnectionState.IDLE
        try:
            return await self._driver.step(getattr(self._raw, method)(*args, **(kwargs or {})))
        except trio.Cancelled:
            # The server may still be running the statement: the state is unknown.
            self._state = ConnectionState.BROKEN
            raise
        except BaseException as raised:
            exc, before_first_wait = (
                (raised.error, True) if isinstance(raised, NotSent) else (raised, False))
            self._fail(exc)
            if not unsent_state_error(exc, before_first_wait=before_first_wait):
                if not is_driver_error(exc):
                    if exc is raised:
                        raise
                    raise exc from None
                lost = self._raw.is_closed()
                changed = not lost and getattr(exc, "sqlstate", None) == STATEMENT_TIMEOUT \
                    and await self._probe_server_changed()
                if changed:
                    self._state = ConnectionState.BROKEN
                raise translate(exc, connection_lost=lost, server_changed=changed) from exc
            if not fresh or self._reconnect is None:
                raise StoreUnavailableError(
                    f"the server ended the connection before the statement ran ({exc})") from exc
        # A stale connection, and the checkout's first statement (see the module docstring):
        # nothing was run on it and nothing depends on it, so run the statement on a fresh one.
        terminate(self._raw)
        self._raw = await self._reconnect()
        self._state = ConnectionState.IDLE
        return await self._send(method, args, kwargs)

    async def _probe_server_changed(self) -> bool:
        """After a statement timeout on a live connection: did the server change under it (a
        failover behind a proxy or pooler)? A server that cannot be asked counts as changed."""
        if self._server_changed is None:
            return False
        with trio.move_on_after(SERVER_CHANGE_PROBE_TIMEOUT):
            try:
                return await self._server_changed()
            except EngineError:
                return True
        return True

    def _fail(self, exc: BaseException) -> None:
        """After a failed statement: keep the connection only when the server answered."""
        if not server_answered(exc) or self._raw.is_closed():
            self._state = ConnectionState.BROKEN

    # Bind values (`*args`) are anything the driver encodes for the statement's parameters.
    async def execute(self, sql: str, *args: object) -> str:
        return await self._statement(sql, "execute", sql, *args)

    async def fetch(self, sql: str, *args: object) -> list[Record]:
        return await self._statement(sql, "fetch", sql, *args)

    async def fetchrow(self, sql: str, *args: object) -> Record | None:
        return await self._statement(sql, "fetchrow", sql, *args)

    async def fetchval(self, sql: str, *args: object) -> Any:  # the driver's value, untyped
        return await self._statement(sql, "fetchval", sql, *args)

    async def copy_out(self, sql: str, *args: object,
                       output: Callable[[bytes], Awaitable[object]], **options: str) -> str:
        """`COPY (sql) TO STDOUT`, each chunk handed to `output` as it arrives (constant
        memory); `options` are COPY's (`format`, `delimiter`, `quote`, ...). It runs as an
        asyncio task (asyncpg's COPY needs one), so `output` must not call trio."""
        if self._state is ConnectionState.BROKEN:
            raise StoreUnavailableError("connection was closed after an earlier failure")
        if self._state is ConnectionState.FRESH:
            self._state = ConnectionState.IDLE
        try:
            return await self._driver.call(
                self._raw.copy_from_query(sql, *args, output=output, **options))
        except trio.Cancelled:
            # the server may still be sending: the state is unknown
            self._state = ConnectionState.BROKEN
            raise
        except BaseException as exc:
            self._fail(exc)
            if is_driver_error(exc):
                raise translate(exc) from exc
            raise

    def note_transaction_id(self, xid: str) -> None:
        """Tell the open top-level transaction its id (`txid_current()::text`, read by one of
        its own statements), so that COMMIT needs no extra round trip to learn it."""
        if self.in_transaction:
            self._xid = xid

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0 or self._raw.is_in_transaction()

    @property
    def backend_pid(self) -> int:
        return self._raw.get_server_pid()

    # -- transactions ----------------------------------------------------------------------
    def transaction(self, *, on_phase: PhaseReport | None = None, begin_with: str = ""
                    ) -> contextlib.AbstractAsyncContextManager["Connection"]:
        """BEGIN…COMMIT, or a SAVEPOINT when already inside a transaction.

        `on_phase`, when given, is called as `on_phase(phase, seconds, failed)` after the
        statement that opens the transaction (`"begin"`) and after the one that commits it
        (`"commit"`), whether they succeeded or raised; a rollback is not reported.
        `begin_with`: SQL without bind values (such as `SET LOCAL`s) sent in the same message
        as BEGIN (or SAVEPOINT): it runs first inside, at no extra round trip.
        A lost COMMIT reply is resolved (see the module docstring).
        """
        return self._transaction(on_phase, resolve=True, begin_with=begin_with)

    def checkout_transaction(self) -> contextlib.AbstractAsyncContextManager["Connection"]:
        """The transaction a checkout opens under an execution role. Its COMMIT's reply is
        resolved only when an explicit `transaction()` ran inside it (single statements are
        idempotent by construction, and need no extra round trip)."""
        return self._transaction(None, resolve=False)

    @contextlib.asynccontextmanager
    async def _transaction(self, on_phase: PhaseReport | None, *, resolve: bool,
                           begin_with: str = "") -> AsyncIterator["Connection"]:
        top = not self.in_transaction
        if not top:
            name = f"runplane_sp_{self._depth}"
            begin, commit, rollback = (
                f"SAVEPOINT {name}", f"RELEASE SAVEPOINT {name}", f"ROLLBACK TO SAVEPOINT {name}"
            )
        else:
            begin, commit, rollback = "BEGIN", "COMMIT", "ROLLBACK"
            self._xid = None
        with _timed(on_phase, "begin"):
            await self.execute(f"{begin};\n{begin_with}" if begin_with else begin)
        self._depth += 1
        if top:
            self._settle(ConnectionState.RESOLVING if resolve else ConnectionState.IN_TRANSACTION)
        elif resolve and self._state is ConnectionState.IN_TRANSACTION:
            self._state = ConnectionState.RESOLVING
        try:
            yield self
        except BaseException as exc:
            self._depth -= 1
            try:
                await self._roll_back(rollback, exc)
            finally:
                if top:
                    self._settle(ConnectionState.IDLE)
            raise
        self._depth -= 1
        with _timed(on_phase, "commit"):
            if top:
                await self._commit()
            else:
                await self._finish(commit)

    async def _commit(self) -> None:
        """COMMIT a top-level transaction, resolving a lost reply when asked to."""
        bound = _caller_bound()
        xid = None
        if self._state is ConnectionState.RESOLVING and self._commit_status is not None:
            xid = self._xid
            if xid is None:
                xid = await self._send("fetchval", (XID_PROBE,))  # not an operation statement
        self._settle(ConnectionState.IDLE)
        self._xid = None
        try:
            await self._finish("COMMIT", bound)
        except (StoreUnavailableError, TransactionStateUnknownError) as lost:
            if xid is None:
                raise
            await self._resolve_lost_commit(xid, lost, bound)

    async def _resolve_lost_commit(self, xid: str, lost: EngineError,
                                   bound: float = math.inf) -> None:
        """COMMIT's reply was lost, or it ran past `COMMIT_TIMEOUT`: read `xid`'s fate on a fresh
        connection (this one dropped first); shielded only for a caller already cancelled (a
        cancel during the read, Ctrl-C while a connect hangs, ends it: writes are idempotent)."""
        self.close()
        assert self._commit_status is not None
        status: str | None = "in progress"
        shield = trio.current_effective_deadline() == -math.inf  # the caller is cancelled
        deadline = min(trio.current_time() + COMMIT_RESOLVE_TIMEOUT, bound)
        try:
            with trio.CancelScope(shield=shield, deadline=deadline):
                status = await self._commit_status(xid)
        except EngineError as probe_error:
            raise TransactionStateUnknownError(
                f"COMMIT's reply was lost ({lost}) and its outcome could not be read "
                f"({probe_error})", error=lost, rollback_error=probe_error,
            ) from lost
        if status == "committed":
            return  # it took effect, exactly once
        if status == "aborted":
            raise StoreUnavailableError(
                f"connection lost at COMMIT; the transaction was rolled back ({lost})",
                sqlstate=getattr(lost, "sqlstate", None),
            ) from lost
        unknown = TimeoutError(f"transaction {xid} is {status or 'unknown to the server'}")
        raise TransactionStateUnknownError(
            f"COMMIT's reply was lost ({lost}) and the transaction's outcome is not known yet "
            f"({unknown})", error=lost, rollback_error=unknown,
        ) from lost

    async def _finish(self, commit: str, bound: float = math.inf) -> None:
        started = trio.current_time()
        deadline = min(started + COMMIT_TIMEOUT, bound)
        with trio.CancelScope(shield=True, deadline=deadline) as scope:
            await self.execute(commit)  # only our own deadline can cancel this scope
        if scope.cancelled_caught:
            self._state = ConnectionState.BROKEN
            raise TransactionStateUnknownError(
                f"{commit} did not finish within {deadline - started:.1f}s; connection closed",
                error=TimeoutError(commit),
                rollback_error=TimeoutError(commit),
            )

    async def _roll_back(self, rollback: str, exc: BaseException) -> None:
        """Roll back after `exc`; on failure close the connection and raise the typed error:
        `StoreUnavailableError` when the connection was lost (the server rolled back), else
        `RollbackFailedError` (a ROLLBACK that failed or did not answer: never retried)."""
        if self.broken:
            return  # closing the connection rolls the server side back
        rollback_error: BaseException | None = None
        with trio.CancelScope(shield=True, deadline=trio.current_time() + ROLLBACK_TIMEOUT) as scope:
            try:
                await self.execute(rollback)
            except EngineError as error:
                rollback_error = error
        if scope.cancelled_caught:
            rollback_error = TimeoutError(f"{rollback} took over {ROLLBACK_TIMEOUT}s")
        if rollback_error is None:
            return
        self._state = ConnectionState.BROKEN
        if isinstance(rollback_error, StoreUnavailableError) and isinstance(exc, Exception):
            # The server ended the connection before COMMIT was sent: it rolled the transaction
            # back itself, so the outcome is known (nothing was written) and this is an outage.
            raise StoreUnavailableError(
                f"the connection was lost while rolling back after {exc!r} ({rollback_error}); "
                "nothing was committed", sqlstate=getattr(rollback_error, "sqlstate", None),
            ) from exc
        if isinstance(exc, Exception):
            raise RollbackFailedError(
                f"operation failed ({exc!r}) and {rollback} failed too ({rollback_error!r}); "
                "connection closed",
                error=exc,
                rollback_error=rollback_error,
            ) from exc

    # -- lifecycle (used by the tenant pool) -----------------------------------------------
    def is_reusable(self) -> bool:
        return not self.broken and not self._raw.is_closed() and not self._raw.is_in_transaction()

    def close(self) -> None:
        """Close at once without a round trip (the server rolls back what was open)."""
        self._state = ConnectionState.BROKEN
        terminate(self._raw)

    @property
    def raw(self) -> RawConnection:
        return self._raw

