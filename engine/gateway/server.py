"""The gateway server: every registered action over HTTP, for runners without database access.

How it works
- `open_server(secret=..., dsn=..., bind=...)` serves an ASGI application with Hypercorn's
  trio worker inside the caller's trio run and yields a `Server` (its `url` carries the port
  actually bound, so `bind="127.0.0.1:0"` picks a free one). Leaving the block stops accepting,
  lets requests in flight finish (a few seconds at most) and closes the tenants.
- `POST /v1/actions/{name}` is answered by a lean ASGI handler: the headers it needs read from
  the scope, the body from `receive`, the answer sent with two `send` calls, no request or
  response object per request. Starlette serves the rest (health, the console at `/ui`, 405 for
  another method on an action). Hypercorn parses HTTP and keeps a runner's connection open for
  up to `KEEP_ALIVE_MAX_REQUESTS` requests.
- A request is refused, in this order and before any query: a declared body over the limit
  (413); a missing, invalid or expired token (401); an unknown action, or an array-input action
  on a server started with `array_actions=False` (400 `unsupported_action`); an action the
  token's `actions` claim does not allow (403); a request id header past 128 characters or
  outside `[A-Za-z0-9._:-]` (400); a body that grows past the limit while it is read (413, the
  rest is never read); a malformed input (400: strict JSON, values bounded to
  what the database holds, see `guards` and `codecs`); a scope whose org or play the token does
  not allow (403); a run (a `RunRef`, a `RunScope` or `MapScope`'s run, a `run_id` argument)
  that the token's `runs` claim, when it has one, does not list (403), and likewise any run of
  a `run_ids` list; a run (`RunRef`) that is not registered for that org and play with that
  epoch (409, `guards.RunCheck`). An action that finds or lists runs by something else (an
  epoch, a play: `outbox.claim_due`, `runs.by_epoch`, `runs.list_runs`, `history.live_maps`,
  `shared_maps.live_maps`, `shared_maps.units_remaining`) is handed the token's `runs` claim as
  `only_runs` and keeps to those runs. Only then does the action run, against the tenant of the token's
  org (opened on first use, then kept), with the action's server-side deadline (admission 30 s,
  completion 75 s): a write that ran past it is cancelled (its transaction rolls back) and
  answered 503, so a client that gave up and retried never races a write of its earlier attempt.
- Database sessions: `db_sessions.create` is handed the verified claims (they bound
  the operations a session gets and how long it lives) and builds the session's URL on
  `session_dsn` (default: the server's own DSN; give the address runners reach the database
  at). The first tenant's login drops the schema's expired session roles every minute.
- Per-org concurrency is what the tenant's lanes and connection cap allow, exactly as for
  in-process runners: requests wait FIFO for permits.
- Writes are answered from a replay cache when their request id (one per client operation) was
  already applied for the same org, play and action with the same body and token claims: a
  retry after a reply lost in the network returns the first answer, and a retry arriving while
  the first attempt still runs waits for it; the same id with another body or token is a 409.
  The cache is bounded by bytes and age (`REPLAY_TTL_S`, longer than a client's unreachable
  budget); past it, the action's own idempotence still applies nothing twice.
- A body of `OFF_LOOP_BYTES` or more is decoded in a worker thread (at most `DECODE_THREADS` at
  once), an admission's rows validated, normalized, keyed and encoded there too, and the answer
  to such a request encoded there as well: a 4 MB admission does not hold the event loop that
  serves every other org's requests.
- Statistics: `requests` (count by known action; unknown names share one bucket, so made-up
  names cannot grow the server's state), `errors` (count by code), `max_body_bytes` (largest
  body accepted), and a log line every `log_interval_s` with requests by action, errors by code
  and p50/p99 latency. Tokens never reach a log line or an error message, and text from a
  request reaches one only escaped (`guards.printable`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
from importlib import metadata
from typing import Any, AsyncIterator, Mapping

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from ..limits.bounds import is_int
from .. import pg, sessions
from ..actions import Action, actions
from ..embedded import resolve_dsn
from ..errors import EngineError, InvalidInputError, StoreUnavailableError
from ..values.scopes import MapScope, PlayScope, RunRef, RunScope
from ..tenant import Tenant, open_tenant
from . import guards, protocol
from .bodies import (
    ADMIT_ACTION, JSON_CONTENT_TYPE, READ_HEADERS, RequestHeaders, decode_body, encode_result,
)
from .guards import ReplayCache
from ..tokens import VerifiedTokens

REGISTER_ACTION = "runs.register"

log = logging.getLogger("runplane.gateway")

DEADLINE_RETRY_AFTER_MS = 1000
SHUTDOWN_GRACE_S = 5.0
MAX_LATENCY_SAMPLES = 100_000
OFF_LOOP_BYTES = 64 * 1024  # bodies this large are decoded in a worker thread
DECODE_THREADS = 2
KEEP_ALIVE_MAX_REQUESTS = 1_000_000  # requests one connection may carry before it is closed


class Refusal(Exception):
    """A request refused before its action ran, with its wire code and status."""

    def __init__(self, message: str, code: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


@functools.cache
def runplane_version() -> str:
    """The installed package's version (read once: a metadata lookup scans the installed
    distributions, which would cost every health check milliseconds)."""
    try:
        return metadata.version("runplane")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without install
        return "0"


def scope_of(kwargs: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The org and play an action's input names (None, None for org-wide actions); a bare
    `play` (as `db_sessions.create` takes) is a play of the token's org."""
    for value in kwargs.values():
        if isinstance(value, RunRef):
            value = value.scope
        if isinstance(value, (PlayScope, RunScope, MapScope)):
            return value.org_id, value.play
    play = kwargs.get("play")
    if isinstance(play, str):
        return None, play.strip()
    return None, None


@attrs.define(eq=False)
class _TenantSlot:
    ready: trio.Event = attrs.field(factory=trio.Event)
    tenant: Tenant | None = None
    error: BaseException | None = None


@attrs.define(eq=False)
class Server:
    """A running gateway. `requests` counts requests by action, `errors` by code;
    `max_body_bytes` is the largest request body accepted."""

    secret: str = attrs.field(repr=False)
    dsn: str = attrs.field(repr=False)
    schema: str = "runplane"
    body_limit: int = protocol.DEFAULT_BODY_LIMIT
    array_actions: bool = True
    tenant_options: Mapping[str, Any] = attrs.field(factory=dict)
    session_dsn: str | None = attrs.field(default=None, repr=False)
    url: str = ""
    requests: collections.Counter = attrs.field(init=False, factory=collections.Counter)
    errors: collections.Counter = attrs.field(init=False, factory=collections.Counter)
    max_body_bytes: int = attrs.field(init=False, default=0)
    replay: ReplayCache = attrs.field(init=False, factory=ReplayCache)
    run_check: guards.RunCheck = attrs.field(init=False, factory=guards.RunCheck)
    _tokens: VerifiedTokens = attrs.field(init=False, repr=False)
    _decoding: trio.CapacityLimiter = attrs.field(
        init=False, factory=lambda: trio.CapacityLimiter(DECODE_THREADS), repr=False)
    _actions: Mapping[str, Action] = attrs.field(init=False, factory=actions, repr=False)
    _tenants: dict[str, _TenantSlot] = attrs.field(init=False, factory=dict, repr=False)
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None, repr=False)
    _sweeping: bool = attrs.field(init=False, default=False, repr=False)
    console: Any = attrs.field(init=False, default=None, repr=False)
    forwarded_allow: tuple[str, ...] = ()  # proxies the console believes (`open_server`)
    _closing: trio.Event = attrs.field(init=False, factory=trio.Event, repr=False)
    _latencies: list[float] = attrs.field(init=False, factory=list, repr=False)
    _period: collections.Counter = attrs.field(init=False, factory=collections.Counter, repr=False)
    _period_errors: collections.Counter = attrs.field(init=False, factory=collections.Counter,
                                                      repr=False)

    def __attrs_post_init__(self) -> None:
        self._tokens = VerifiedTokens(self.secret)

    # -- the application ---------------------------------------------------------------------
    def app(self) -> Any:
        """The ASGI application: `POST /v1/actions/{name}` is answered by a lean handler
        (`_serve_action`: the body read from `receive`, the answer sent with `send`), every
        other request by Starlette (health, the console, 405 for other methods on actions)."""
        from ..console import Console, Sessions, console_app  # the web console, at /ui

        self.console = Console(Sessions(self.secret), self._tenant, token_login=True,
                               forwarded_allow=self.forwarded_allow)
        routed = Starlette(routes=[
            Route(protocol.HEALTH_PATH, self._health, methods=["GET"]),
            Route(protocol.ACTIONS_PATH + "{action}", self._action, methods=["POST"]),
            Mount("/ui", app=console_app(self.console)),
        ])
        prefix = protocol.ACTIONS_PATH
        cut = len(prefix)

        async def app(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                path = scope["path"]
                if path.startswith(prefix) and len(path) > cut and "/" not in path[cut:]:
                    await self._serve_action(path[cut:], scope["headers"], receive, send)
                    return
            await routed(scope, receive, send)

        return app

    async def _health(self, _request: Request) -> Response:
        body = protocol.dumps({"ok": True, "version": runplane_version(),
                               "body_limit": self.body_limit, "array_actions": self.array_actions})
        return Response(body, media_type="application/json")

    async def _action(self, request: Request) -> Response:
        """The same answer through Starlette (the lean handler takes every POST first)."""
        status, body = await self._respond(request.path_params["action"],
                                           request.headers.items(), request.receive)
        return Response(body, status_code=status, media_type="application/json")

    async def _serve_action(self, name: str, raw_headers: list, receive: Any, send: Any) -> None:
        headers = [(key.decode("latin-1"), value.decode("latin-1")) for key, value in raw_headers
                   if key in READ_HEADERS]
        status, body = await self._respond(name, headers, receive)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode("ascii")),
                                JSON_CONTENT_TYPE]})
        await send({"type": "http.response.body", "body": body})

    async def _respond(self, name: str, headers: Any, receive: Any) -> tuple[int, bytes]:
        """The status and JSON body answering action `name` (see the module docstring)."""
        started = trio.current_time()
        counted = guards.bucket(name, self._actions)
        self.requests[counted] += 1
        self._period[counted] += 1
        try:
            return 200, await self._answer(name, RequestHeaders(headers), receive)
        except Refusal as exc:
            return self._error(name, str(exc), exc.code, exc.status)
        except EngineError as exc:
            code, status = protocol.error_status(exc)
            extra: dict[str, Any] = {"sqlstate": getattr(exc, "sqlstate", None)}
            if status == 503:
                extra["retry_after_ms"] = DEADLINE_RETRY_AFTER_MS
            elif getattr(exc, "retry_after_s", None) is not None:  # TooManySessionsError
                extra["retry_after_ms"] = round(exc.retry_after_s * 1000)
            return self._error(name, str(exc), code, status, **extra)
        except Exception:
            log.exception("gateway: action %s failed unexpectedly", guards.printable(counted))
            return self._error(name, "internal error in the gateway", "internal", 500)
        finally:
            if len(self._latencies) < MAX_LATENCY_SAMPLES:
                self._latencies.append(trio.current_time() - started)

    def _error(self, name: str, message: str, code: str, status: int,
               **extra: Any) -> tuple[int, bytes]:
        self.errors[code] += 1
        self._period_errors[code] += 1
        return status, protocol.error_body(message, code, name, **extra)

    async def _answer(self, name: str, headers: RequestHeaders, receive: Any) -> bytes:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.body_limit:
            raise Refusal(f"the request body of {declared} bytes is over the limit of "
                          f"{self.body_limit} bytes", *protocol.BODY_TOO_LARGE)
        header = headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else None
        claims = self._tokens.verify(token)
        spec = self._actions.get(name)
        if spec is None or (not self.array_actions and name.startswith("array_input.")):
            raise Refusal(f"Unsupported action: {name}", *protocol.UNSUPPORTED_ACTION)
        claims.check_action(name)
        request_id = headers.get(protocol.REQUEST_ID_HEADER)
        if request_id:  # an empty header is no id (nothing to replay)
            guards.check_request_id(request_id)  # bounded before the body is even read
        raw = await self._read_body(receive)
        kwargs, skipped = await self._decode(spec, raw)
        org, play = scope_of(kwargs)
        listed = kwargs.get("plays")  # an org-wide step narrowed to some plays (outbox.claim_due)
        if play is None and isinstance(listed, (list, tuple)) and listed:
            for each in listed:
                claims.check_target(name, org, each)
        else:
            claims.check_target(name, org, play)
        for run_id in guards.named_run_ids(kwargs):  # a token's runs claim, before any query
            claims.check_run(name, run_id)
        context = {"claims": claims, "session_dsn": self.session_dsn, "only_runs": claims.runs}
        kwargs.update({param: context[param] for param in spec.context})
        tenant = await self._tenant(claims.org)

        rows_by_key = (name == ADMIT_ACTION
                       and headers.get(protocol.ROWS_HEADER) == protocol.ROWS_BY_KEY)

        async def compute() -> bytes:
            with trio.move_on_after(spec.deadline_s) as deadline:
                checked = spec.writes and name != REGISTER_ACTION  # registering names a new run
                for run in guards.named_runs(kwargs, checked):  # refused before any write
                    await self.run_check.check(tenant, run)
                result = await spec.function(tenant, **kwargs)
            if deadline.cancelled_caught:
                raise StoreUnavailableError(
                    f"{name} ran past the gateway's {spec.deadline_s:.0f} s deadline and was "
                    f"rolled back")
            if len(raw) < OFF_LOOP_BYTES:
                return encode_result(spec, result, skipped, rows_by_key)
            # a large request's answer is large too: encode it off the event loop as well
            return await trio.to_thread.run_sync(encode_result, spec, result, skipped, rows_by_key,
                                                 limiter=self._decoding)

        if spec.writes and request_id:
            digest = guards.request_digest(raw, claims, "by-key" if rows_by_key else "")
            return await self.replay.run((claims.org, play, name, request_id), digest, compute)
        return await compute()

    async def _decode(self, spec: Action, raw: bytes) -> tuple[dict[str, Any], int]:
        """The action's keyword arguments from a body (a large body in a worker thread, so
        other requests go on meanwhile), and the number of duplicate rows dropped."""
        if len(raw) < OFF_LOOP_BYTES:
            return decode_body(spec, raw)
        return await trio.to_thread.run_sync(decode_body, spec, raw, limiter=self._decoding)

    async def _read_body(self, receive: Any) -> bytes:
        """The request body from ASGI `receive`: 413 as soon as it grows past the limit (the
        rest is never read); a client that went away raises `ClientDisconnect`."""
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > self.body_limit:
                    raise Refusal(f"the request body is over the limit of {self.body_limit} bytes",
                                  *protocol.BODY_TOO_LARGE)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        self.max_body_bytes = max(self.max_body_bytes, size)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # -- tenants -----------------------------------------------------------------------------
    async def _tenant(self, org: str) -> Tenant:
        slot = self._tenants.get(org)
        if slot is not None and slot.tenant is not None:
            return slot.tenant  # open already: no wait (nor a trip through the scheduler)
        if slot is None:
            if self._nursery is None:
                raise StoreUnavailableError("the gateway is shutting down")
            slot = self._tenants[org] = _TenantSlot()
            self._nursery.start_soon(self._hold_tenant, org, slot)
        await slot.ready.wait()
        if slot.tenant is None:
            assert slot.error is not None
            raise slot.error
        return slot.tenant

    async def _hold_tenant(self, org: str, slot: _TenantSlot) -> None:
        try:
            async with open_tenant(org, self.dsn, schema=self.schema, **self.tenant_options) as tenant:
                slot.tenant = tenant
                slot.ready.set()
                async with trio.open_nursery() as nursery:
                    if not self._sweeping:  # one tenant's login drops the schema's expired sessions
                        self._sweeping = True
                        nursery.start_soon(sessions.sweep_expired, tenant)
                    await self._closing.wait()
                    nursery.cancel_scope.cancel()
        except EngineError as exc:
            slot.error = exc
            if self._tenants.get(org) is slot:
                del self._tenants[org]  # the next request tries again
        finally:
            slot.ready.set()

    # -- telemetry ---------------------------------------------------------------------------
    def take_period(self) -> str | None:
        """The periodic log line's text for the requests since the last one (None if idle)."""
        if not self._period:
            return None
        samples = sorted(self._latencies)
        p50 = samples[len(samples) // 2] * 1000 if samples else 0.0
        p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1000 if samples else 0.0
        by_action = ", ".join(f"{n} {c}" for n, c in self._period.most_common())
        by_code = ", ".join(f"{n} {c}" for n, c in self._period_errors.most_common()) or "none"
        line = (f"gateway: {sum(self._period.values())} requests ({by_action}); errors: {by_code}; "
                f"p50 {p50:.1f} ms, p99 {p99:.1f} ms")
        self._period.clear()
        self._period_errors.clear()
        self._latencies.clear()
        return line

    async def _log_periodically(self, interval_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            line = self.take_period()
            if line is not None:
                log.info("%s", line)


@contextlib.asynccontextmanager
async def open_server(
    *,
    secret: str,
    dsn: str | None = None,
    schema: str = "runplane",
    bind: str = "127.0.0.1:0",
    body_limit: int = protocol.DEFAULT_BODY_LIMIT,
    array_actions: bool = True,
    log_interval_s: float = 60.0,
    tenant_options: Mapping[str, Any] | None = None,
    session_dsn: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    forwarded_allow: tuple[str, ...] = (),
) -> AsyncIterator[Server]:
    """Serve the gateway until the block ends (see the module docstring). `tls_cert` and
    `tls_key` (PEM files, both or neither) serve HTTPS with Hypercorn's TLS; `forwarded_allow`
    names the proxies whose `X-Forwarded-Proto` / `-Host` the console believes. Either way the
    console's cookie is `Secure` when the browser reached it over https."""
    if not isinstance(secret, str) or not secret:
        raise InvalidInputError("the gateway needs a non-empty signing secret")
    if not is_int(body_limit, protocol.PAGE_HEADROOM * 2):
        raise InvalidInputError(f"body_limit must be an integer >= {protocol.PAGE_HEADROOM * 2}")
    resolved = dsn or os.environ.get("RUNPLANE_DSN") or await resolve_dsn()
    if (tls_cert is None) != (tls_key is None):
        raise InvalidInputError("TLS needs both a certificate and its key (--tls-cert, --tls-key)")
    server = Server(secret, resolved, schema, body_limit, array_actions, dict(tenant_options or {}),
                    session_dsn, forwarded_allow=tuple(forwarded_allow))
    config = Config()
    config.bind = [bind]
    if tls_cert is not None:
        config.certfile, config.keyfile = tls_cert, tls_key
    config.accesslog = None
    config.loglevel = "WARNING"
    config.graceful_timeout = SHUTDOWN_GRACE_S
    config.keep_alive_timeout = 75.0
    config.keep_alive_max_requests = KEEP_ALIVE_MAX_REQUESTS  # a runner's connection is reused
    config.include_server_header = False
    shutdown = trio.Event()
    served = trio.Event()

    async def run_serve(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await serve(server.app(), config, shutdown_trigger=shutdown.wait,
                        task_status=task_status)
        finally:
            served.set()

    async with pg.open_driver():  # one event loop for every tenant the gateway opens
        async with trio.open_nursery() as nursery:
            server._nursery = nursery
            binds = await nursery.start(run_serve)
            server.url = binds[0]
            nursery.start_soon(server._log_periodically, log_interval_s)
            try:
                yield server
            finally:
                shutdown.set()
                if server.console is not None:
                    server.console.closing.set()  # live streams end at once
                with trio.move_on_after(SHUTDOWN_GRACE_S + 1):
                    await served.wait()  # requests in flight finish first
                server._nursery = None
                server._closing.set()
                nursery.cancel_scope.cancel()
