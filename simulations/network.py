"""A faulty TCP proxy between a gateway client and a gateway server: network faults on demand.

How it works
- `open_proxy(target_url)` listens on a random local port and forwards every connection to the
  target. `proxy.url` is what the client uses instead of the server's URL.
- Faults are decided per HTTP request: a request starts when the client sends bytes on a
  connection whose previous request (if any) got its reply. Each request takes the next fault
  of `proxy.plan` (a list the caller fills; `"pass"` once it is empty):
    `refuse`, `reset`  the connection is closed as the request arrives, before it is forwarded
                   (a refused connect and a reset look alike to the client: no answer);
    `drop_reply`   the request is forwarded, and when the server's reply starts (the server
                   has answered, so a write has committed) the connection is closed instead;
    `delay:S`      the request is forwarded after S seconds;
    `503`          the proxy answers `503 store_unavailable` itself, the server never sees it.
  `proxy.fired` counts the faults that actually happened.
- `proxy.cut()` takes the network down: live connections are dropped and new ones closed at
  once until `proxy.restore()`.
The proxy speaks no HTTP beyond the canned 503: bytes pass unchanged, so what the client and
server see is a real network's behaviour.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import urllib.parse
from typing import AsyncIterator

import attrs
import trio

FAULTS = ("refuse", "reset", "drop_reply", "delay", "503")
_BUFFER = 65536


def canned_503() -> bytes:
    body = json.dumps({"error": "injected: the gateway is briefly unavailable",
                       "code": "store_unavailable", "action": None, "retry_after_ms": 0}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@attrs.define(eq=False)
class FaultyProxy:
    host: str
    port: int
    plan: list[str] = attrs.field(factory=list)
    fired: collections.Counter = attrs.field(factory=collections.Counter)
    requests: int = 0
    url: str = ""
    _down: bool = False
    _live: set[trio.CancelScope] = attrs.field(factory=set)

    def cut(self) -> None:
        """Drop every live connection and refuse new ones until `restore()`."""
        self._down = True
        for scope in list(self._live):
            scope.cancel()

    def restore(self) -> None:
        self._down = False

    def _next_fault(self) -> str:
        self.requests += 1
        return self.plan.pop(0) if self.plan else "pass"

    async def handle(self, client: trio.SocketStream) -> None:
        async with client:
            if self._down:
                self.fired["cut"] += 1
                return
            with trio.CancelScope() as scope:
                self._live.add(scope)
                try:
                    upstream = await trio.open_tcp_stream(self.host, self.port)
                    async with upstream:
                        await self._pump_both(client, upstream)
                except OSError:
                    return
                finally:
                    self._live.discard(scope)

    async def _pump_both(self, client: trio.SocketStream, upstream: trio.SocketStream) -> None:
        state = {"awaiting_request": True, "drop_reply": False}

        async def to_server(cancel: trio.CancelScope) -> None:
            while True:
                data = await client.receive_some(_BUFFER)
                if not data:
                    break
                if state["awaiting_request"]:
                    state["awaiting_request"] = False
                    fault = self._next_fault()
                    kind, _, arg = fault.partition(":")
                    if kind == "refuse" or kind == "reset":
                        self.fired[kind] += 1
                        cancel.cancel()
                        return
                    if kind == "503":
                        self.fired[kind] += 1
                        await client.send_all(canned_503())
                        cancel.cancel()
                        return
                    if kind == "delay":
                        self.fired[kind] += 1
                        await trio.sleep(float(arg or 0.05))
                    if kind == "drop_reply":
                        state["drop_reply"] = True
                await upstream.send_all(data)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await upstream.send_eof()

        async def to_client(cancel: trio.CancelScope) -> None:
            while True:
                data = await upstream.receive_some(_BUFFER)
                if not data:
                    break
                if state["drop_reply"]:
                    self.fired["drop_reply"] += 1
                    cancel.cancel()
                    return
                await client.send_all(data)
                state["awaiting_request"] = True
            cancel.cancel()

        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(to_server, nursery.cancel_scope)
                nursery.start_soon(to_client, nursery.cancel_scope)


@contextlib.asynccontextmanager
async def open_proxy(target_url: str) -> AsyncIterator[FaultyProxy]:
    """A proxy in front of `target_url` (http://host:port) until the block ends."""
    target = urllib.parse.urlsplit(target_url)
    proxy = FaultyProxy(target.hostname or "127.0.0.1", target.port or 80)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, proxy.handle, 0, host="127.0.0.1"))
        proxy.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        try:
            yield proxy
        finally:
            nursery.cancel_scope.cancel()
