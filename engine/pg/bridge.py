"""The driver bridge: asyncpg's asyncio coroutines run from trio, on a trio-asyncio loop.

How it works
- `Driver` wraps the loop a tenant's connections live on. `call` runs a coroutine as an asyncio
  Task (connect, close, COPY out); `step` drives a statement's coroutine inside the calling trio
  task, which saves a Task and two hops through the loop per statement.
- Cancellation crosses the bridge one way only: trio cancels, the asyncio future is cancelled,
  trio sees `trio.Cancelled`. An `asyncio.CancelledError` that trio did not ask for (the event
  loop shutting down under a call, the driver cancelling its own futures in teardown) would
  escape every `except Exception` as a BaseException; it is raised as `LoopCancelledError`, a
  lost connection. Closing (`close_gracefully`, `terminate`) never raises, whatever state the
  connection or its loop is in.
- Connect attempts wait at most `CONNECT_TIMEOUT`, never past a `connects_until` deadline (a
  run's outage budget), and pin the search path (`PINNED_SEARCH_PATH`). A new connection
  learns the array types runplane binds (`WARM_TYPES`) at once: asyncpg looks up a type it has
  no built-in codec for (three round trips) the first time a statement uses it, which would
  otherwise happen inside the first sheet transaction of every connection, under its lock.

Only `engine.pg` uses this module; it raises the driver's errors untranslated.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import socket
from typing import AsyncIterator, Coroutine, Iterator, TypeVar

import asyncpg
import attrs
import trio
import trio_asyncio

from ..errors import unwrap_single_error
from .pooler import PoolerMode, pooler_mode, without_pooler_param


def _plain_asyncio_outside_trio() -> None:
    """Importing trio_asyncio makes `asyncio.new_event_loop()` build its own (synchronous
    trio) loop in every thread outside trio; asyncio libraries that run their own loop in a
    thread of ours (a `distributed.Client`, for the Dask executor) need a plain asyncio loop
    there. Threads that set a policy of their own still get it; trio contexts are unchanged."""
    from trio_asyncio import _loop

    if _loop._FakedPolicy.policy is None:
        _loop._FakedPolicy.policy = asyncio.DefaultEventLoopPolicy()


_plain_asyncio_outside_trio()

T = TypeVar("T")
DriverCall = Coroutine[object, object, T]  # an asyncpg coroutine answering a T

CONNECT_TIMEOUT = 5.0
# Every connection searches only the system catalog (then its own temporary objects, which no
# other backend sees): runplane's statements qualify every table with the tenant schema, so no
# function, operator, type or table another role creates in `public` or elsewhere can stand in
# for a builtin one (a better-matching `public.unnest(text[])` would otherwise win).
PINNED_SEARCH_PATH = "pg_catalog, pg_temp"
# The array types runplane's statements bind or return that asyncpg has no built-in codec for;
# a new connection introspects them in one go (`Driver.connect`).
WARM_TYPES = ("bigint[]", "integer[]", "jsonb[]", "bytea[]", "double precision[]", "boolean[]")
_WARM = "SELECT " + ", ".join(f"NULL::{name} AS t{i}" for i, name in enumerate(WARM_TYPES))


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



class Driver:
    """The trio-asyncio loop a tenant's connections live on, and the two ways to run asyncpg
    coroutines on it.

    `call` hands a coroutine to the loop as an asyncio Task (trio-asyncio's own bridge): used for
    connect and close. `step` drives a statement's coroutine inside the calling trio task: every
    asyncio future it waits on wakes the task directly, which skips creating a Task and two hops
    through the loop's queue per statement (about a third of a statement's cost here; see
    `benchmarks/receipts.py`). The futures still belong to, and are resolved by, the same loop.
    """

    def __init__(self, loop: trio_asyncio.BaseTrioEventLoop) -> None:
        self.loop = loop

    async def call(self, coro: DriverCall[T]) -> T:
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

    async def step(self, coro: DriverCall[T]) -> T:
        """Run an asyncio coroutine to completion in the current trio task.

        Cancellation follows trio-asyncio's rule: the future being waited on is cancelled, the
        coroutine sees `asyncio.CancelledError` and unwinds, and this raises `trio.Cancelled`.
        An `asyncio.CancelledError` that trio did not cause is raised as `LoopCancelledError`.
        A failure before the coroutine's first wait is raised as `NotSent(error)`.
        """
        task = trio.lowlevel.current_task()
        raise_cancel = None
        to_send: object = None
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

    async def connect(self, dsn: str, *, server_settings: dict[str, str]) -> asyncpg.Connection:
        """One physical connect attempt; raises the driver's error untranslated. It waits at
        most `CONNECT_TIMEOUT`, and never past the deadline of `connects_until`. The search path
        is pinned (`PINNED_SEARCH_PATH`) whatever the DSN or the role's defaults say."""
        timeout = connect_timeout()
        if timeout <= 0:
            raise asyncio.TimeoutError("no connect attempt: the caller's deadline has passed")
        watch = _connect_watch.get()
        if watch is None:
            return await self._connect(dsn, timeout, server_settings)
        with watch.connecting():
            return await self._connect(dsn, timeout, server_settings)

    async def _connect(self, dsn: str, timeout: float,
                       server_settings: dict[str, str]) -> asyncpg.Connection:
        if pooler_mode(dsn) is PoolerMode.TRANSACTION:
            # No session state through the pooler: the checkout's transaction sets the search
            # path, and statements are unnamed (see `engine.pg.pooler`).
            return await self.call(_connect_warm(without_pooler_param(dsn), timeout,
                                                 dict(server_settings), cache_size=0))
        settings = {**server_settings, "search_path": PINNED_SEARCH_PATH}
        return await self.call(_connect_warm(dsn, timeout, settings, cache_size=256))


async def _connect_warm(dsn: str, timeout: float, settings: dict[str, str], *,
                        cache_size: int) -> asyncpg.Connection:
    """asyncpg.connect, then the codecs of `WARM_TYPES` learned (within the same timeout)."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + timeout
    raw = await asyncpg.connect(dsn, timeout=timeout, server_settings=settings,
                                statement_cache_size=cache_size)
    try:
        await raw.fetchrow(_WARM, timeout=max(ends - loop.time(), 0.001))
    except Exception as exc:
        # The query cannot fail on a live connection: this one was lost while being set up
        # (a backend terminated mid-lookup leaves asyncpg in a state error), a connect attempt
        # worth repeating.
        raw.terminate()
        raise ConnectionResetError(f"the connection was lost while it was set up: {exc}") from exc
    except BaseException:
        raw.terminate()
        raise
    return raw


_connect_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "runplane_connect_deadline", default=None)


@attrs.define(eq=False)
class ConnectWatch:
    """The connects of one caller's tasks (a run's): those in flight, and the oldest one given
    up on after `stall_s` without an answer. A server that accepts no connection fails no call
    until a deadline cuts the attempt; a caller tearing down (Ctrl-C) asks `stalled` instead."""

    stall_s: float
    stalled_since: float | None = None
    _in_flight: dict[object, float] = attrs.field(factory=dict, repr=False)

    def stalled(self) -> bool:
        """A connect in flight, or given up on, has gone unanswered for `stall_s`."""
        return self.stalled_at() is not None

    def stalled_at(self) -> float | None:
        """When the oldest connect still unanswered past `stall_s` (in flight, or given up on)
        began, or None when none is."""
        now = trio.current_time()
        starts = [started for started in self._in_flight.values() if now - started >= self.stall_s]
        if self.stalled_since is not None:
            starts.append(self.stalled_since)
        return min(starts, default=None)

    def clear(self) -> None:
        """A call was answered: the server is there."""
        self.stalled_since = None

    @contextlib.contextmanager
    def connecting(self) -> Iterator[None]:
        token, started = object(), trio.current_time()
        self._in_flight[token] = started
        try:
            yield
        except trio.Cancelled:  # the caller gave up on it
            if trio.current_time() - started >= self.stall_s:
                self.stalled_since = started if self.stalled_since is None else min(
                    self.stalled_since, started)
            raise
        finally:
            del self._in_flight[token]


_connect_watch: contextvars.ContextVar[ConnectWatch | None] = contextvars.ContextVar(
    "runplane_connect_watch", default=None)


def watch_connects(watch: ConnectWatch | None) -> contextvars.Token:
    """From now on, connects made by this task and the tasks it starts report to `watch`
    (`reset_connect_watch` with the token undoes it)."""
    return _connect_watch.set(watch)


def reset_connect_watch(token: contextvars.Token) -> None:
    _connect_watch.reset(token)


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
    with unwrap_single_error():
        async with trio_asyncio.open_loop() as loop:
            yield Driver(loop)


def terminate(raw: asyncpg.Connection) -> None:
    """Drop a driver connection at once, without a round trip; never raises. When its event
    loop is already closed the driver cannot schedule its own cleanup, so the socket is shut
    down here (the server sees the client go and rolls back what was open; the descriptor
    closes with the transport: asyncio's socket view has no `close`)."""
    try:
        if not raw.is_closed():
            raw.terminate()
    except Exception:  # its loop is closed: shut the socket down ourselves
        transport = getattr(raw, "_transport", None)
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def reached_locally(raw: asyncpg.Connection) -> bool:
    """Whether `raw` reaches its server on this machine: over a Unix-domain socket or to a
    loopback address (False when its socket cannot be read)."""
    transport = getattr(raw, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    if sock.family == socket.AF_UNIX:
        return True
    try:
        return ipaddress.ip_address(sock.getpeername()[0]).is_loopback
    except (OSError, ValueError, IndexError):
        return False


async def close_gracefully(raw: asyncpg.Connection, driver: Driver,
                           timeout: float = 1.0) -> None:
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
