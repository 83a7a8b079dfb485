"""Our trio adapter over asyncpg: the only module that imports asyncpg or trio_asyncio.

How it works
- asyncpg runs on a trio-asyncio loop; every driver call crosses over with
  `loop.run_aio_coroutine`, and every driver error is translated into `engine.errors` here, with
  its SQLSTATE kept, so nothing above this module sees an asyncpg type.
- A `Connection` wraps one driver connection for one checkout. It follows asyncpg's transaction
  model: `transaction()` issues BEGIN/COMMIT/ROLLBACK at depth zero and SAVEPOINT/RELEASE/ROLLBACK
  TO when already inside a transaction (which is always so under an execution role, where the
  checkout itself opened one).
- Invariant: a connection goes back to the pool only in a known, idle state. Any statement that
  did not end with the server's answer (cancelled mid-flight, a lost connection, a driver-state
  error, anything but an error the server reported) and a ROLLBACK that failed or ran past
  `ROLLBACK_TIMEOUT` mark it `broken`; broken connections are closed on release, never pooled.
- A connection can go stale while idle (in the pool, or between its connect and its first
  statement): when its backend is terminated, the driver may read the server's farewell (which
  leaves its protocol busy: "cannot switch to state 11; another operation (2) is in progress")
  before it sees the socket close, so `is_closed()` cannot tell. The first statement of a
  checkout that the driver refuses without running it (a protocol-state error, raised before
  the statement is written — at most a side-effect-free parse went out — or a closed-connection
  error raised before its first wait) is therefore run again, once, on a fresh connection;
  nothing ran on the server and the checkout had no state yet, so this is safe. Refused later, it raises `StoreUnavailableError` ("the server ended the
  connection before the statement ran"); the connection is broken, never reused.
- Lost commit replies: before the COMMIT of a top-level transaction opened with `transaction()`,
  the transaction's id is read (`txid_current_if_assigned()`; read-only transactions have none),
  unless a statement of the transaction already returned it (`note_transaction_id`: the sheet
  transactions' first statement does, saving the round trip).
  When the connection is lost before COMMIT's reply arrives, a fresh connection asks the server
  for that id's fate (`txid_status`): committed means the transaction took effect exactly once
  and `transaction()` returns normally; aborted raises `StoreUnavailableError` (nothing was
  applied, a retry is safe); an answer that cannot be had raises
  `TransactionStateUnknownError`. A COMMIT that runs past `COMMIT_TIMEOUT` is resolved alike. The probe is not a statement of the operation, so the
  statement hook does not see it.
- COMMIT, ROLLBACK and release run in shielded cancel scopes with deadlines, so teardown always
  finishes and never waits forever.
- Cancellation crosses the bridge one way only: trio cancels, the asyncio future is cancelled,
  trio sees `trio.Cancelled`. An `asyncio.CancelledError` that trio did not ask for (the event
  loop shutting down under a call, the driver cancelling its own futures in teardown) would
  escape every `except Exception` as a BaseException; it is raised as `LoopCancelledError`, a
  lost connection. Closing (`close_gracefully`, `terminate`) never raises, whatever state the
  connection or its loop is in.
- Outages vs errors (`is_outage`): lost connections, shutdown/startup (57P0x) and a server gone
  read-only under a failover (25006) are outages, which runs retry within their budget; a
  statement timeout is one only when its connection dropped with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import signal
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence

import asyncpg
import trio
import trio_asyncio

from .errors import (
    DatabaseError,
    EngineError,
    InsufficientPrivilegeError,
    LockTimeoutError,
    MissingRelationError,
    StatementTimeoutError,
    StoreUnavailableError,
    RollbackFailedError,
    TransactionStateUnknownError,
    leaf_errors,
)


def _plain_asyncio_outside_trio() -> None:
    """Importing trio_asyncio makes `asyncio.new_event_loop()` build its own (synchronous
    trio) loop in every thread outside trio; asyncio libraries that run their own loop in a
    thread of ours (a `distributed.Client`, for the Dask executor) need a plain asyncio loop
    there. Threads that set a policy of their own still get it; trio contexts are unchanged."""
    from trio_asyncio import _loop

    if _loop._FakedPolicy.policy is None:
        _loop._FakedPolicy.policy = asyncio.DefaultEventLoopPolicy()


_plain_asyncio_outside_trio()

ROLLBACK_TIMEOUT = 1.0
COMMIT_TIMEOUT = 10.0
COMMIT_RESOLVE_TIMEOUT = 10.0  # reading a lost COMMIT's outcome on a fresh connection
CONNECT_TIMEOUT = 5.0
# Every connection searches only the system catalog (then its own temporary objects, which no
# other backend sees): runplane's statements qualify every table with the tenant schema, so no
# function, operator, type or table another role creates in `public` or elsewhere can stand in
# for a builtin one (a better-matching `public.unnest(text[])` would otherwise win).
PINNED_SEARCH_PATH = "pg_catalog, pg_temp"

# SQLSTATEs that mean "the connection, not the statement, failed": retry on a fresh one.
TRANSIENT_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "08000", "08003", "08006", "08001", "08004"})
MISSING_RELATION_SQLSTATES = frozenset({"42P01", "42703"})

Record = Any  # rows are read-only mappings/tuples: row["col"] or row[0]


# A promotion or failover in progress: the server went read-only under us (a demoted primary,
# or a standby reached before its promotion) — the writable server is coming, wait for it.
FAILOVER_SQLSTATES = frozenset({"25006"})
STATEMENT_TIMEOUT = "57014"
# Which server this is: a failover or a restart changes it. Reading pg_control_system() may
# need a role that can read server state; the start time alone still tells a restart or
# another server (`SERVER_START`).
SERVER_IDENTITY = ("SELECT system_identifier::text || '/' || pg_postmaster_start_time()::text"
                   " FROM pg_control_system()")
SERVER_START = "SELECT '?/' || pg_postmaster_start_time()::text"
SERVER_CHANGE_PROBE_TIMEOUT = 5.0


def is_outage(sqlstate: str | None, *, connection_lost: bool, server_changed: bool = False
              ) -> bool:
    """Whether a failed statement means the database is away (an outage: retried within the
    run's outage budget) rather than an error of the statement.

    Outages: the connection was lost or could not be made (08xxx, resets: `connection_lost`),
    the server is shutting down, crashing or starting (57P01/57P02/57P03), or it is read-only
    because a failover is under way (25006). A statement timeout (57014) is an outage only when
    the connection dropped with it or the server changed (another system identifier or
    postmaster start time) — a promotion cuts statements short — and otherwise the timeout it
    says. Everything else is the statement's own error."""
    if connection_lost or server_changed:
        return True
    return sqlstate in TRANSIENT_SQLSTATES or sqlstate in FAILOVER_SQLSTATES


def translate(exc: BaseException, *, connection_lost: bool = False,
              server_changed: bool = False) -> EngineError:
    """Map a driver or transport error to ours (the caller chains it with `from`);
    `connection_lost`: the connection was closed by the time the error arrived;
    `server_changed`: the DSN reaches another server than before (see `is_outage`)."""
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = getattr(exc, "sqlstate", None)
        message = f"{exc} (SQLSTATE {sqlstate})"
        lost = connection_lost or isinstance(exc, asyncpg.PostgresConnectionError)
        if is_outage(sqlstate, connection_lost=lost, server_changed=server_changed):
            if sqlstate == STATEMENT_TIMEOUT:
                message = (f"{message}; the server changed (failover or restart)"
                           if server_changed else f"{message}; the connection dropped with it")
            return StoreUnavailableError(message, sqlstate=sqlstate)
        if sqlstate in MISSING_RELATION_SQLSTATES:
            return MissingRelationError(message, sqlstate=sqlstate)
        if sqlstate == STATEMENT_TIMEOUT:
            return StatementTimeoutError(message, sqlstate=sqlstate)
        if sqlstate == "55P03":  # a lock wait past its lock_timeout: retryable
            return LockTimeoutError(message, sqlstate=sqlstate)
        if sqlstate == "42501":
            return InsufficientPrivilegeError(message, sqlstate=sqlstate)
        return DatabaseError(message, sqlstate=sqlstate)
    if isinstance(exc, asyncpg.exceptions.DataError):
        return DatabaseError(f"cannot encode a query argument: {exc}")
    if isinstance(exc, (OSError, asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError,
                        asyncio.TimeoutError, ConnectionError)):
        return StoreUnavailableError(f"connection failed: {exc}")
    raise TypeError(f"not a driver error: {exc!r}")


def _is_driver_error(exc: BaseException) -> bool:
    return isinstance(
        exc,
        (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError,
         OSError, asyncio.TimeoutError),
    )


def _unsent_state_error(exc: BaseException, *, before_first_wait: bool) -> bool:
    """The driver refused a statement because of the connection's state, without executing it:
    a protocol-state error (raised when the driver tries to switch its protocol state, before it
    writes the statement; a parse/describe round trip may have preceded, which has no effect),
    or a closed-connection error raised before the statement's first wait."""
    if isinstance(exc, asyncpg.exceptions.InternalClientError):
        return str(exc).startswith("cannot switch to state")
    return before_first_wait and isinstance(exc, asyncpg.InterfaceError) and \
        not isinstance(exc, asyncpg.exceptions.DataError)


def _server_answered(exc: BaseException) -> bool:
    """A statement error the server reported, after which the connection is idle again."""
    if isinstance(exc, asyncpg.exceptions.DataError):
        return True  # an argument failed to encode before anything was sent
    return (isinstance(exc, asyncpg.PostgresError)
            and not isinstance(exc, asyncpg.PostgresConnectionError)
            and getattr(exc, "sqlstate", None) not in TRANSIENT_SQLSTATES
            and getattr(exc, "sqlstate", None) not in FAILOVER_SQLSTATES)


class LoopCancelledError(ConnectionAbortedError):
    """The asyncio side cancelled a driver call that trio did not cancel: the event loop is
    shutting down or closed, or the driver cancelled its own future while tearing a connection
    down. The connection is gone; to everything above this module it is a lost connection
    (`StoreUnavailableError`), never an `asyncio.CancelledError`, which is a BaseException and
    would pass through every `except Exception` on its way out."""


class NotSent(Exception):
    """Raised by `Driver.step` when the coroutine failed before its first wait: the driver
    refused the statement without waiting for the server. `error` is the driver's error."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def is_transient_connect_error(exc: BaseException) -> bool:
    """Connect failures worth another attempt: refused, reset, timed out, terminated, starting."""
    if isinstance(exc, asyncpg.PostgresError):
        return getattr(exc, "sqlstate", None) in TRANSIENT_SQLSTATES
    if isinstance(exc, asyncpg.exceptions.TargetServerAttributeNotMatched):
        return True  # no host is writable yet: a failover is under way
    return isinstance(exc, (OSError, asyncio.TimeoutError, ConnectionError, asyncpg.InterfaceError))


class Driver:
    """The trio-asyncio loop a tenant's connections live on, and the two ways to run asyncpg
    coroutines on it.

    `call` hands a coroutine to the loop as an asyncio Task (trio-asyncio's own bridge): used for
    connect and close. `step` drives a statement's coroutine inside the calling trio task: every
    asyncio future it waits on wakes the task directly, which skips creating a Task and two hops
    through the loop's queue per statement (about a third of a statement's cost here; see
    `benchmarks/receipts.py`). The futures still belong to, and are resolved by, the same loop.
    """

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    async def call(self, coro: Any) -> Any:
        """Run `coro` as an asyncio Task on the loop. A cancellation that trio did not ask for
        (the loop shutting down, or the driver cancelling its own work in teardown) is raised
        as `LoopCancelledError`, a driver error, never as `asyncio.CancelledError`."""
        if self.loop.is_closed():
            coro.close()
            raise LoopCancelledError("the connection's event loop is closed")
        try:
            return await self.loop.run_aio_coroutine(coro)
        except asyncio.CancelledError as exc:
            raise LoopCancelledError(
                "the event loop cancelled the call (it is shutting down)") from exc

    async def step(self, coro: Any) -> Any:
        """Run an asyncio coroutine to completion in the current trio task.

        Cancellation follows trio-asyncio's rule: the future being waited on is cancelled, the
        coroutine sees `asyncio.CancelledError` and unwinds, and this raises `trio.Cancelled`.
        An `asyncio.CancelledError` that trio did not cause is raised as `LoopCancelledError`.
        A failure before the coroutine's first wait is raised as `NotSent(error)`.
        """
        task = trio.lowlevel.current_task()
        raise_cancel = None
        to_send: Any = None
        to_throw: BaseException | None = None
        first = True
        token = trio_asyncio.current_loop.set(self.loop)  # for asyncio.get_running_loop()
        try:
            while True:
                try:
                    if to_throw is None:
                        waited = coro.send(to_send)
                    else:
                        waited, to_throw = coro.throw(to_throw), None
                except StopIteration as stop:
                    return stop.value
                except asyncio.CancelledError as exc:
                    if raise_cancel is not None:
                        raise_cancel()  # trio cancelled us: raise trio.Cancelled
                    raise LoopCancelledError(
                        "the driver cancelled the statement (its connection or loop is "
                        "closing)") from exc
                except Exception as exc:
                    if first:
                        raise NotSent(exc) from exc
                    raise
                first = False
                to_send = None
                if waited is None:  # a bare yield (asyncio.sleep(0)): let others run
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    continue
                if not getattr(waited, "_asyncio_future_blocking", False):
                    to_throw = RuntimeError(f"asyncpg yielded {waited!r}, not an asyncio future")
                    continue
                waited._asyncio_future_blocking = False
                if waited.done():
                    continue
                waited.add_done_callback(lambda _: trio.lowlevel.reschedule(task))

                def abort(raise_cancel_arg, future=waited):
                    nonlocal raise_cancel
                    raise_cancel = raise_cancel_arg
                    future.cancel()  # the coroutine unwinds when it next runs
                    return trio.lowlevel.Abort.FAILED

                await trio.lowlevel.wait_task_rescheduled(abort)
        finally:
            trio_asyncio.current_loop.reset(token)

    async def connect(self, dsn: str, *, server_settings: dict[str, str]) -> Any:
        """One physical connect attempt; raises the driver's error untranslated. It waits at
        most `CONNECT_TIMEOUT`, and never past the deadline of `connects_until`. The search path
        is pinned (`PINNED_SEARCH_PATH`) whatever the DSN or the role's defaults say."""
        timeout = connect_timeout()
        if timeout <= 0:
            raise asyncio.TimeoutError("no connect attempt: the caller's deadline has passed")
        settings = {**server_settings, "search_path": PINNED_SEARCH_PATH}
        return await self.call(
            asyncpg.connect(
                dsn, timeout=timeout, server_settings=settings,
                statement_cache_size=256,
            )
        )


_connect_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "runplane_connect_deadline", default=None)


@contextlib.contextmanager
def connects_until(deadline: float | None) -> Iterator[None]:
    """Connect attempts made in the block (by this task and the tasks it starts) wait no later
    than trio time `deadline`, and the connect ladder's pauses are cut to it; past it a connect
    fails at once, as a timed-out one. A run's outage budget is kept this way: connects that
    time out count against it, they do not stretch it."""
    token = _connect_deadline.set(deadline)
    try:
        yield
    finally:
        _connect_deadline.reset(token)


def connect_timeout() -> float:
    """How long the next connect attempt may wait (<= 0: it may not start)."""
    deadline = _connect_deadline.get()
    if deadline is None:
        return CONNECT_TIMEOUT
    return min(CONNECT_TIMEOUT, deadline - trio.current_time())


def ladder_delay(delay: float) -> float:
    """The pause before the connect ladder's next attempt, cut to the `connects_until` deadline."""
    deadline = _connect_deadline.get()
    if deadline is None:
        return delay
    return max(0.0, min(delay, deadline - trio.current_time()))


@contextlib.asynccontextmanager
async def open_driver() -> AsyncIterator[Driver]:
    """Use the running trio-asyncio loop, or open one for the block's duration.

    `trio_asyncio.open_loop` wraps what escapes it in an exception group; a lone error is
    unwrapped so callers can catch one typed error.
    """
    loop = trio_asyncio.current_loop.get()
    if loop is not None and not loop.is_closed():
        yield Driver(loop)
        return
    try:
        async with trio_asyncio.open_loop() as loop:
            yield Driver(loop)
    except BaseExceptionGroup as group:
        leaves = leaf_errors(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


StatementHook = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]

# Crash-anywhere harness only (`simulations.crash_anywhere` sets it in a child process): with
# RUNPLANE_CRASH_AT_STATEMENT=k the process counts the statements it sends and kills itself with
# SIGKILL just before the k-th (k=0: count only, see `statements_sent`).
_CRASH_AT = os.environ.get("RUNPLANE_CRASH_AT_STATEMENT")
_sent = 0


def _crash_boundary(sql: str) -> None:
    global _sent
    _sent += 1
    if _sent == int(_CRASH_AT or 0):
        where = " ".join(sql.split())[:100]
        os.write(2, f"crash-anywhere: SIGKILL before statement {_sent}: {where}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def statements_sent() -> int:
    """Statements this process sent, when RUNPLANE_CRASH_AT_STATEMENT is set (else 0)."""
    return _sent


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


Reconnect = Callable[[], Awaitable[Any]]        # a fresh raw connection
CommitStatus = Callable[[str], Awaitable[str | None]]  # txid -> committed|aborted|in progress|None
ServerChanged = Callable[[], Awaitable[bool]]  # is the DSN's server another one than at open?

XID_PROBE = "SELECT txid_current_if_assigned()::text"


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

    def __init__(self, raw: Any, driver: Driver, *, reconnect: Reconnect | None = None,
                 commit_status: CommitStatus | None = None,
                 server_changed: ServerChanged | None = None) -> None:
        self._raw = raw
        self._driver = driver
        self._depth = 0  # transactions/savepoints we opened
        self._reconnect = reconnect  # cleared after the first statement
        self._commit_status = commit_status
        self._server_changed = server_changed
        self._resolve_commit = False  # an explicit transaction() is open at the top level
        self._xid: str | None = None  # the open transaction's id, when a statement returned it
        self.broken = False
        self.statement_hook: StatementHook | None = None

    # -- queries ---------------------------------------------------------------------------
    async def _statement(self, sql: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if _CRASH_AT is not None:
            _crash_boundary(sql)
        if self.statement_hook is None:
            return await self._send(method, args, kwargs)
        return await self.statement_hook(sql, functools.partial(self._send, method, args, kwargs))

    async def _send(self, method: str, args: tuple, kwargs: dict | None = None) -> Any:
        """Run one driver call; the one choke point every statement passes."""
        if self.broken:
            raise StoreUnavailableError("connection was closed after an earlier failure")
        reconnect, self._reconnect = self._reconnect, None
        try:
            return await self._driver.step(getattr(self._raw, method)(*args, **(kwargs or {})))
        except trio.Cancelled:
            # The server may still be running the statement: the state is unknown.
            self.broken = True
            raise
        except BaseException as raised:
            exc, before_first_wait = (
                (raised.error, True) if isinstance(raised, NotSent) else (raised, False))
            self._fail(exc)
            if not _unsent_state_error(exc, before_first_wait=before_first_wait):
                if not _is_driver_error(exc):
                    if exc is raised:
                        raise
                    raise exc from None
                lost = self._raw.is_closed()
                changed = not lost and getattr(exc, "sqlstate", None) == STATEMENT_TIMEOUT \
                    and await self._probe_server_changed()
                if changed:
                    self.broken = True
                raise translate(exc, connection_lost=lost, server_changed=changed) from exc
            if reconnect is None:
                raise StoreUnavailableError(
                    f"the server ended the connection before the statement ran ({exc})") from exc
        # A stale connection, and the checkout's first statement (see the module docstring):
        # nothing was run on it and nothing depends on it, so run the statement on a fresh one.
        terminate(self._raw)
        self._raw = await reconnect()
        self.broken = False
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
        if not _server_answered(exc) or self._raw.is_closed():
            self.broken = True

    async def execute(self, sql: str, *args: Any) -> str:
        return await self._statement(sql, "execute", sql, *args)

    async def fetch(self, sql: str, *args: Any) -> list[Record]:
        return await self._statement(sql, "fetch", sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> Record | None:
        return await self._statement(sql, "fetchrow", sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await self._statement(sql, "fetchval", sql, *args)

    async def copy_records(
        self, table: str, records: Sequence[Sequence[Any]], *, columns: Sequence[str], schema: str
    ) -> str:
        """COPY `records` into `schema.table` (binary protocol: the fastest bulk path)."""
        return await self._statement(
            f"COPY {schema}.{table}", "copy_records_to_table", table,
            records=records, columns=list(columns), schema_name=schema,
        )

    async def copy_out(self, sql: str, *args: Any, output: Callable[[bytes], Awaitable[Any]],
                       **options: Any) -> str:
        """`COPY (sql) TO STDOUT`, each chunk handed to `output` as it arrives (constant
        memory); `options` are COPY's (`format`, `delimiter`, `quote`, ...). It runs as an
        asyncio task (asyncpg's COPY needs one), so `output` must not call trio."""
        if self.broken:
            raise StoreUnavailableError("connection was closed after an earlier failure")
        self._reconnect = None
        try:
            return await self._driver.call(
                self._raw.copy_from_query(sql, *args, output=output, **options))
        except trio.Cancelled:
            self.broken = True  # the server may still be sending: the state is unknown
            raise
        except BaseException as exc:
            self._fail(exc)
            if _is_driver_error(exc):
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
    def transaction(self, *, on_phase: PhaseReport | None = None
                    ) -> contextlib.AbstractAsyncContextManager["Connection"]:
        """BEGIN…COMMIT, or a SAVEPOINT when already inside a transaction.

        `on_phase`, when given, is called as `on_phase(phase, seconds, failed)` after the
        statement that opens the transaction (`"begin"`) and after the one that commits it
        (`"commit"`), whether they succeeded or raised; a rollback is not reported.
        A lost COMMIT reply is resolved (see the module docstring).
        """
        return self._transaction(on_phase, resolve=True)

    def checkout_transaction(self) -> contextlib.AbstractAsyncContextManager["Connection"]:
        """The transaction a checkout opens under an execution role. Its COMMIT's reply is
        resolved only when an explicit `transaction()` ran inside it (single statements are
        idempotent by construction, and need no extra round trip)."""
        return self._transaction(None, resolve=False)

    @contextlib.asynccontextmanager
    async def _transaction(self, on_phase: PhaseReport | None, *, resolve: bool
                           ) -> AsyncIterator["Connection"]:
        top = not self.in_transaction
        if not top:
            name = f"runplane_sp_{self._depth}"
            begin, commit, rollback = (
                f"SAVEPOINT {name}", f"RELEASE SAVEPOINT {name}", f"ROLLBACK TO SAVEPOINT {name}"
            )
        else:
            begin, commit, rollback = "BEGIN", "COMMIT", "ROLLBACK"
            self._resolve_commit = False
            self._xid = None
        with _timed(on_phase, "begin"):
            await self.execute(begin)
        self._depth += 1
        if resolve:
            self._resolve_commit = True
        try:
            yield self
        except BaseException as exc:
            self._depth -= 1
            await self._roll_back(rollback, exc)
            raise
        self._depth -= 1
        with _timed(on_phase, "commit"):
            if top:
                await self._commit()
            else:
                await self._finish(commit)

    async def _commit(self) -> None:
        """COMMIT a top-level transaction, resolving a lost reply when asked to."""
        xid = None
        if self._resolve_commit and self._commit_status is not None:
            xid = self._xid
            if xid is None:
                xid = await self._send("fetchval", (XID_PROBE,))  # not an operation statement
        self._resolve_commit = False
        self._xid = None
        try:
            await self._finish("COMMIT")
        except (StoreUnavailableError, TransactionStateUnknownError) as lost:
            if xid is None:
                raise
            await self._resolve_lost_commit(xid, lost)

    async def _resolve_lost_commit(self, xid: str, lost: EngineError) -> None:
        """COMMIT's reply was lost, or it ran past `COMMIT_TIMEOUT`: read the fate of `xid` on
        a fresh connection (this one is dropped first, so its backend finishes on its own)."""
        self.close()
        assert self._commit_status is not None
        status: str | None = "in progress"
        try:
            with trio.CancelScope(shield=True,
                                  deadline=trio.current_time() + COMMIT_RESOLVE_TIMEOUT):
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

    async def _finish(self, commit: str) -> None:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + COMMIT_TIMEOUT) as scope:
            await self.execute(commit)  # only our own deadline can cancel this scope
        if scope.cancelled_caught:
            self.broken = True
            raise TransactionStateUnknownError(
                f"{commit} did not finish within {COMMIT_TIMEOUT}s; connection closed",
                error=TimeoutError(commit),
                rollback_error=TimeoutError(commit),
            )

    async def _roll_back(self, rollback: str, exc: BaseException) -> None:
        """Roll back after `exc`; on failure close the connection and raise the typed error."""
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
        self.broken = True
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
        self.broken = True
        terminate(self._raw)

    @property
    def raw(self) -> Any:
        return self._raw


def terminate(raw: Any) -> None:
    """Drop a driver connection at once, without a round trip; never raises. When its event
    loop is already closed the driver cannot schedule its own cleanup, so the socket is closed
    here (the server sees the client go and rolls back what was open)."""
    try:
        if not raw.is_closed():
            raw.terminate()
    except Exception:  # its loop is closed: close the socket ourselves
        transport = getattr(raw, "_transport", None)
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


async def close_gracefully(raw: Any, driver: Driver, timeout: float = 1.0) -> None:
    """Close a driver connection politely (Terminate message, wait for the server to hang up)
    within `timeout`, else drop it. Never raises, whatever state the connection is in: being
    closed by someone else, cancelled mid-statement, its backend terminated, or its event loop
    shutting down."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + timeout):
        try:
            await driver.call(raw.close(timeout=timeout))
        except Exception:  # closing is best effort; what failed is dropped below
            pass
    terminate(raw)
