"""How a gateway client retries: the policy, and one pure decision per attempt (no I/O).

How it works
- `RetryPolicy` holds the budgets. An attempt that got a status line (whatever its body then
  did) is *answered*: it spends the `answered_delays_s` ladder — retried on 408, 429, 502, 503,
  504 and transient 500s, waiting the ladder's step or the server's `retry_after_ms` /
  `Retry-After`, whichever is longer, and at least `min_answered_wait_s` when the answer named
  no wait (`answered_wait`), at most `len(answered_delays_s) + 1` answered attempts. An attempt
  with no status line (refused, reset, DNS, timed out) is *unanswered*: it does not spend the
  ladder; it waits the ladder's step (then its last step) and retries until
  `unreachable_budget_s` after the operation began. A 503 that names a wait (`retry_after_ms`
  or `Retry-After`: the gateway is at its connection budget, or its store is away) is an outage
  too: it spends no answered attempt, waits what the server asked and is ridden within the same
  `unreachable_budget_s` (docs/guide/gateway.md). A 200 whose body is not a JSON object is a
  failed body (retried as above). A completion also has a total deadline,
  `completion_total_s` from its start plus the time spent unreachable (an outage extends it).
- `RetryState` is the bookkeeping of one operation (or of every page of one completion).
  `window(...)` is the time the next attempt may take (or the error when the completion
  deadline has run out); `decide(...)` turns what one attempt got (`Attempted`) into a
  `Decision`: the answer, a retry after `wait_s`, or a stop (wait `wait_s`, then raise
  `error`). Both are pure functions of their inputs, so every budget rule is tested without a
  server; `engine.gateway.transport` runs them.
- The error raised at the end names the budget that ran out and the URL, never the token.
"""

from __future__ import annotations

import math
from typing import Literal, Mapping

import attrs

from ..canonical import JsonObject
from ..limits.bounds import is_number
from ..errors import EngineError, GatewayUnavailableError, InvalidInputError, StoreUnavailableError
from . import protocol


def _non_negative(name: str):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if not is_number(value, 0, finite=True):
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
    """How a gateway client retries (see the module docstring). `admission_timeout_s` is how
    long one `sheets.admit` request may take (10 minutes): a large admission is never cut off
    by the client while the server may still apply it."""

    answered_delays_s: tuple[float, ...] = attrs.field(
        default=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0), converter=_delays)
    unreachable_budget_s: float = attrs.field(default=300.0, validator=_non_negative("unreachable_budget_s"))
    request_timeout_s: float = attrs.field(default=30.0, validator=_non_negative("request_timeout_s"))
    completion_total_s: float = attrs.field(default=600.0, validator=_non_negative("completion_total_s"))
    min_answered_wait_s: float = attrs.field(default=2.0, validator=_non_negative("min_answered_wait_s"))
    admission_timeout_s: float = attrs.field(default=600.0, validator=_non_negative("admission_timeout_s"))

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
class Attempted:
    """What one attempt got: `status` None when nothing answered; `payload` the body's JSON
    object (None when the body failed or was not one); `failure` what went wrong."""

    status: int | None
    payload: JsonObject | None = None
    headers: Mapping[str, str] | None = None
    failure: BaseException | None = None


@attrs.frozen
class RetryState:
    """The retry bookkeeping of one operation: when it began (`trio.current_time()`), whether
    it has a total deadline (a completion), answered attempts, attempts, and the seconds spent
    unreachable (waits included)."""

    started: float
    total_deadline: bool = False
    answered: int = 0
    attempts: int = 0
    unreachable_s: float = 0.0

    def answered_deadline(self, policy: RetryPolicy) -> float:
        if not self.total_deadline:
            return math.inf
        return self.started + self.unreachable_s + policy.completion_total_s

    def unreachable_deadline(self, policy: RetryPolicy) -> float:
        return self.started + policy.unreachable_budget_s


@attrs.frozen
class Decision:
    """What to do after an attempt: `answer` (return `payload`), `retry` (wait `wait_s`, then
    attempt again) or `stop` (wait `wait_s`, then raise `error`); `state` is the next state."""

    kind: Literal["answer", "retry", "stop"]
    state: RetryState
    wait_s: float = 0.0
    payload: JsonObject | None = None
    error: EngineError | None = None


def window(policy: RetryPolicy, state: RetryState, now: float, timeout: float, name: str,
           where: str) -> float:
    """How long the next attempt may take: `timeout`, cut to the completion deadline;
    `GatewayUnavailableError` when that deadline has run out."""
    limit = state.answered_deadline(policy)
    if now >= limit:
        raise GatewayUnavailableError(
            f"{name}: the completion deadline of {policy.completion_total_s:g} s ran out ({where})")
    return min(timeout, limit - now)


def decide(policy: RetryPolicy, state: RetryState, got: Attempted, started: float, now: float,
           name: str, where: str) -> Decision:
    """The decision after one attempt that began at `started` and ended at `now` (see the
    module docstring)."""
    state = attrs.evolve(state, attempts=state.attempts + 1)
    if got.status is None:
        state = attrs.evolve(state, unreachable_s=state.unreachable_s + (now - started))
        remaining = state.unreachable_deadline(policy) - now
        delay = policy.step(state.attempts - 1)
        if remaining <= 0 or delay >= remaining:
            return Decision("stop", state, max(0.0, remaining), error=GatewayUnavailableError(
                f"{name}: {where} was unreachable until the unreachable budget of "
                f"{policy.unreachable_budget_s:g} s ran out: {describe(got.failure)}"))
        return Decision("retry", attrs.evolve(state, unreachable_s=state.unreachable_s + delay),
                        delay)
    if got.status == 503 and got.payload is not None and protocol.is_retryable(503, got.payload):
        asked = protocol.retry_after_s(got.payload, got.headers, None)
        if asked is not None:
            return _ride(policy, state, got, (started, now, asked), name, where)
    state = attrs.evolve(state, answered=state.answered + 1)
    if got.status == 200 and got.payload is not None:
        return Decision("answer", state, payload=got.payload)
    if got.payload is None:
        error: EngineError = GatewayUnavailableError(
            f"{name}: {where} answered HTTP {got.status} but its body failed: "
            f"{describe(got.failure)}")
        retryable, wait = True, None
    else:
        error = protocol.error_from(got.status, got.payload, name, where)
        retryable = protocol.is_retryable(got.status, got.payload)
        wait = protocol.retry_after_s(got.payload, got.headers, None)
    if not retryable:
        return Decision("stop", state, error=error)
    if state.answered > len(policy.answered_delays_s):
        return Decision("stop", state, error=exhausted(error, name, state.answered, where))
    delay = answered_wait(policy, state.answered, wait)
    if now + delay >= state.answered_deadline(policy):
        return Decision("stop", state, error=GatewayUnavailableError(
            f"{name}: the completion deadline of {policy.completion_total_s:g} s ran out "
            f"({where}; last answer: {error})"))
    return Decision("retry", state, delay)


def _ride(policy: RetryPolicy, state: RetryState, got: Attempted,
          times: tuple[float, float, float], name: str, where: str) -> Decision:
    """A 503 naming a wait: ridden like an outage within the unreachable budget (the attempt
    and the wait count as time unreachable); `times` is (started, now, the wait asked)."""
    started, now, asked = times
    state = attrs.evolve(state, unreachable_s=state.unreachable_s + (now - started))
    remaining = state.unreachable_deadline(policy) - now
    if remaining <= 0 or asked >= remaining:
        assert got.payload is not None
        error = protocol.error_from(503, got.payload, name, where)
        return Decision("stop", state, max(0.0, remaining), error=GatewayUnavailableError(
            f"{name}: {where} answered 503 until the unreachable budget of "
            f"{policy.unreachable_budget_s:g} s ran out: {error}"))
    return Decision("retry", attrs.evolve(state, unreachable_s=state.unreachable_s + asked), asked)


def describe(failure: BaseException | None) -> str:
    """`Type: message` of a failure; an empty message borrows its cause's (a socket error
    wrapped by trio says nothing of its own)."""
    if failure is None:
        return "no detail"
    text = str(failure).strip() or (str(failure.__cause__).strip() if failure.__cause__ else "")
    return f"{type(failure).__name__}: {text}" if text else type(failure).__name__


def exhausted(error: EngineError, name: str, attempts: int, where: str) -> EngineError:
    """The error raised when the answered-attempt budget ran out: `error`'s class when it can
    carry the message, else `GatewayUnavailableError`."""
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
