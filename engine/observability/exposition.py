"""Serving `/metrics`: behind an operator's bearer secret on the gateway and console, or on a
separate `--metrics-bind` listener.

Choices
- On `runplane serve` and `runplane console` the route `GET /metrics` answers only
  `Authorization: Bearer $RUNPLANE_METRICS_TOKEN` (compared in constant time). Without the
  variable the route does not exist (404); a missing or different bearer is 401. A tenant's
  gateway token is never the metrics secret, so it never opens the route (§35).
- `--metrics-bind HOST:PORT` (a bare PORT means 127.0.0.1:PORT; loopback by default) starts
  `serve_metrics`: a small HTTP/1.1 listener written on trio itself, in the command's own trio
  run (no thread of prometheus_client's, so nothing outlives the command). It answers
  `GET /metrics` (and `/`) with the registry and closes each connection; it needs no token:
  who can reach the bind is the operator's choice. A request must arrive within
  `READ_TIMEOUT_S` and fit `MAX_REQUEST_BYTES`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os

import trio
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidInputError
from .metrics import exposition

log = logging.getLogger("runplane.metrics")

TOKEN_ENV = "RUNPLANE_METRICS_TOKEN"
METRICS_PATH = "/metrics"
DEFAULT_HOST = "127.0.0.1"
READ_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192


def authorized(authorization: str | None, secret: str) -> bool:
    """Whether an `Authorization` header carries the metrics secret (constant-time)."""
    if not authorization or not authorization.startswith("Bearer "):
        return False
    given = authorization[len("Bearer "):].strip().encode()
    return hmac.compare_digest(given, secret.encode())


async def metrics_route(request: Request) -> Response:
    """`GET /metrics` on the gateway and the console (see the module docstring)."""
    secret = os.environ.get(TOKEN_ENV, "")
    if not secret:
        return Response("not found\n", status_code=404, media_type="text/plain")
    if not authorized(request.headers.get("authorization"), secret):
        return Response("metrics need Authorization: Bearer $RUNPLANE_METRICS_TOKEN\n",
                        status_code=401, media_type="text/plain",
                        headers={"WWW-Authenticate": 'Bearer realm="metrics"'})
    return Response(exposition(), media_type=CONTENT_TYPE_LATEST)


def parse_bind(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `PORT` (host 127.0.0.1) as (host, port); `InvalidInputError` if neither."""
    host, sep, port = text.rpartition(":")
    host = (host.strip("[]") if sep else "") or DEFAULT_HOST
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise InvalidInputError(f"--metrics-bind must be HOST:PORT or PORT, got {text!r}")
    return host, number


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _answer(stream: trio.SocketStream) -> None:
    request = b""
    with trio.move_on_after(READ_TIMEOUT_S):
        while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            request += chunk
    words = request.split(b"\r\n", 1)[0].split()
    path = words[1].split(b"?", 1)[0] if len(words) >= 2 else b""
    if words[:1] == [b"GET"] and path in (METRICS_PATH.encode(), b"/"):
        status, body, kind = b"200 OK", exposition(), CONTENT_TYPE_LATEST.encode()
    else:
        status, body, kind = b"404 Not Found", b"not found\n", b"text/plain"
    head = (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
    await stream.send_all(head + body)


async def _handle(stream: trio.SocketStream) -> None:
    try:
        async with stream:
            await _answer(stream)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the scraper went away


async def serve_metrics(bind: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                        ) -> None:
    """Serve `/metrics` on `bind` until cancelled; `task_status.started` gets the URL bound
    (port 0 picks a free one)."""
    host, port = parse_bind(bind)
    listeners = await trio.open_tcp_listeners(port, host=host)
    sockname = listeners[0].socket.getsockname()
    shown = f"[{sockname[0]}]" if ":" in sockname[0] else sockname[0]
    url = f"http://{shown}:{sockname[1]}{METRICS_PATH}"
    if not is_loopback(host):
        log.warning("metrics served without a token on %s (not loopback)", url)
    task_status.started(url)
    await trio.serve_listeners(_handle, listeners)
