"""Pacing a map's calls: the token buckets behind `RateLimit`.

How it works
- A worker awaits `pacer.take()` before each call of the map function. Takers queue on a fair
  `trio.Lock` (first come, first served), so while one waits for the next token the others
  wait behind it instead of all waking on every token.
- `LocalBucket`: tokens accrue at `per_second` up to the capacity, on trio's clock; the bucket
  starts full. The k-th call (from 0) starts no earlier than `(k - capacity + 1) / per_second`
  seconds after the first.
- `SharedBucket`: tokens come from the tenant database (`engine.limits.rates.lease`), in leases of
  `lease_size`, one statement each; a lease that finds too few tokens says how long to wait, and
  the bucket sleeps that long before leasing again. Leased tokens are spent locally; those left
  when the map ends are dropped (the shared bucket never gets them back, so it never
  over-issues). Leases are retried through transient store faults (`actors.retry`).
- No permit is held while waiting for a token: a lease takes one only for its statement.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import trio

from runplane.engine.limits import rates as rate_limits
from runplane.engine.ports import Port

from .policies import RateLimit
from .retry import retry_transient

TOKEN_EPSILON = 1e-9
WAKE_MARGIN_S = 0.001  # sleep past the computed refill time, never wake a hair early


class Pacer(Protocol):
    async def take(self) -> None: ...


@attrs.define(eq=False)
class LocalBucket:
    """A process-local token bucket."""

    per_second: float
    capacity: float
    _tokens: float = attrs.field(init=False)
    _stamp: float = attrs.field(init=False, factory=trio.current_time)
    _lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)

    def __attrs_post_init__(self) -> None:
        self._tokens = self.capacity

    async def take(self) -> None:
        async with self._lock:
            while True:
                now = trio.current_time()
                self._tokens = min(self.capacity,
                                   self._tokens + (now - self._stamp) * self.per_second)
                self._stamp = now
                if self._tokens >= 1 - TOKEN_EPSILON:  # float refills land a hair short
                    self._tokens = max(0.0, self._tokens - 1)
                    return
                await trio.sleep((1 - self._tokens) / self.per_second)


@attrs.define(eq=False)
class SharedBucket:
    """Tokens leased from the tenant's shared bucket `limit.key`."""

    port: Port
    limit: RateLimit
    leases: int = 0          # statements issued (for the benchmark and tests)
    _tokens: int = attrs.field(init=False, default=0)
    _lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)

    async def take(self) -> None:
        async with self._lock:
            while self._tokens == 0:
                lease = await retry_transient(lambda: rate_limits.lease(
                    self.port, self.port.org_id, self.limit.key,
                    per_second=self.limit.per_second, burst=self.limit.capacity,
                    want=self.limit.lease_size,
                ))
                self.leases += 1
                self._tokens += lease.granted
                if not lease.granted:
                    await trio.sleep(lease.retry_after_s + WAKE_MARGIN_S)
            self._tokens -= 1


def open_pacer(port: Port, limit: RateLimit | None) -> Pacer | None:
    """The bucket a map's workers take tokens from, or None without a limit."""
    if limit is None:
        return None
    if limit.key is None:
        return LocalBucket(float(limit.per_second), limit.capacity)
    return SharedBucket(port, limit)
