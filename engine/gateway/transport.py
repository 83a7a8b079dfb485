"""The gateway client's transport: one HTTP attempt, and the loop that retries it.

How it works
- `attempt(...)` sends one request while holding one of the client's in-flight permits (held
  for one attempt, never across a retry's wait) and reads the whole answer within `timeout`:
  it returns an `Attempted` (`engine.gateway.retry`): no status when nothing answered, the
  status and no payload when the body failed or was not a JSON object.
- Requests go through the client's `http11.ConnectionPool` (HTTP/1.1 keep-alive, `h11` over
  trio streams): no request or response model, a request sent in one write. `target` is the
  path (the pool knows the origin); the answer's headers come back by lower-case name.
- `with_retries(...)` runs attempts until `retry.decide` answers or stops; it sleeps the waits
  the decisions name and keeps the client's `GatewayStats`.
- `attempt_timeout(policy, action)`: one attempt may take `request_timeout_s`, or the action's
  server-side deadline plus `DEADLINE_MARGIN_S` when that is longer (a completion may run 75 s
  on the server), so a client never gives up on a write the server is still allowed to apply;
  `sheets.admit` may take `admission_timeout_s` (10 minutes).
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable, Mapping

import attrs
import trio

from ..actions import Action
from ..canonical import JsonObject
from ..permits import Permits
from .http11 import Answer, ConnectionPool, TransportError
from .retry import Attempted, RetryPolicy, RetryState, decide, window

DEADLINE_MARGIN_S = 5.0
ADMISSION_ACTION = "sheets.admit"


def attempt_timeout(policy: RetryPolicy, action: Action) -> float:
    """How long one attempt of `action` may take (see the module docstring)."""
    timeout = max(policy.request_timeout_s, action.deadline_s + DEADLINE_MARGIN_S)
    if action.name == ADMISSION_ACTION:
        timeout = max(timeout, policy.admission_timeout_s)
    return timeout


@attrs.define(eq=False)
class GatewayStats:
    """Attempts this client made, by kind (telemetry, for tests and simulations)."""

    operations: int = 0
    answered_attempts: int = 0
    unanswered_attempts: int = 0
    retries: int = 0


@attrs.define(eq=False)
class Budget:
    """The retry state of one operation (or of every page of one completion), carried from
    one request to the next."""

    state: RetryState


async def attempt(pool: ConnectionPool, permits: Permits, method: str, target: str,
                  timeout: float, body: bytes | None, headers: Mapping[str, str]) -> Attempted:
    """One attempt (see the module docstring)."""
    await permits.acquire()
    try:
        return await _attempt(pool, method, target, timeout, body, headers)
    finally:
        permits.release()


async def _attempt(pool: ConnectionPool, method: str, target: str, timeout: float,
                   body: bytes | None, headers: Mapping[str, str]) -> Attempted:
    answer = Answer()
    with trio.move_on_after(timeout):
        try:
            await pool.request(method, target, list(headers.items()), body, answer)
        except TransportError as exc:
            return Attempted(answer.status, None, answer.headers, exc) \
                if answer.status is not None else Attempted(None, failure=exc)
        try:
            payload = json.loads(answer.body)
        except ValueError as exc:
            return Attempted(answer.status, None, answer.headers, exc)
        if type(payload) is not dict:
            return Attempted(answer.status, None, answer.headers,
                             ValueError("not a JSON object"))
        return Attempted(answer.status, payload, answer.headers)
    if answer.status is None:
        return Attempted(None, failure=TimeoutError(f"no answer within {timeout:g} s"))
    return Attempted(answer.status, None, answer.headers, TimeoutError(
        f"the answer's body did not arrive within {timeout:g} s"))


async def with_retries(policy: RetryPolicy, stats: GatewayStats, name: str, where: str,
                       budget: Budget, timeout: float,
                       send: Callable[[float], Awaitable[Attempted]]) -> JsonObject:
    """The first answer `send(timeout)` gets, retried as `retry.decide` says."""
    while True:
        started = trio.current_time()
        limit = window(policy, budget.state, started, timeout, name, where)
        got = await send(limit)
        if got.status is None:
            stats.unanswered_attempts += 1
        else:
            stats.answered_attempts += 1
        decision = decide(policy, budget.state, got, started, trio.current_time(), name, where)
        budget.state = decision.state
        if decision.kind == "answer":
            assert decision.payload is not None
            return decision.payload
        await trio.sleep(decision.wait_s)
        if decision.kind == "stop":
            assert decision.error is not None
            raise decision.error
        stats.retries += 1
