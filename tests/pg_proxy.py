"""A PostgreSQL wire proxy for tests: real network faults between the driver and the server.

`open_pg_proxy(dsn)` listens on a local TCP port and forwards each connection to the server
(its unix socket, or host:port). `proxy.dsn` is the DSN to use instead. Bytes pass unchanged;
the proxy reads the client's message framing only to recognise a simple-query `COMMIT`.

Faults (each a count of how many times to fire; `fired` counts what happened):
- `drop_commit_reply`: the COMMIT is forwarded, and when the server's reply arrives (so the
  server has committed) both sides are closed instead of relaying it.
- `drop_commit_request`: the COMMIT is not forwarded; both sides are closed (the server rolls
  the transaction back when it notices).
- `delay_commit_reply`: the server's reply to the COMMIT is relayed `commit_reply_delay_s` late.
- `blackhole` (a flag, `set_blackhole(True/False)`): nothing passes either way while it is
  set — new connections are accepted and never answered (a connect times out), bytes on open
  ones are held (statements hang) and delivered when it is lifted, as over a network that
  drops packets for a while.
- `hold_close` (a flag): when the server closes a connection, whatever it sent last is relayed
  but the client's side stays open until `release_close()`; `closes_held` counts them and
  `close_held` is set at each.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import struct
import urllib.parse
from typing import AsyncIterator

import attrs
import trio

from runplane.engine.errors import leaf_errors

_BUFFER = 65536
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
_UNTYPED_CODES = (80877103, 80877104)  # SSLRequest, GSSENCRequest: another untyped message follows


def _upstream_of(dsn: str) -> tuple[str | None, str, int]:
    """(unix socket path, host, port) of a `postgresql://` DSN."""
    url = urllib.parse.urlsplit(dsn)
    query = urllib.parse.parse_qs(url.query)
    host = (query.get("host") or [url.hostname or "127.0.0.1"])[0]
    port = int((query.get("port") or [url.port or 5432])[0])
    if host.startswith("/"):
        return f"{host}/.s.PGSQL.{port}", host, port
    return None, host, port


@attrs.define(eq=False)
class PgProxy:
    upstream: tuple[str | None, str, int]
    dsn: str = ""
    drop_commit_reply: int = 0
    drop_commit_request: int = 0
    delay_commit_reply: int = 0
    commit_reply_delay_s: float = 1.0
    hold_close: bool = False
    blackhole: bool = False
    _open: trio.Event = attrs.field(factory=trio.Event)
    _live: set = attrs.field(factory=set)
    fired: collections.Counter = attrs.field(factory=collections.Counter)
    connections: int = 0
    closes_held: int = 0
    close_held: trio.Event = attrs.field(factory=trio.Event)
    _release: trio.Event = attrs.field(factory=trio.Event)

    def set_blackhole(self, on: bool, *, sever: bool = False) -> None:
        """Start or lift the blackhole; `sever` also drops every open connection (as when the
        server's address moves to a host that does not answer)."""
        self.blackhole = on
        if sever:
            for scope in list(self._live):
                scope.cancel()
        if not on:
            self._open.set()
            self._open = trio.Event()

    async def _pass(self) -> None:
        while self.blackhole:
            await self._open.wait()

    def release_close(self) -> None:
        self._release.set()
        self._release = trio.Event()

    async def _open_upstream(self) -> trio.SocketStream:
        path, host, port = self.upstream
        if path is not None:
            return await trio.open_unix_socket(path)
        return await trio.open_tcp_stream(host, port)

    async def handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        async with client:
            if self.blackhole:
                self.fired["blackhole_connect"] += 1
                await self._pass()
            try:
                upstream = await self._open_upstream()
            except OSError:
                return
            async with upstream:
                cancel = None
                try:
                    async with trio.open_nursery() as nursery:
                        state = {"awaiting_commit_reply": False,
                                 "delaying_commit_reply": False}
                        cancel = nursery.cancel_scope
                        self._live.add(cancel)
                        nursery.start_soon(self._to_server, client, upstream, state, cancel)
                        nursery.start_soon(self._to_client, upstream, client, state, cancel)
                except BaseException as exc:  # a side went away: that ends the connection
                    if not all(isinstance(leaf, _GONE) for leaf in leaf_errors(exc)):
                        raise
                finally:
                    self._live.discard(cancel)

    async def _to_server(self, client, upstream, state, cancel: trio.CancelScope) -> None:
        buffer = b""
        typed = False
        while True:
            data = await client.receive_some(_BUFFER)
            await self._pass()
            if not data:
                cancel.cancel()
                return
            buffer += data
            out = b""
            while True:  # cut complete messages off the buffer
                if not typed:
                    if len(buffer) < 8:
                        break
                    length, code = struct.unpack("!ii", buffer[:8])
                    if len(buffer) < length:
                        break
                    message, buffer = buffer[:length], buffer[length:]
                    typed = code not in _UNTYPED_CODES
                    out += message
                    continue
                if len(buffer) < 5:
                    break
                kind = buffer[:1]
                (length,) = struct.unpack("!i", buffer[1:5])
                if len(buffer) < 1 + length:
                    break
                message, buffer = buffer[:1 + length], buffer[1 + length:]
                if kind == b"Q" and message[5:].rstrip(b"\0").strip().upper() == b"COMMIT":
                    if self.drop_commit_request > 0:
                        self.drop_commit_request -= 1
                        self.fired["drop_commit_request"] += 1
                        if out:
                            await upstream.send_all(out)
                        cancel.cancel()
                        return
                    if self.drop_commit_reply > 0:
                        self.drop_commit_reply -= 1
                        state["awaiting_commit_reply"] = True
                    elif self.delay_commit_reply > 0:
                        self.delay_commit_reply -= 1
                        state["delaying_commit_reply"] = True
                out += message
            if out:
                await upstream.send_all(out)

    async def _to_client(self, upstream, client, state, cancel: trio.CancelScope) -> None:
        while True:
            data = await upstream.receive_some(_BUFFER)
            await self._pass()
            if not data:
                if self.hold_close:
                    self.closes_held += 1
                    self.close_held.set()
                    self.close_held = trio.Event()
                    await self._release.wait()
                cancel.cancel()
                return
            if state["awaiting_commit_reply"]:
                self.fired["drop_commit_reply"] += 1
                cancel.cancel()
                return
            if state["delaying_commit_reply"]:
                state["delaying_commit_reply"] = False
                self.fired["delay_commit_reply"] += 1
                await trio.sleep(self.commit_reply_delay_s)
            await client.send_all(data)


@contextlib.asynccontextmanager
async def open_pg_proxy(dsn: str) -> AsyncIterator[PgProxy]:
    """A proxy in front of the server of `dsn` until the block ends."""
    proxy = PgProxy(_upstream_of(dsn))
    url = urllib.parse.urlsplit(dsn)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, proxy.handle, 0,
                                                          host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        user = url.username or "postgres"
        database = url.path.lstrip("/") or "postgres"
        proxy.dsn = f"postgresql://{user}@127.0.0.1:{port}/{database}?sslmode=disable"
        try:
            yield proxy
        finally:
            proxy.release_close()
            proxy.set_blackhole(False)
            nursery.cancel_scope.cancel()
