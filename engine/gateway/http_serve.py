"""Hypercorn's trio worker for the gateway, with a cheaper connection: `serve`.

How it works
- `serve` does what `hypercorn.trio.serve` does for an ASGI application without lifespan
  handlers (the gateway has none): it binds Hypercorn's sockets from the `Config` (TLS
  included), reports the bound addresses through `task_status`, serves every connection with
  Hypercorn's own `TCPServer` and HTTP protocols until `shutdown_trigger` returns, then lets
  connections in flight finish within `config.graceful_timeout`. HTTP parsing and the
  protocol are Hypercorn's and h11's, untouched.
- Each connection is a `_Connection`, Hypercorn's `TCPServer` with these changes to what it
  does around every request on a kept-alive connection (about 14 % of the gateway's CPU for a
  one-row action, docs/guide/benchmarks.md, ninth pass):
  - **The keep-alive timer is one deadline** (`_KeepAliveTimer`), moved when a request starts
    and when its response ends. Hypercorn starts a new timer task after every response and
    cancels it when the next request arrives: a task started and ended per request.
  - **A send takes the connection's send lock without yielding** when nobody holds it, and
    an empty write (h11's end of a response with a content length) sends nothing. Each
    yield is a turn of the event loop; the socket write still yields once, as trio's do.
  - A peer that hangs up ends its connection's timer at once (Hypercorn's timer kept the
    connection's task until the keep-alive ran out).
- Everything else (the idle close after `config.keep_alive_timeout`, a close when the server
  shuts down, the shielded write) behaves as Hypercorn's.
Who calls: `engine.gateway.server.open_server`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Awaitable, Callable

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app


class _KeepAliveTimer:
    """A connection's keep-alive timer: one task, parked in a cancel scope whose deadline
    moves. `restart` (a response ended: close after `keep_alive_timeout` idle) and `stop` (a
    request started: no deadline) keep the interface of Hypercorn's `TrioSingleTask`; `shut_down`
    closes the connection now if it is idle (a request in flight finishes first: Hypercorn
    closes its connection after the response when the server shuts down); `end` stops the
    timer of a connection already closed."""

    def __init__(self, connection: "_Connection") -> None:
        self._connection = connection
        self._scope = trio.CancelScope()
        self._started = self._closed = False

    async def restart(self, task_group: object, action: Callable[[], Awaitable[None]]) -> None:
        self._scope.deadline = trio.current_time() + self._connection.config.keep_alive_timeout
        if self._connection.context.terminated.is_set():
            self._scope.cancel()  # idle while the server shuts down
        if not self._started:
            self._started = True
            self._connection.timers.add(self)
            self._connection._task_group._nursery.start_soon(self._watch)

    async def stop(self) -> None:
        self._scope.deadline = math.inf

    def shut_down(self) -> None:
        if self._scope.deadline != math.inf:
            self._scope.cancel()

    def end(self) -> None:
        self._closed = True
        self._scope.cancel()

    async def _watch(self) -> None:
        with self._scope:
            await trio.sleep_forever()
        self._connection.timers.discard(self)
        if not self._closed:  # idle too long, or the server shuts down
            with trio.CancelScope(shield=True):
                await self._connection._initiate_server_close()


class _Connection(TCPServer):
    """Hypercorn's connection with one keep-alive deadline and sends that do not yield for
    the send lock (module docstring); `timers` holds the keep-alive timers of the server's
    connections, for its shutdown."""

    def __init__(self, timers: set[_KeepAliveTimer], *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.timers = timers
        self.idle_task = _KeepAliveTimer(self)  # type: ignore[assignment]

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            self.idle_task.end()  # the peer is gone: nothing is left to time out

    async def _close(self) -> None:
        self.idle_task.end()
        await super()._close()

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        if not event.data:
            return
        try:
            self.send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self.send_lock.acquire()
        try:
            with trio.CancelScope(shield=True):
                await self.stream.send_all(event.data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.protocol.handle(Closed())
        finally:
            self.send_lock.release()


async def serve(app: Callable, config: Config, *,
                shutdown_trigger: Callable[[], Awaitable[object]],
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI `app` as `config` says until `shutdown_trigger` returns (module
    docstring); `task_status.started` gets the bound URLs (`http://HOST:PORT`, `https://...`)."""
    context = WorkerContext(None)
    sockets = config.create_sockets()
    ssl_context = config.create_ssl_context()
    listeners: list[trio.abc.Listener] = []
    binds = []
    for sock, scheme in [(s, "https") for s in sockets.secure_sockets] + \
            [(s, "http") for s in sockets.insecure_sockets]:
        sock.listen(config.backlog)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        if scheme == "https":
            listener = trio.SSLListener(listener, ssl_context, https_compatible=True)
        listeners.append(listener)
        binds.append(f"{scheme}://{repr_socket_addr(sock.family, sock.getsockname())}")
    timers: set[_KeepAliveTimer] = set()
    handler = partial(_Connection, timers, wrap_app(app, config.wsgi_max_body_size, "asgi"),
                      config, context, ConnectionState({}))
    async with trio.open_nursery() as connections:
        task_status.started(binds)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(raise_shutdown, shutdown_trigger)
                nursery.start_soon(partial(trio.serve_listeners, handler, listeners,
                                           handler_nursery=connections))
        except* ShutdownError:
            pass
        finally:
            await context.terminated.set()
            for timer in list(timers):
                timer.shut_down()
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout


__all__ = ["serve"]
