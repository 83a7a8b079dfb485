"""Row policies of `run.map`: how often a row's call is retried, and how fast calls may start.

How it works
- `RowRetry` decides, for a call that raised, whether the row is called again and after how
  long: a `retry_on` exception that is not a `give_up_on` one is retried while the row has had
  fewer than `max_attempts` calls in this map; the wait before retry n (1, 2, …) is
  `min(max_interval_s, initial_s × backoff^(n-1))`, drawn uniformly from [0, that] with
  `jitter` (full jitter: rows that failed together do not come back together). A call that ran
  past `row_timeout_s` counts as a `TimeoutError` (`RowTimeoutError`).
- `RateLimit(per_second, burst=None, key=None)` bounds how fast calls of the map function
  start: a token bucket of `burst` tokens (default: one second's worth, at least 1) refilled
  at `per_second`. Without `key` the bucket is the map's own; with `key` it is shared by every
  process and run of the tenant using that key (`engine.limits.rates`), and the map leases
  tokens from it in batches of `lease_size` (about `LEASE_WINDOW_S` worth of calls).
Both are frozen values, validated when built. This module does no I/O.
"""

from __future__ import annotations

import math
import random

import attrs

from runplane.engine.limits.bounds import is_int, is_number
from runplane.engine.errors import InvalidInputError
from runplane.engine.limits.rates import check_key

from .backoff_delays import backoff_ceiling

LEASE_WINDOW_S = 0.2  # a shared-limit lease covers about this long of calls at the full rate


class RowTimeoutError(TimeoutError):
    """A row's call ran longer than `row_timeout_s` and was cancelled."""


def _number(minimum: float, *, strict: bool = False):
    def check(_instance: object, attribute: attrs.Attribute, value: object) -> None:
        bounds = {"above": minimum} if strict else {"low": minimum}
        if not is_number(value, finite=True, **bounds):
            relation = ">" if strict else ">="
            raise InvalidInputError(
                f"{attribute.name} must be a finite number {relation} {minimum}, got {value!r}")

    return check


def _exception_types(value: object) -> tuple[type[BaseException], ...]:
    types = (value,) if isinstance(value, type) else value
    if not isinstance(types, (tuple, list)) or not all(
            isinstance(t, type) and issubclass(t, Exception) for t in types):
        raise InvalidInputError(
            f"retry_on and give_up_on must be Exception classes or tuples of them, got {value!r}")
    return tuple(types)


def _max_attempts(_instance: object, _attribute: object, value: object) -> None:
    if not is_int(value, 1, 1_000_000):
        raise InvalidInputError(f"max_attempts must be an integer from 1 to 1000000, got {value!r}")


@attrs.frozen
class RowRetry:
    """Retry a row's failed call in place, with capped exponential backoff and full jitter."""

    max_attempts: int = attrs.field(default=3, validator=_max_attempts)
    initial_s: float = attrs.field(default=0.5, validator=_number(0))
    backoff: float = attrs.field(default=2.0, validator=_number(1))
    max_interval_s: float = attrs.field(default=30.0, validator=_number(0))
    jitter: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    retry_on: tuple[type[BaseException], ...] = attrs.field(
        default=(Exception,), converter=_exception_types)
    give_up_on: tuple[type[BaseException], ...] = attrs.field(
        default=(), converter=_exception_types)

    def retries(self, error: BaseException, calls: int) -> bool:
        """Whether a row whose `calls`-th call raised `error` is called again."""
        return (calls < self.max_attempts and isinstance(error, self.retry_on)
                and not isinstance(error, self.give_up_on))

    def delay_s(self, retry: int, rng: random.Random | None = None) -> float:
        """The wait before retry number `retry` (1 for the second call)."""
        ceiling = backoff_ceiling(retry, initial=self.initial_s, cap=self.max_interval_s,
                                  factor=self.backoff)
        if not self.jitter:
            return ceiling
        return (rng or random).uniform(0.0, ceiling)


def _optional_key(value: object) -> str | None:
    return None if value is None else check_key(value)


@attrs.frozen
class RateLimit:
    """Calls start at most `per_second` on average, in bursts of at most `burst`; with `key`,
    across every process and run of the tenant that uses the key."""

    per_second: float = attrs.field(validator=_number(0, strict=True))
    burst: float | None = attrs.field(default=None)
    key: str | None = attrs.field(default=None, converter=_optional_key)

    @burst.validator
    def _burst(self, attribute: attrs.Attribute, value: object) -> None:
        if value is not None:
            _number(1)(self, attribute, value)

    @property
    def capacity(self) -> float:
        """The bucket's size: `burst`, or one second's worth of calls (at least one)."""
        return float(self.burst) if self.burst is not None else max(1.0, float(self.per_second))

    @property
    def lease_size(self) -> int:
        """Tokens per shared-limit lease: about `LEASE_WINDOW_S` of calls, within the bucket."""
        return max(1, min(math.floor(self.capacity),
                          math.ceil(self.per_second * LEASE_WINDOW_S)))
