"""Hypercorn's trio worker for the gateway, with a cheaper connection: `serve`.

How it works
- `serve` does what `hypercorn.trio.serve` does for an ASGI application without lifespan
  handlers (the gateway has none): it binds Hypercorn's sockets from the `Config` (TLS
  included), reports the bound addresses through `task_status`, serves every connection with
  Hypercorn's own `TCPServer` and HTTP protocols until `shutdown_trigger` returns, then lets
  connections in flight finish within `config.graceful_timeout`. HTTP parsing and the
  protocol are Hypercorn's and h11's, untouched.
- Each connection is a `_Connection`, Hypercorn's `TCPServer` with these changes to what it
  does around every request on a kept-alive connection (each a turn of the event loop or a
  task saved; a turn costs the gateway an `epoll_wait` and the scheduler's pass;
  docs/guide/benchmarks.md, ninth and tenth passes):
  - **The keep-alive timer is one task a connection** (`_KeepAliveTimer`) that sleeps until
    the connection may have been idle that long; a request's start and its response's end
    only note the time. Hypercorn starts a new timer task after every response and cancels it
    when the next request arrives.
  - **A request's body is handed over without a turn** (`_TaskGroup`): the connection puts
    the body and its end into the application's queue, and the application takes them,
    without yielding while the queue has room or a message (Hypercorn's queue yields on
    every put and take); a full or empty queue waits as before.
  - **A send takes the connection's send lock without yielding** when nobody holds it, and
    an empty write (h11's end of a response with a content length) sends nothing. The socket
    write still yields once, as trio's do.
  - **A response's head goes out with its body, in one write**, when it declares a non-zero
    content length (every action's answer does): Hypercorn writes the head when the
    application starts the response and the body when it sends it, two writes that reach the
    client as two segments (two wake-ups of the client and a system call more on each side).
    Such a head is held until the connection's next event — its body, or the empty end of a
    body that is suppressed (a `HEAD` request) — and written with it. A head without a length
    (a stream: the console's live pages) is written at once, as before.
  - A peer that hangs up ends its connection's timer at once (Hypercorn's timer kept the
    connection's task until the keep-alive ran out).
- Everything else (the idle close after `config.keep_alive_timeout`, a close when the server
  shuts down, the shielded write) behaves as Hypercorn's.
Who calls: `engine.gateway.server.open_server`.
"""

from __future__ import annotations

from functools import partial
from typing import Awaitable, Callable

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    AppWrapper, ASGIReceiveEvent, ASGISendEvent, ConnectionState, Scope,
)
from hypercorn.utils import (
    ShutdownError, parse_socket_addr, raise_shutdown, repr_socket_addr, wrap_app,
)


class _KeepAliveTimer:
    """A connection's keep-alive timer: one task, asleep until the connection may have been
    idle for `keep_alive_timeout`. A request's start (`stop`) and its response's end
    (`restart`) only note the time and whether a request is under way; the task, when it
    wakes, closes the connection if it has been idle that long, else sleeps until it could
    have been (a request under way is looked at again a keep-alive later). `restart` and
    `stop` keep the interface of Hypercorn's `TrioSingleTask`; `shut_down` closes the
    connection now if it is idle (a request in flight finishes first, then its connection
    closes, as Hypercorn's does when the server shuts down); `end` stops the timer of a
    connection already closed."""

    def __init__(self, connection: "_Connection") -> None:
        self._connection = connection
        self._sleep = trio.CancelScope()  # the task's current sleep; cancelled to wake it
        self._started = self._closed = self._busy = False
        self._idle_since = 0.0

    async def restart(self, task_group: object, action: Callable[[], Awaitable[None]]) -> None:
        self._busy = False
        self._idle_since = trio.current_time()
        if self._connection.context.terminated.is_set():
            self._sleep.cancel()  # idle while the server shuts down
        if not self._started:
            self._started = True
            self._connection.timers.add(self)
            self._connection._task_group._nursery.start_soon(self._watch)

    async def stop(self) -> None:
        self._busy = True

    def shut_down(self) -> None:
        if not self._busy:
            self._sleep.cancel()

    def end(self) -> None:
        self._closed = True
        self._sleep.cancel()

    async def _watch(self) -> None:
        timeout = self._connection.config.keep_alive_timeout
        try:
            while not self._closed:
                now = trio.current_time()
                if self._busy:
                    wake_at = now + timeout
                elif self._connection.context.terminated.is_set() \
                        or now >= self._idle_since + timeout:
                    break  # idle too long, or idle while the server shuts down
                else:
                    wake_at = self._idle_since + timeout
                with trio.CancelScope(deadline=wake_at) as self._sleep:
                    await trio.sleep_forever()
        finally:
            self._connection.timers.discard(self)
        if not self._closed:
            with trio.CancelScope(shield=True):
                await self._connection._initiate_server_close()


class _TaskGroup(TaskGroup):
    """Hypercorn's task group for a connection's requests, whose application queue passes a
    message without a turn of the event loop when it can: the connection puts a request's
    body into the queue, and the application takes it, without yielding while the queue has
    room (puts) or a message (takes); otherwise they wait as Hypercorn's do."""

    async def spawn_app(self, app: AppWrapper, config: Config, scope: Scope,
                        send: Callable[[ASGISendEvent | None], Awaitable[None]],
                        ) -> Callable[[ASGIReceiveEvent], Awaitable[None]]:
        put, take = trio.open_memory_channel[ASGIReceiveEvent](config.max_app_queue_size)

        async def receive() -> ASGIReceiveEvent:
            try:
                return take.receive_nowait()
            except trio.WouldBlock:
                return await take.receive()

        async def app_put(message: ASGIReceiveEvent) -> None:
            try:
                put.send_nowait(message)
            except trio.WouldBlock:
                await put.send(message)

        self._nursery.start_soon(_handle, app, config, scope, receive, send,
                                 trio.to_thread.run_sync, trio.from_thread.run)
        return app_put


class _Connection(TCPServer):
    """Hypercorn's connection with one keep-alive timer task, request bodies handed over
    without a turn and sends that do not yield for the send lock (module docstring); `timers`
    holds the keep-alive timers of the server's connections, for its shutdown."""

    def __init__(self, timers: set[_KeepAliveTimer], *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.timers = timers
        self.idle_task = _KeepAliveTimer(self)  # type: ignore[assignment]
        self._head = b""  # a response's head held for its body (module docstring)

    async def run(self) -> None:
        """Hypercorn's `TCPServer.run` with `_TaskGroup` for the connection's requests."""
        try:
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await self.stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return  # the TLS handshake failed
            alpn_protocol = self.stream.selected_alpn_protocol()
            socket = self.stream.transport_stream.socket
            ssl = True
        except AttributeError:  # not TLS
            alpn_protocol = "http/1.1"
            socket = self.stream.socket
            ssl = False
        try:
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())
            async with _TaskGroup() as task_group:
                self._task_group = task_group
                self.protocol = ProtocolWrapper(
                    self.app, self.config, self.context, task_group, ConnectionState(self.state),
                    ssl, client, server, self.protocol_send, alpn_protocol)
                await self.protocol.initiate()
                await self.idle_task.restart(self._task_group, self._idle_timeout)
                await self._read_data()
        except OSError:
            pass
        finally:
            await self._close()

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
            if self._head:
                await self._write(self._head)
            await super().protocol_send(event)
            return
        data = event.data
        if self._head:
            data, self._head = self._head + data, b""
        elif _body_follows(data):
            self._head = data  # written with the body, the next event
            return
        if data:
            await self._write(data)

    async def _write(self, data: bytes) -> None:
        self._head = b""
        try:
            self.send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self.send_lock.acquire()
        try:
            with trio.CancelScope(shield=True):
                await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.protocol.handle(Closed())
        finally:
            self.send_lock.release()


def _body_follows(data: bytes) -> bool:
    """Whether `data` is a whole response head declaring a body of one byte or more (h11
    writes a head in one piece; ASGI header names are lower case)."""
    if not data.startswith(b"HTTP/1.1 ") or not data.endswith(b"\r\n\r\n"):
        return False
    at = data.find(b"\r\ncontent-length: ")
    return at >= 0 and data[at + 18:at + 21] != b"0\r\n"


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
