"""The gateway server: every registered action over HTTP, for runners without database access.

How it works
- `open_server(secret=..., dsn=..., options=ServerOptions(bind=...))` serves an ASGI application
  with Hypercorn's trio worker inside the caller's trio run and yields a `Server` (its `url`
  carries the port actually bound, so `bind="127.0.0.1:0"` picks a free one). Leaving the block
  stops accepting, lets requests in flight finish (a few seconds at most) and closes the tenants.
- `POST /v1/actions/{name}` is answered by a lean ASGI handler: the headers it needs read from
  the scope, the body from `receive`, the answer sent with two `send` calls, no request or
  response object per request. Starlette serves the rest (health, the console at `/ui`, 405 for
  another method on an action). Hypercorn parses HTTP and keeps a runner's connection open for
  up to `KEEP_ALIVE_MAX_REQUESTS` requests. An action's 200 carries the health answer too
  when its request asks for it (`protocol.HEALTH_HEADER`: a client's first action).
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
  `only_runs` and keeps to those runs. Only then does the action run, against the tenant of the
  token's org (opened on first use, then kept: `tenants`), with the action's server-side
  deadline (the registry's: admission 30 s, completion 75 s, `sheets.append_rows` and
  `replace_rows` 120 s; `ServerOptions.deadlines_s` may set another per action): a write that
  ran past it — a lock wait included — is cancelled (its transaction rolls back) and answered
  503 with `retry_after_ms`, so a client that gave up and retried never races a write of its
  earlier attempt. The client's own limit is longer (one admission attempt may wait 10
  minutes, `RetryPolicy.admission_timeout_s`): it rides the server's 503s instead of cutting
  off a queued admission.
- Database sessions: `db_sessions.create` is handed a `MintContext`: the verified claims (the
  operations a session gets, how long it lives) and `session_dsn`, the DSN its URL is built on
  (default: the server's own; give the address runners reach the database at). The first
  tenant's login drops the schema's expired session roles every minute.
- Per-org concurrency is what the tenant's lanes and connection cap allow (FIFO permits).
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
- Statistics: `requests` (by known action; unknown names share one bucket, so made-up names
  cannot grow the server's state), `errors` (by code), `max_body_bytes` (largest body accepted),
  a log line every `log_interval_s` (requests by action, errors by code, p50/p99 latency).
  Tokens never reach a log line or an error message, and text from a request reaches one only
  escaped (`guards.printable`). Each answer is also counted in
  `runplane_gateway_requests_total{action,code}` and `runplane_gateway_request_seconds`, served
  at `GET /metrics` to the operator's `RUNPLANE_METRICS_TOKEN` (`engine.observability`), and
  with tracing on answered in a span, child of the client's `traceparent` (`tracing.served`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
from importlib import metadata
from typing import TYPE_CHECKING, AsyncIterator, Iterable, Mapping

import attrs
import trio
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import pg
from ..actions import Action, actions
from ..canonical import JsonValue
from ..errors import EngineError, InvalidInputError, StoreUnavailableError, TooManySessionsError
from ..limits.bounds import is_int, is_number
from ..observability import metrics, tracing
from ..observability.exposition import METRICS_PATH, metrics_route
from ..sessions import MintContext
from ..tokens import VerifiedTokens
from . import guards, protocol
from .bodies import (
    ADMIT_ACTION, JSON_CONTENT_TYPE, READ_HEADERS, Refusal, RequestHeaders, decode_body,
    encode_result, read_body,
)
from .guards import ReplayCache
from .http_serve import serve
from .tenants import OrgTenants, gateway_tenants

if TYPE_CHECKING:
    from ..console import Console
    from ..placement.routed import RoutedTenants
    from ..placement.router import Router

REGISTER_ACTION = "runs.register"
log = logging.getLogger("runplane.gateway")

DEADLINE_RETRY_AFTER_MS = 1000
SHUTDOWN_GRACE_S = 5.0
MAX_LATENCY_SAMPLES, DECODE_THREADS = 100_000, 2
OFF_LOOP_BYTES = 64 * 1024  # bodies this large are decoded in a worker thread
KEEP_ALIVE_MAX_REQUESTS = 1_000_000  # requests one connection may carry before it is closed
_HEALTH_HEADER = protocol.HEALTH_HEADER.encode("ascii")


@functools.cache
def runplane_version() -> str:
    """The installed package's version (read once: a metadata lookup scans the installed
    distributions, which would cost every health check milliseconds)."""
    try:
        return metadata.version("runplane")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without install
        return "0"


@attrs.frozen
class ServerOptions:
    """How a gateway serves: where it listens, its limits, TLS, and what its tenants and
    database sessions are opened with (`open_server`; `runplane serve` sets them from flags)."""

    bind: str = "127.0.0.1:0"
    body_limit: int = attrs.field(default=protocol.DEFAULT_BODY_LIMIT)
    array_actions: bool = True
    log_interval_s: float = 60.0
    tenant_options: Mapping[str, object] = attrs.field(factory=dict,
                                                       converter=lambda v: dict(v or {}))
    session_dsn: str | None = attrs.field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    forwarded_allow: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # per action, a server-side deadline other than the one it is registered with (seconds)
    deadlines_s: Mapping[str, float] = attrs.field(factory=dict, converter=lambda v: dict(v or {}))

    @deadlines_s.validator
    def _check_deadlines(self, _attribute: attrs.Attribute, value: Mapping[str, object]) -> None:
        known = actions()
        for name, seconds in value.items():
            if name not in known:
                raise InvalidInputError(f"deadlines_s: no action is named {name!r}")
            if not is_number(seconds, above=0, finite=True):
                raise InvalidInputError(
                    f"deadlines_s[{name!r}] must be a number of seconds > 0, got {seconds!r}")

    def deadline_s(self, spec: Action) -> float:
        """How long the server lets action `spec` run (`deadlines_s`, else its own)."""
        return self.deadlines_s.get(spec.name, spec.deadline_s)

    # The connections the gateway may hold to its server, shared by every org (None: the
    # server's default share, `engine.limits.server_share`).
    max_connections: int | None = attrs.field(default=None)

    @max_connections.validator
    def _check_max_connections(self, _attribute: attrs.Attribute, value: object) -> None:
        if value is not None and not is_int(value, 1, 1_000_000):
            raise InvalidInputError("max_connections must be an integer from 1 to 1000000")

    @body_limit.validator
    def _check_body_limit(self, _attribute: attrs.Attribute, value: object) -> None:
        if not is_int(value, protocol.MIN_BODY_LIMIT):
            raise InvalidInputError(f"body_limit must be an integer >= {protocol.MIN_BODY_LIMIT}")

    def __attrs_post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidInputError(
                "TLS needs both a certificate and its key (--tls-cert, --tls-key)")

    def hypercorn_config(self) -> Config:
        """Hypercorn's configuration for these options."""
        config = Config()
        config.bind = [self.bind]
        if self.tls_cert is not None:
            config.certfile, config.keyfile = self.tls_cert, self.tls_key
        config.accesslog = None
        config.loglevel = "WARNING"
        config.graceful_timeout = SHUTDOWN_GRACE_S
        config.keep_alive_timeout = 75.0
        config.keep_alive_max_requests = KEEP_ALIVE_MAX_REQUESTS  # a runner's connection is reused
        config.include_server_header = False
        return config


@attrs.define(eq=False)
class Server:
    """A running gateway. `requests` counts requests by action, `errors` by code;
    `max_body_bytes` is the largest request body accepted."""

    secret: str = attrs.field(repr=False)
    options: ServerOptions
    tenants: OrgTenants | RoutedTenants  # many servers: routed by org (engine.placement)
    url: str = ""
    requests: collections.Counter[str] = attrs.field(init=False, factory=collections.Counter)
    errors: collections.Counter[str] = attrs.field(init=False, factory=collections.Counter)
    max_body_bytes: int = attrs.field(init=False, default=0)
    replay: ReplayCache = attrs.field(init=False, factory=ReplayCache)
    run_check: guards.RunCheck = attrs.field(init=False, factory=guards.RunCheck)
    console: Console | None = attrs.field(init=False, default=None, repr=False)
    _tokens: VerifiedTokens = attrs.field(init=False, repr=False)
    _decoding: trio.CapacityLimiter = attrs.field(
        init=False, factory=lambda: trio.CapacityLimiter(DECODE_THREADS), repr=False)
    _actions: Mapping[str, Action] = attrs.field(init=False, factory=actions, repr=False)
    _latencies: list[float] = attrs.field(init=False, factory=list, repr=False)
    _period: collections.Counter[str] = attrs.field(init=False, factory=collections.Counter,
                                                    repr=False)
    _period_errors: collections.Counter[str] = attrs.field(
        init=False, factory=collections.Counter, repr=False)

    def __attrs_post_init__(self) -> None:
        self._tokens = VerifiedTokens(self.secret)
        metrics.know_actions(self._actions)  # `action` labels: these names, else `other`

    # -- the application ---------------------------------------------------------------------
    def app(self) -> ASGIApp:
        """The ASGI application: `POST /v1/actions/{name}` is answered by a lean handler
        (`_serve_action`: the body read from `receive`, the answer sent with `send`), every
        other request by Starlette (health, the console, 405 for other methods on actions)."""
        from ..console import Console, Sessions, console_app  # the web console, at /ui

        self.console = Console(Sessions(self.secret), self.tenants.get, token_login=True,
                               forwarded_allow=self.options.forwarded_allow,
                               writer_for=self.tenants.get)  # actions as the org's tenant
        routed = Starlette(routes=[
            Route(protocol.HEALTH_PATH, self._health, methods=["GET"]),
            Route(METRICS_PATH, metrics_route, methods=["GET"]),  # operator's bearer secret
            Route(protocol.ACTIONS_PATH + "{action}", self._action, methods=["POST"]),
            Mount("/ui", app=console_app(self.console)),
        ])
        prefix = protocol.ACTIONS_PATH
        cut = len(prefix)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                path = scope["path"]
                if path.startswith(prefix) and len(path) > cut and "/" not in path[cut:]:
                    await self._serve_action(path[cut:], scope["headers"], receive, send)
                    return
            await routed(scope, receive, send)

        return app

    def _health_body(self) -> bytes:
        return protocol.dumps(protocol.health_answer(
            runplane_version(), self.options.body_limit, self.options.array_actions))

    async def _health(self, _request: Request) -> Response:
        return Response(self._health_body(), media_type="application/json")

    async def _action(self, request: Request) -> Response:
        """The same answer through Starlette: the route only gives other methods their 405, as
        the lean handler takes every POST first (so no health header here)."""
        status, body = await self._respond(request.path_params["action"],
                                           request.headers.items(), request.receive)
        return Response(body, status_code=status, media_type="application/json")

    async def _serve_action(self, name: str, raw_headers: Iterable[tuple[bytes, bytes]],
                            receive: Receive, send: Send) -> None:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers
                   if k in READ_HEADERS]
        status, body = await self._respond(name, headers, receive)
        answer = [(b"content-length", str(len(body)).encode("ascii")), JSON_CONTENT_TYPE]
        if status == 200 and any(k == protocol.HEALTH_HEADER for k, _ in headers):
            answer.append((_HEALTH_HEADER, self._health_body()))  # the client's first action
        await send({"type": "http.response.start", "status": status, "headers": answer})
        await send({"type": "http.response.body", "body": body})

    async def _respond(self, name: str, headers: Iterable[tuple[str, str]],
                       receive: Receive) -> tuple[int, bytes]:
        """The status and JSON body answering action `name`, counted in the metrics."""
        started = time.perf_counter()
        status, body = await tracing.served(name, headers, self._respond_to, receive)  # a span
        metrics.gateway_request(name, status, time.perf_counter() - started)
        return status, body

    async def _respond_to(self, name: str, headers: Iterable[tuple[str, str]],
                          receive: Receive) -> tuple[int, bytes]:
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
            extra: dict[str, JsonValue] = {"sqlstate": getattr(exc, "sqlstate", None)}
            if status == 503:
                extra["retry_after_ms"] = DEADLINE_RETRY_AFTER_MS
            elif isinstance(exc, TooManySessionsError) and exc.retry_after_s is not None:
                extra["retry_after_ms"] = round(exc.retry_after_s * 1000)
            return self._error(name, str(exc), code, status, **extra)
        except Exception:
            log.exception("gateway: action %s failed unexpectedly", guards.printable(counted))
            return self._error(name, "internal error in the gateway", "internal", 500)
        finally:
            if len(self._latencies) < MAX_LATENCY_SAMPLES:
                self._latencies.append(trio.current_time() - started)

    def _error(self, name: str, message: str, code: str, status: int,
               **extra: JsonValue) -> tuple[int, bytes]:
        self.errors[code] += 1
        self._period_errors[code] += 1
        return status, protocol.error_body(message, code, name, **extra)

    async def _answer(self, name: str, headers: RequestHeaders, receive: Receive) -> bytes:
        limit = self.options.body_limit
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise Refusal(f"the request body of {declared} bytes is over the limit of "
                          f"{limit} bytes", *protocol.BODY_TOO_LARGE)
        header = headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else None
        claims = self._tokens.verify(token)
        spec = self._actions.get(name)
        if spec is None or (not self.options.array_actions and name.startswith("array_input.")):
            raise Refusal(f"Unsupported action: {name}", *protocol.UNSUPPORTED_ACTION)
        claims.check_action(name)
        request_id = headers.get(protocol.REQUEST_ID_HEADER)
        if request_id:  # an empty header is no id (nothing to replay)
            guards.check_request_id(request_id)  # bounded before the body is even read
        raw = await read_body(receive, limit)
        self.max_body_bytes = max(self.max_body_bytes, len(raw))
        kwargs, skipped = await self._decode(spec, raw)
        guards.check_also_does(claims, name, kwargs)
        org, play = guards.scope_of(kwargs)
        listed = kwargs.get("plays")  # an org-wide step narrowed to some plays (outbox.claim_due)
        if play is None and isinstance(listed, (list, tuple)) and listed:
            for each in listed:
                claims.check_target(name, org, each)
        else:
            claims.check_target(name, org, play)
        for run_id in guards.named_run_ids(kwargs):  # a token's runs claim, before any query
            claims.check_run(name, run_id)
        if spec.context:
            context = {"minting": MintContext(claims, self.options.session_dsn),
                       "only_runs": claims.runs}
            kwargs.update({param: context[param] for param in spec.context})
        tenant = await self.tenants.get(claims.org)

        rows_form = headers.get(protocol.ROWS_HEADER) if name == ADMIT_ACTION else None
        if rows_form not in protocol.ROWS_FORMS:
            rows_form = None  # answered in full
        deadline_s = self.options.deadline_s(spec)

        async def compute() -> bytes:
            with trio.move_on_after(deadline_s) as deadline:
                checked = spec.writes and name != REGISTER_ACTION  # registering names a new run
                for run in guards.named_runs(kwargs, checked):  # refused before any write
                    await self.run_check.check(tenant, run)
                result = await spec.function(tenant, **kwargs)
                if name == REGISTER_ACTION:  # the run it answers needs no lookup
                    self.run_check.known(result)
            if deadline.cancelled_caught:
                raise StoreUnavailableError(
                    f"{name} ran past the gateway's {deadline_s:g} s deadline and was "
                    f"rolled back")
            if len(raw) < OFF_LOOP_BYTES:
                return encode_result(spec, result, skipped, rows_form)
            # a large request's answer is large too: encode it off the event loop as well
            return await trio.to_thread.run_sync(encode_result, spec, result, skipped, rows_form,
                                                 limiter=self._decoding)

        if spec.writes and request_id:
            digest = guards.request_digest(raw, claims, rows_form or "")
            return await self.replay.run((claims.org, play, name, request_id), digest, compute)
        return await compute()

    async def _decode(self, spec: Action, raw: bytes) -> tuple[dict[str, object], int]:
        """The action's keyword arguments from a body (a large body in a worker thread, so
        other requests go on meanwhile), and the number of duplicate rows dropped."""
        if len(raw) < OFF_LOOP_BYTES:
            return decode_body(spec, raw)
        return await trio.to_thread.run_sync(decode_body, spec, raw, limiter=self._decoding)

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
        budget = self.tenants.budget_stats()
        if budget is not None:  # connections in use / budget, orgs waiting, the longest wait
            line += f"; {budget.line()}"
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
async def open_server(*, secret: str, dsn: str | None = None, schema: str = "runplane",
                      options: ServerOptions | None = None,
                      router: Router | None = None) -> AsyncIterator[Server]:
    """Serve the gateway until the block ends (see the module docstring): on `dsn` (default:
    `RUNPLANE_DSN`, else the embedded server) and `schema`, as `options` say (default:
    `ServerOptions()`). With `options.tls_cert` and `tls_key` (PEM files, both or neither) it
    serves HTTPS with Hypercorn's TLS; `options.forwarded_allow` names the proxies whose
    `X-Forwarded-Proto` / `-Host` the console believes. Either way the console's cookie is
    `Secure` when the browser reached it over https. With a `router` (`runplane serve
    --tenants`) each org goes to the server the control table places it on instead."""
    if not isinstance(secret, str) or not secret:
        raise InvalidInputError("the gateway needs a non-empty signing secret")
    options = ServerOptions() if options is None else options
    tracing.decide()  # traces on or off, a bad RUNPLANE_TRACE_ROWS_RATIO refused, at the start
    tenants = await gateway_tenants(dsn, schema, options.tenant_options,
                                    options.max_connections, router)
    server = Server(secret, options, tenants)
    config = options.hypercorn_config()
    shutdown = trio.Event()
    served = trio.Event()

    async def run_serve(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                        ) -> None:
        try:
            await serve(server.app(), config, shutdown_trigger=shutdown.wait,
                        task_status=task_status)
        finally:
            served.set()

    async with pg.open_driver():  # one event loop for every tenant the gateway opens
        async with trio.open_nursery() as nursery:
            server.tenants.serve_in(nursery)
            binds = await nursery.start(run_serve)
            server.url = binds[0]
            nursery.start_soon(server._log_periodically, options.log_interval_s)
            try:
                yield server
            finally:
                shutdown.set()
                if server.console is not None:
                    server.console.closing.set()  # live streams end at once
                with trio.move_on_after(SHUTDOWN_GRACE_S + 1):
                    await served.wait()  # requests in flight finish first
                server.tenants.close()
                nursery.cancel_scope.cancel()
