"""The gateway client: a `Gateway` is a port whose engine operations run on a gateway server.

How it works
- `open_gateway(url, token)` yields a `Gateway` (an `engine.actions.RemotePort`): every engine
  operation registered as an action, called with it, is sent as `POST {url}/v1/actions/NAME`
  with the token as a bearer token, and answers what the direct call would have answered, or
  raises the same `engine.errors` class. Its org is the one the token names.
- Before its first action a gateway reads `GET /v1/health` once (the body limit sizes pages).
  At most `max_in_flight` requests are in flight (FIFO permits, as for connections); a permit
  is held for one attempt, never across a retry's wait.
- Retries follow `RetryPolicy`. An attempt that got a status line (whatever its body
  then did) is *answered*: it spends the `answered_delays_s` ladder — retried on 408, 429, 502,
  503, 504 and transient 500s, waiting the ladder's step or the server's `retry_after_ms` /
  `Retry-After`, whichever is longer, and at least `min_answered_wait_s` (2 s) when the answer
  named no wait (`answered_wait`), at most `len(answered_delays_s) + 1` answered attempts.
  An attempt with no status line (refused, reset, DNS, timed out) is *unanswered*: it does not
  spend the ladder, it waits the ladder's step (then its last step) and retries until
  `unreachable_budget_s` after the operation began. A 200 whose body is not a JSON object
  is a failed body (retried as above); a JSON object without `result` is a server that does
  not speak this protocol: `GatewayUnavailableError` at once. `sheets.complete` also has a
  total deadline, `completion_total_s` from its start plus the time spent unreachable. The
  error raised at the end names the budget that ran out and the URL, never the token.
- One operation keeps one request id across its retries, so the server answers a retry of a
  write it already applied from its replay cache; every action is idempotent besides.
- An attempt times out after `request_timeout_s`, or after the action's server-side deadline
  plus `DEADLINE_MARGIN_S` when that is longer (a completion may run 75 s on the server), so
  a client never gives up on a write the server is still allowed to apply.
- `sheets.admit` and `sheets.complete` are validated, keyed and deduplicated here exactly as the
  engine would, then paged under the body limit (`engine.gateway.paging`) and their answers
  merged; an admission page whose answer disagrees with the page sent is a `ConflictError`.
- With `db_sessions=True`, the operations a database session covers run in-process over a pool
  opened with a session's URL instead (`engine.gateway.db_sessions`); the rest go over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import urllib.parse
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

import attrs
import httpx
import trio

from ..actions import Action, RemotePort
from ..errors import EngineError, GatewayUnavailableError, InvalidInputError, StoreUnavailableError
from ..permits import Permits
from ..scopes import normalize_namespace
from ..sheets.completion import deliver_diagnostics
from ..sheets.admission import check_give_up_after
from ..sheets.inputs import check_input_indexes, check_write, prepare_outcomes, prepare_rows
from ..sheets.model import Admission, AdmittedRow, Completion, CompletionDiagnostics, Timing
from .. import pg
from . import paging, protocol
from .db_sessions import NOT_ROUTED, SessionKey, SessionRouter, session_key, token_operations
from .tokens import unverified_org, unverified_plays

DEADLINE_MARGIN_S = 5.0
COMPLETION_ACTION = "sheets.complete"


def _non_negative(name: str):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                or not math.isfinite(value):
            raise InvalidInputError(f"RetryPolicy.{name} must be a finite number >= 0, got {value!r}")

    return check


def _delays(value: object) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidInputError("RetryPolicy.answered_delays_s must be a sequence of seconds")
    delays = tuple(value)
    for delay in delays:
        _non_negative("answered_delays_s")(None, None, delay)
    return tuple(float(delay) for delay in delays)


@attrs.frozen
class RetryPolicy:
    """How a gateway client retries; see the module docstring."""

    answered_delays_s: tuple[float, ...] = attrs.field(
        default=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0), converter=_delays)
    unreachable_budget_s: float = attrs.field(default=300.0, validator=_non_negative("unreachable_budget_s"))
    request_timeout_s: float = attrs.field(default=30.0, validator=_non_negative("request_timeout_s"))
    completion_total_s: float = attrs.field(default=600.0, validator=_non_negative("completion_total_s"))
    min_answered_wait_s: float = attrs.field(default=2.0, validator=_non_negative("min_answered_wait_s"))

    def step(self, index: int) -> float:
        """The ladder's step `index` (0-based), its last step past its end (0 for no ladder)."""
        if not self.answered_delays_s:
            return 0.0
        return self.answered_delays_s[min(index, len(self.answered_delays_s) - 1)]


def answered_wait(policy: RetryPolicy, answered: int, retry_after: float | None) -> float:
    """The wait after the `answered`-th answered attempt failed: the ladder's step or the wait
    the server asked for, whichever is longer; at least `min_answered_wait_s` when the answer
    asked for none (`retry_after` None)."""
    asked = policy.min_answered_wait_s if retry_after is None else retry_after
    return max(policy.step(answered - 1), asked)


@attrs.frozen
class Health:
    """What `GET /v1/health` said."""

    version: str
    body_limit: int
    array_actions: bool


@attrs.define(eq=False)
class GatewayStats:
    """Attempts this client made, by kind (telemetry, for tests and simulations)."""

    operations: int = 0
    answered_attempts: int = 0
    unanswered_attempts: int = 0
    retries: int = 0


@attrs.define(eq=False)
class _Budget:
    """The retry bookkeeping of one operation (or of every page of one completion)."""

    policy: RetryPolicy
    started: float
    total_deadline: bool = False
    answered: int = 0
    attempts: int = 0
    unreachable_s: float = 0.0

    def answered_deadline(self) -> float:
        if not self.total_deadline:
            return math.inf
        return self.started + self.unreachable_s + self.policy.completion_total_s

    def unreachable_deadline(self) -> float:
        return self.started + self.policy.unreachable_budget_s


@attrs.define(eq=False)
class Gateway(RemotePort):
    """A runner's handle on a gateway; accepted wherever a tenant is. Build it with
    `open_gateway`."""

    url: str
    token: str = attrs.field(repr=False)
    org_id: str
    retry: RetryPolicy
    max_in_flight: int
    _client: httpx.AsyncClient = attrs.field(repr=False)
    schema: str = "gateway"
    outer_transaction: bool = False
    stats: GatewayStats = attrs.field(init=False, factory=GatewayStats)
    _permits: Permits = attrs.field(init=False, repr=False)
    _health: Health | None = attrs.field(init=False, default=None, repr=False)
    _health_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock, repr=False)
    db_sessions: SessionRouter | None = attrs.field(init=False, default=None, repr=False)
    session_key: SessionKey | None = attrs.field(init=False, default=None, repr=False)
    session_key_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock, repr=False)

    def __attrs_post_init__(self) -> None:
        self._permits = Permits("gateway", self.max_in_flight)

    @property
    def token_plays(self) -> tuple[str, ...] | None:
        """The plays the token allows (None: every play); an outbox drainer works on these."""
        return unverified_plays(self.token)

    # -- the Port surface ------------------------------------------------------------------
    def connection(self, lane: str):
        raise EngineError("a Gateway has no database connections: engine operations given a "
                          "Gateway run on the gateway server")

    async def repair_schema(self) -> None:
        """Nothing to repair from here: the gateway repairs its tenants' schemas itself."""

    def permits(self) -> dict:
        return {"gateway": self._permits.stats()}

    # -- actions -----------------------------------------------------------------------------
    async def send_action(self, action: Action, args: tuple, kwargs: dict) -> Any:
        if self.db_sessions is not None:
            result = await self.db_sessions.run(action, args, kwargs)
            if result is not NOT_ROUTED:
                return result
        arguments = action.bind(args, kwargs)
        sender = _SENDERS.get(action.name)
        if sender is not None:
            return await sender(self, action, arguments)
        return await self.call(action, arguments)

    async def call(self, action: Action, arguments: Mapping[str, Any],
                   budget: _Budget | None = None) -> Any:
        """Send one action with `arguments` (by name) and decode its answer."""
        body = protocol.dumps(action.encode_input(arguments))
        return action.result.decode(await self.post(action, body, budget), "result")

    async def post(self, action: Action, body: bytes, budget: _Budget | None = None,
                   headers: Mapping[str, str] | None = None) -> Any:
        """POST an encoded input, retrying per the policy; the answer's `result`."""
        self.stats.operations += 1
        if budget is None:
            budget = self._budget(action.name)
        health = await self.health()
        if len(body) > health.body_limit:
            raise InvalidInputError(
                f"{action.name}: the input takes {len(body)} bytes; the gateway accepts at most "
                f"{health.body_limit} bytes a request")
        headers = {"authorization": f"Bearer {self.token}", "content-type": "application/json",
                   protocol.REQUEST_ID_HEADER: uuid.uuid4().hex, **(headers or {})}
        timeout = max(self.retry.request_timeout_s, action.deadline_s + DEADLINE_MARGIN_S)
        answer = await self._with_retries(
            action.name, budget, timeout,
            lambda t: self._attempt("POST", self._action_url(action.name), t, body, headers))
        if "result" not in answer:
            raise GatewayUnavailableError(
                f"{action.name}: the gateway at {self.url} answered HTTP 200 with no result")
        return answer["result"]

    def _budget(self, name: str) -> _Budget:
        return _Budget(self.retry, trio.current_time(), total_deadline=name == COMPLETION_ACTION)

    def _action_url(self, name: str) -> str:
        return self.url + protocol.ACTIONS_PATH + name

    async def health(self) -> Health:
        """The gateway's health answer: read once (with retries of its own), then kept."""
        if self._health is not None:
            return self._health
        async with self._health_lock:
            if self._health is None:
                answer = await self._with_retries(
                    "health", self._budget("health"), self.retry.request_timeout_s,
                    lambda t: self._attempt("GET", self.url + protocol.HEALTH_PATH, t, None, {}))
                try:
                    self._health = Health(str(answer.get("version")), int(answer["body_limit"]),
                                          bool(answer.get("array_actions", False)))
                except (KeyError, TypeError, ValueError):
                    raise GatewayUnavailableError(
                        f"{self.url} answered its health check with no body limit") from None
        return self._health

    # -- attempts and retries ---------------------------------------------------------------
    async def _attempt(self, method: str, url: str, timeout: float, body: bytes | None,
                       headers: Mapping[str, str]):
        """One attempt: (status, payload, headers, failure); status None when unanswered."""
        async with self._permits.hold():
            response = None
            with trio.move_on_after(timeout):
                try:
                    request = self._client.build_request(method, url, content=body, headers=headers)
                    response = await self._client.send(request, stream=True)
                except httpx.HTTPError as exc:
                    return None, None, None, exc
                try:
                    raw = await response.aread()
                except httpx.HTTPError as exc:
                    return response.status_code, None, response.headers, exc
                finally:
                    await response.aclose()
                try:
                    payload = json.loads(raw)
                except ValueError as exc:
                    return response.status_code, None, response.headers, exc
                if type(payload) is not dict:
                    return response.status_code, None, response.headers, ValueError("not a JSON object")
                return response.status_code, payload, response.headers, None
            if response is None:
                return None, None, None, TimeoutError(f"no answer within {timeout:g} s")
            return response.status_code, None, response.headers, TimeoutError(
                f"the answer's body did not arrive within {timeout:g} s")

    async def _with_retries(self, name: str, budget: _Budget, timeout: float,
                            attempt: Callable[[float], Awaitable[tuple]]) -> dict:
        policy = self.retry
        where = f"the gateway at {self.url}"
        while True:
            started = trio.current_time()
            limit = budget.answered_deadline()
            if started >= limit:
                raise GatewayUnavailableError(
                    f"{name}: the completion deadline of {policy.completion_total_s:g} s ran out "
                    f"({where})")
            budget.attempts += 1
            status, payload, headers, failure = await attempt(min(timeout, limit - started))
            now = trio.current_time()
            if status is None:
                self.stats.unanswered_attempts += 1
                budget.unreachable_s += now - started
                remaining = budget.unreachable_deadline() - now
                delay = policy.step(budget.attempts - 1)
                if remaining <= 0 or delay >= remaining:
                    await trio.sleep(max(0.0, remaining))
                    raise GatewayUnavailableError(
                        f"{name}: {where} was unreachable until the unreachable budget of "
                        f"{policy.unreachable_budget_s:g} s ran out: {_describe(failure)}")
                await trio.sleep(delay)
                budget.unreachable_s += delay
                self.stats.retries += 1
                continue
            self.stats.answered_attempts += 1
            budget.answered += 1
            if status == 200 and payload is not None:
                return payload
            if payload is None:
                error: EngineError = GatewayUnavailableError(
                    f"{name}: {where} answered HTTP {status} but its body failed: "
                    f"{_describe(failure)}")
                retryable, wait = True, None
            else:
                error = protocol.error_from(status, payload, name, where)
                retryable = protocol.is_retryable(status, payload)
                wait = protocol.retry_after_s(payload, headers, None)
            if not retryable:
                raise error
            if budget.answered > len(policy.answered_delays_s):
                raise _exhausted(error, name, budget.answered, where)
            delay = answered_wait(policy, budget.answered, wait)
            if now + delay >= budget.answered_deadline():
                raise GatewayUnavailableError(
                    f"{name}: the completion deadline of {policy.completion_total_s:g} s ran out "
                    f"({where}; last answer: {error})")
            await trio.sleep(delay)
            self.stats.retries += 1


def _describe(failure: BaseException | None) -> str:
    if failure is None:
        return "no detail"
    text = str(failure).strip()
    return f"{type(failure).__name__}: {text}" if text else type(failure).__name__


def _exhausted(error: EngineError, name: str, attempts: int, where: str) -> EngineError:
    message = (f"{name}: the answered-attempt budget ran out after {attempts} attempts "
               f"({where}): {error}")
    if isinstance(error, StoreUnavailableError) and not isinstance(error, GatewayUnavailableError):
        return type(error)(message, sqlstate=error.sqlstate)
    if type(error) is not EngineError and not isinstance(error, StoreUnavailableError):
        try:
            return type(error)(message)
        except TypeError:
            pass
    return GatewayUnavailableError(message)


# -- paged actions ------------------------------------------------------------------------------
_ROWS_BY_KEY = {protocol.ROWS_HEADER: protocol.ROWS_BY_KEY}

async def _send_admit(gateway: Gateway, action: Action, arguments: dict) -> Admission:
    """`sheets.admit` in pages under the body limit, answers merged (see `paging`)."""
    started = time.perf_counter()
    run, contract = arguments["run"], arguments["contract"]
    attempt = arguments.get("attempt")
    check_write(gateway, run, contract, attempt)
    namespace = normalize_namespace(arguments["table_namespace"])
    rows = arguments["rows"]
    offset = arguments.get("input_offset", 0)
    indexes = arguments.get("input_indexes")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidInputError(f"input_offset must be an integer >= 0, got {offset!r}")
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise InvalidInputError("rows must be a sequence of dicts")
    if indexes is not None:
        check_input_indexes(indexes, len(rows))
    check_give_up_after(arguments.get("give_up_after"))
    if arguments.get("staged_page") is not None:
        # One sealed page (at most 1,000 rows, its fact at most 1 MiB): one request, unpaged;
        # the server checks it and reads the rows' inputs from the stored fact.
        body = protocol.dumps(action.encode_input(
            {name: value for name, value in arguments.items() if name != "texts"}))
        return action.result.decode(await gateway.post(action, body), "result")
    # Positions ride in as input indexes, so every unique row keeps its place in the call.
    prepared = prepare_rows(rows, namespace, input_offset=0, keys=arguments.get("keys"),
                            need_texts=True, input_indexes=range(len(rows)),
                            texts=arguments.get("texts"))
    positions = prepared.indexes
    final = [indexes[p] for p in positions] if indexes is not None else [offset + p for p in positions]
    # Everything but the rows travels in every page (a new parameter of admit does too).
    arrays = ("rows", "keys", "input_indexes")
    fixed = action.encode_input({name: value for name, value in arguments.items()
                                 if name not in arrays and name not in ("input_offset", "texts")})
    health = await gateway.health()
    room = paging.room_for_rows(fixed, arrays, health.body_limit, "rows")
    key_texts = [json.dumps(key, ensure_ascii=False) for key in prepared.keys]
    index_texts = [str(index) for index in final]
    assert prepared.texts is not None
    sizes = [paging.utf8_size(row) + paging.utf8_size(key) + len(index) + 3
             for row, key, index in zip(prepared.texts, key_texts, index_texts)]
    results: list[Admission] = []
    for start, end in paging.pack(sizes, positions, room, "rows"):
        body = paging.page_body(fixed, [("rows", prepared.texts[start:end]),
                                        ("keys", key_texts[start:end]),
                                        ("input_indexes", index_texts[start:end])])
        answer = await gateway.post(action, body, headers=_ROWS_BY_KEY)
        page = action.result.decode(answer, "result")
        paging.check_admitted_page(page, dict(zip(prepared.keys[start:end], final[start:end])),
                                   run.epoch)
        results.append(page)
    # Pending rows come back by key (ROWS_HEADER): put back the rows this call sent.
    row_of = dict(zip(prepared.keys, prepared.rows))
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    return Admission(
        inserted=sum(page.inserted for page in results),
        skipped=prepared.skipped + sum(page.skipped for page in results),
        pending=tuple(AdmittedRow(row.key, row.input_index, row_of[row.key])
                      for page in results for row in page.pending),
        completed=tuple(row for page in results for row in page.completed),
        blocked=tuple(row for page in results for row in page.blocked),
        cached=sum(page.cached for page in results),
        write_version=run.epoch,
        timings=(Timing("gateway_pages", round(elapsed_ms, 3), len(rows)),
                 *(timing for page in results for timing in page.timings)),
    )


def _outcome_text(outcome: Any) -> str:
    dumps = json.dumps
    parts = [f'{{"key":{dumps(outcome.key, ensure_ascii=False)}',
             f',"status":"{"failed" if outcome.failed else "completed"}"',
             f',"data":{outcome.data_text}']
    if outcome.input_index is not None:
        parts.append(f',"input_index":{outcome.input_index}')
    if outcome.meta_text is not None:
        parts.append(f',"cell_meta":{outcome.meta_text}')
    if outcome.error is not None:
        parts.append(f',"error":{dumps(outcome.error, ensure_ascii=False)}')
    if outcome.attempts != 1:
        parts.append(f',"attempts":{outcome.attempts}')
    parts.append("}")
    return "".join(parts)


async def _send_complete(gateway: Gateway, action: Action, arguments: dict) -> Completion:
    """`sheets.complete` in pages under the body limit, one total deadline for all of them."""
    run, contract = arguments["run"], arguments["contract"]
    check_write(gateway, run, contract, arguments.get("attempt"))
    normalize_namespace(arguments["table_namespace"])
    prepared, input_rows = prepare_outcomes(arguments["outcomes"])
    budget = gateway._budget(action.name)
    fixed = action.encode_input({name: value for name, value in arguments.items()
                                 if name != "outcomes"})  # local parameters never travel
    health = await gateway.health()
    room = paging.room_for_rows(fixed, ("outcomes",), health.body_limit, "outcomes")
    texts = [_outcome_text(outcome) for outcome in prepared]
    sizes = [paging.utf8_size(text) + 1 for text in texts]
    positions = list(range(len(prepared)))
    results: list[Completion] = []
    for start, end in paging.pack(sizes, positions, room, "outcomes"):
        body = paging.page_body(fixed, [("outcomes", texts[start:end])])
        results.append(action.result.decode(await gateway.post(action, body, budget), "result"))
    diagnostics = _merge_diagnostics([page.diagnostics for page in results], input_rows)
    sink = arguments.get("on_diagnostics")
    if sink is not None and diagnostics is not None:
        await deliver_diagnostics(sink, diagnostics)
    return Completion(
        updated=sum(page.updated for page in results),
        committed_keys=tuple(key for page in results for key in page.committed_keys),
        fenced=tuple(row for page in results for row in page.fenced),
        diagnostics=diagnostics,
    )


def _merge_diagnostics(pages: list[CompletionDiagnostics | None], input_rows: int):
    pages = [page for page in pages if page is not None]
    if not pages:
        return None
    if len(pages) == 1:
        return attrs.evolve(pages[0], input_rows=input_rows)
    merged: dict[str, Any] = {}
    for field in attrs.fields(CompletionDiagnostics):
        values = [getattr(page, field.name) for page in pages]
        if field.name == "outcome":
            merged["outcome"] = "failed" if "failed" in values else "succeeded"
        else:
            merged[field.name] = sum(values)
    merged["input_rows"] = input_rows
    return CompletionDiagnostics(**merged)


async def _send_probe(gateway: Gateway, action: Action, arguments: dict) -> Admission | None:
    """`sheets.probe` in one request. A call too large for one request is answered None, as a
    probe that settles nothing: the caller then admits (which pages). A probe is a shortcut."""
    body = protocol.dumps(action.encode_input(arguments))
    health = await gateway.health()
    if len(body) > health.body_limit - protocol.PAGE_HEADROOM:
        return None
    return action.result.decode(await gateway.post(action, body), "result")


_SENDERS: dict[str, Callable[[Gateway, Action, dict], Awaitable[Any]]] = {
    "sheets.admit": _send_admit,
    "sheets.probe": _send_probe,
    COMPLETION_ACTION: _send_complete,
}


@contextlib.asynccontextmanager
async def open_gateway(url: str, token: str, *, retry: RetryPolicy | None = None,
                       max_in_flight: int = 8, db_sessions: bool = False) -> AsyncIterator[Gateway]:
    """A `Gateway` to `url` (`http(s)://host:port`) acting with `token`, until the block ends;
    with `db_sessions`, covered operations go straight to the database over sessions."""
    if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https") \
            or not urllib.parse.urlsplit(url).netloc:
        raise InvalidInputError(f"the gateway URL must be http(s)://host:port, got {url!r}")
    if not isinstance(token, str) or not token.strip():
        raise InvalidInputError("a gateway token is required (RUNPLANE_TOKEN)")
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise InvalidInputError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidInputError("retry must be a RetryPolicy or None")
    org = unverified_org(token.strip())
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    async with httpx.AsyncClient(limits=limits, timeout=None, trust_env=False) as client:
        gateway = Gateway(url.rstrip("/"), token.strip(), org, retry or RetryPolicy(),
                          max_in_flight, client)
        if not db_sessions:
            yield gateway
            return
        async with pg.open_driver() as driver:  # the event loop of the session pools
            await session_key(gateway)  # this process's RSA key, made once, before any action
            router = gateway.db_sessions = SessionRouter(gateway, driver, token_operations(token))
            try:
                yield gateway
            finally:
                gateway.db_sessions = None
                await router.aclose()
