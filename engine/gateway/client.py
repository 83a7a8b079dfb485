"""The gateway client: a `Gateway` is a port whose engine operations run on a gateway server.

How it works
- `open_gateway(url, token)` yields a `Gateway` (an `engine.actions.RemotePort`): every engine
  operation registered as an action, called with it, is sent as `POST {url}/v1/actions/NAME`
  with the token as a bearer token, and answers what the direct call would have answered, or
  raises the same `engine.errors` class. Its org is the one the token names.
- A gateway learns the server's health answer once (its body limit sizes pages; its features
  pick request forms): from the answer to its first action, whose request asks for it
  (`protocol.HEALTH_HEADER`, when the body fits any gateway's limit), so a runner or a command
  spends no round trip on it; otherwise, or from a gateway that does not answer it, with
  `GET /v1/health` before the next request that needs it.
  At most `max_in_flight` requests are in flight (FIFO permits, as for connections).
- Attempts and their retries: `engine.gateway.transport` sends, `engine.gateway.retry` decides
  (`RetryPolicy`: answered attempts spend a ladder, unreachable ones a time budget; a
  completion has a total deadline). A 200 whose JSON object has no `result` is a server that
  does not speak this protocol: `GatewayUnavailableError` at once.
- Traces (`engine.observability.tracing`): an operation, its retries included, is one client
  span, and its requests carry W3C `traceparent` naming it.
- One operation keeps one request id across its retries, so the server answers a retry of a
  write it already applied from its replay cache; every action is idempotent besides.
- `sheets.admit`, `sheets.complete` and `sheets.probe` are sent their own way
  (`engine.gateway.senders`: validated here as the engine would, paged under the body limit).
  A completion's diagnostics reach its sink through the gateway's background queue
  (`gateway.diagnostics`, open while the gateway is), as with a tenant.
- With `db_sessions=True`, the operations a database session covers run in-process over a pool
  opened with a session's URL instead (`engine.gateway.db_sessions`), within the session's
  `session_limits`; the rest go over HTTP.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import urllib.parse
import uuid
from typing import AsyncIterator, Iterator, Mapping

import attrs
import trio

from ..limits.bounds import is_int
from ..actions import Action, RemotePort
from ..canonical import JsonValue
from ..ports import PortSettings
from ..diagnostics import DiagnosticsQueue
from ..errors import EngineError, GatewayUnavailableError, InvalidInputError
from ..observability import tracing
from ..permits import Permits
from .. import pg
from . import protocol
from .db_sessions import NOT_ROUTED, SessionKey, SessionRouter, session_key, token_operations
from .retry import Attempted, RetryPolicy, RetryState
from ..sessions.limits import SessionLimits
from .senders import COMPLETION_ACTION, SENDERS
from ..tokens import unverified_actions, unverified_org, unverified_plays
from .http11 import ConnectionPool
from .transport import Budget, GatewayStats, attempt, attempt_timeout, with_retries


@attrs.frozen
class Health:
    """What `GET /v1/health` said."""

    version: str
    body_limit: int
    array_actions: bool
    features: frozenset[str] = frozenset()  # the newer forms it lists (`protocol`; older: none)

    @classmethod
    def read(cls, answer: object) -> "Health | None":
        """The health in a decoded health answer, or None when it has no body limit."""
        try:
            listed = answer.get("features")
            features = frozenset(f for f in listed if isinstance(f, str)) \
                if isinstance(listed, list) else frozenset()
            return cls(str(answer.get("version")), int(answer["body_limit"]),
                       bool(answer.get("array_actions", False)), features)
        except (AttributeError, KeyError, TypeError, ValueError):
            return None


@attrs.define(eq=False)
class Gateway(RemotePort):
    """A runner's handle on a gateway; accepted wherever a tenant is. Build it with
    `open_gateway`."""

    url: str
    token: str = attrs.field(repr=False)
    org_id: str
    retry: RetryPolicy
    max_in_flight: int
    _client: ConnectionPool = attrs.field(repr=False)
    schema: str = "gateway"
    stats: GatewayStats = attrs.field(init=False, factory=GatewayStats)
    _permits: Permits = attrs.field(init=False, repr=False)
    _health: Health | None = attrs.field(init=False, default=None, repr=False)
    _health_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock, repr=False)
    diagnostics: DiagnosticsQueue = attrs.field(init=False, factory=DiagnosticsQueue, repr=False)
    db_sessions: SessionRouter | None = attrs.field(init=False, default=None, repr=False)
    session_key: SessionKey | None = attrs.field(init=False, default=None, repr=False)
    settings: PortSettings = attrs.field(init=False, repr=False)
    session_key_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock, repr=False)

    # The token's actions claim (None: every action), read unverified: an optional action it
    # does not allow is not sent (the caller takes its longer way at once, no 403 counted).
    token_actions: tuple[str, ...] | None = attrs.field(init=False, repr=False)
    _headers: dict[str, str] = attrs.field(init=False, repr=False)
    _urls: dict[str, str] = attrs.field(init=False, factory=dict, repr=False)
    _ids: Iterator[int] = attrs.field(init=False, factory=itertools.count, repr=False)
    _id_prefix: str = attrs.field(init=False, factory=lambda: uuid.uuid4().hex[:16], repr=False)

    def __attrs_post_init__(self) -> None:
        self._permits = Permits("gateway", self.max_in_flight)
        self._headers = {"authorization": f"Bearer {self.token}",
                         "content-type": "application/json"}
        # The token's plays (None: every play): an outbox drainer works on these.
        self.settings = PortSettings(self.schema, diagnostics=self.diagnostics,
                                     token_plays=unverified_plays(self.token), remote=True)
        self.token_actions = unverified_actions(self.token)

    def _request_id(self) -> str:
        """A new operation's request id: this gateway's random prefix and a counter (unique
        without asking the system for randomness on every request)."""
        return f"{self._id_prefix}{next(self._ids):016x}"

    # -- the Port surface ------------------------------------------------------------------
    def connection(self, lane: str):
        raise EngineError("a Gateway has no database connections: engine operations given a "
                          "Gateway run on the gateway server")

    async def repair_schema(self) -> None:
        """Nothing to repair from here: the gateway repairs its tenants' schemas itself."""

    def permits(self) -> dict:
        return {"gateway": self._permits.stats()}

    # -- actions -----------------------------------------------------------------------------
    async def send_action(self, action: Action, args: tuple, kwargs: dict) -> object:
        if self.db_sessions is not None:
            result = await self.db_sessions.run(action, args, kwargs)
            if result is not NOT_ROUTED:
                return result
        arguments = action.bind(args, kwargs)
        sender = SENDERS.get(action.name)
        if sender is not None:
            return await sender(self, action, arguments)
        return await self.call(action, arguments)

    async def call(self, action: Action, arguments: Mapping[str, object],
                   budget: Budget | None = None) -> object:
        """Send one action with `arguments` (by name) and decode its answer."""
        body = protocol.dumps(action.encode_input(arguments))
        return action.result.decode(await self.post(action, body, budget), "result")

    async def post(self, action: Action, body: bytes, budget: Budget | None = None,
                   headers: Mapping[str, str] | None = None) -> JsonValue:
        """POST an encoded input, retrying per the policy; the answer's `result`."""
        self.stats.operations += 1
        if budget is None:
            budget = self.budget(action.name)
        asks = self._health is None and len(body) <= protocol.MIN_BODY_LIMIT
        if not asks:
            health = await self.health()
            if len(body) > health.body_limit:
                raise InvalidInputError(
                    f"{action.name}: the input takes {len(body)} bytes; the gateway accepts at "
                    f"most {health.body_limit} bytes a request")
        headers = {**self._headers, protocol.REQUEST_ID_HEADER: self._request_id(),
                   **(headers or {})}
        if asks:
            headers[protocol.HEALTH_HEADER] = "1"
        target = self._urls.get(action.name)
        if target is None:
            target = self._urls[action.name] = self._path + protocol.ACTIONS_PATH + action.name

        async def send(timeout: float) -> Attempted:
            got = await attempt(self._client, self._permits, "POST", target, timeout, body,
                                headers)
            if asks and got.status == 200 and self._health is None and got.headers:
                self._health = self._health_in(got.headers.get(protocol.HEALTH_HEADER))
            return got

        with tracing.client_action(action.name, headers):  # a span; `traceparent` in headers
            answer = await with_retries(self.retry, self.stats, action.name, self._where, budget,
                                        attempt_timeout(self.retry, action), send)
        if "result" not in answer:
            raise GatewayUnavailableError(
                f"{action.name}: the gateway at {self.url} answered HTTP 200 with no result")
        return answer["result"]

    def budget(self, name: str) -> Budget:
        """A fresh retry budget for one operation named `name` (a completion's has a total
        deadline; pass one budget to every page of it)."""
        return Budget(RetryState(trio.current_time(), total_deadline=name == COMPLETION_ACTION))

    @property
    def _path(self) -> str:
        """The gateway URL's path, which every request's path starts with ('' at the root)."""
        return urllib.parse.urlsplit(self.url).path

    @property
    def _where(self) -> str:
        return f"the gateway at {self.url}"

    async def health(self) -> Health:
        """The gateway's health answer: read once (with retries of its own), then kept."""
        if self._health is not None:
            return self._health
        async with self._health_lock:
            if self._health is None:
                target = self._path + protocol.HEALTH_PATH
                answer = await with_retries(
                    self.retry, self.stats, "health", self._where, self.budget("health"),
                    self.retry.request_timeout_s,
                    lambda t: attempt(self._client, self._permits, "GET", target, t, None, {}))
                self._health = Health.read(answer)
                if self._health is None:
                    raise GatewayUnavailableError(
                        f"{self.url} answered its health check with no body limit")
        return self._health

    @staticmethod
    def _health_in(header: str | None) -> Health | None:
        """The health answer an action's answer carried (`protocol.HEALTH_HEADER`), or None
        (a gateway that does not send it, or a value that is not one: `GET /v1/health` then)."""
        if header is None:
            return None
        try:
            return Health.read(json.loads(header))
        except ValueError:
            return None


@contextlib.asynccontextmanager
async def open_gateway(url: str, token: str, *, retry: RetryPolicy | None = None,
                       max_in_flight: int = 8, db_sessions: bool = False,
                       session_limits: SessionLimits | Mapping[str, int] | None = None,
                       ) -> AsyncIterator[Gateway]:
    """A `Gateway` to `url` (`http(s)://host:port`) acting with `token`, until the block ends;
    with `db_sessions`, covered operations go straight to the database over sessions, each
    within `session_limits` (`max_rows` at least 10,000, `max_bytes`, `max_requests`): past
    a limit, that session's work goes over HTTP."""
    if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https") \
            or not urllib.parse.urlsplit(url).netloc:
        raise InvalidInputError(f"the gateway URL must be http(s)://host:port, got {url!r}")
    if not isinstance(token, str) or not token.strip():
        raise InvalidInputError("a gateway token is required (RUNPLANE_TOKEN)")
    if not is_int(max_in_flight, 1):
        raise InvalidInputError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidInputError("retry must be a RetryPolicy or None")
    session_limits = SessionLimits.of(session_limits)
    tracing.decide()  # traces on or off (a bad RUNPLANE_TRACE_ROWS_RATIO refused), once
    org = unverified_org(token.strip())
    client = ConnectionPool(url, max_idle=max_in_flight)
    try:
        gateway = Gateway(url.rstrip("/"), token.strip(), org, retry or RetryPolicy(),
                          max_in_flight, client)
        gateway.diagnostics.open()
        try:
            if not db_sessions:
                yield gateway
                return
            async with pg.open_driver() as driver:  # the event loop of the session pools
                await session_key(gateway)  # this process's RSA key, made once, before any action
                router = gateway.db_sessions = SessionRouter(
                    gateway, driver, token_operations(token), session_limits)
                try:
                    yield gateway
                finally:
                    gateway.db_sessions = None
                    await router.aclose()
        finally:
            await gateway.diagnostics.close()
    finally:
        await client.aclose()
