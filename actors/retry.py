"""Retrying idempotent store calls through transient faults and store outages.

How it works
- A run that raises is terminal: its guard retires its staged input, and a wake can no longer
  replay it. So a dropped connection, or a database that restarts, must not end a map. Every
  store call the actors make on a run's behalf is idempotent by construction — admitting a page
  again re-admits the same rows under the same write version, an identical completion is a
  no-op, pages and seals are write-once, reads are reads — or runs in one transaction whose
  lost COMMIT reply `engine.pg` resolves (committed: done once; rolled back: nothing applied),
  so the actors retry them.
- Retried: `StoreUnavailableError` (the connection failed or could not be made, the server is
  shutting down or starting up; the call may or may not have been applied) and
  `TransactionStateUnknownError` when a lost COMMIT's outcome could not be read (same; every
  operation is idempotent). A failed rollback (`RollbackFailedError`) is never retried: what
  the failed operation left is unknown. Everything else (bad input, conflicts, retirement, a missing relation after
  repair) is raised at once, and so are `GatewayUnavailableError` (a gateway client has already
  retried through its own budgets) and `StoreOutageError` (an inner retry's budget ran out).
- Inside a run (`open_run` installs the run's `OutageWatch`, with the tenant's
  `outage_budget_s`), a call is retried with capped exponential backoff and jitter
  (`BACKOFF_INITIAL_S` doubling up to `BACKOFF_CAP_S`, each wait uniform in [d/2, d]) for as
  long as it has failed for less than the budget; then it raises `StoreOutageError`, chained
  to the last failure. The budget is checked between attempts, never by cutting one off: an
  attempt includes one connect (its own ladder, SPEC §3), so a run ends at its first failure
  past the budget. From then on the run is ending: later calls under the same watch (the
  shielded flush of computed outcomes, the run's guard) try once and do not wait. The watch
  tells observers (progress output) that the run is waiting for the database and since when,
  and logs one warning when a wait begins and one when the database is back.
- Outside a run (the supervisor's drainer, which has its own backoff), `RETRY_DELAYS` are the
  waits before attempts 2, 3, …, jittered the same way.
- Every wait is cancellable.
"""

from __future__ import annotations

import contextvars
import logging
import random
from typing import Awaitable, Callable, TypeVar

import attrs
import trio

from runplane.engine.errors import (
    GatewayUnavailableError, RollbackFailedError, StoreOutageError, StoreUnavailableError,
    TransactionStateUnknownError,
)

T = TypeVar("T")

log = logging.getLogger("runplane.actors")

RETRY_DELAYS = (0.05, 0.25, 1.0, 2.0)
BACKOFF_INITIAL_S = 0.05
BACKOFF_CAP_S = 2.0
TRANSIENT = (StoreUnavailableError, TransactionStateUnknownError)
NOT_RETRIED = (GatewayUnavailableError, StoreOutageError, RollbackFailedError)


@attrs.define(eq=False)
class OutageWatch:
    """How a run is faring against store outages: its budget, and whether (and since when)
    some of its store calls are waiting for the database. Written only by `retry_transient`."""

    budget_s: float
    waiting: int = 0              # calls waiting right now
    since: float | None = None    # trio time the current wait began (None: not waiting)
    outages: int = 0              # waits that ended with the database back
    waited_s: float = 0.0         # their total length
    exhausted: bool = False       # a call ran out of budget: the run is ending

    def waiting_s(self) -> float | None:
        """Seconds the run has been waiting for the database, or None when it is not."""
        if self.since is None:
            return None
        return max(0.0, trio.current_time() - self.since)

    def _begin(self, at: float, error: BaseException) -> None:
        if self.waiting == 0:
            self.since = at
            log.warning("waiting for the database (outage budget %gs): %s", self.budget_s, error)
        self.waiting += 1

    def _end(self, recovered: bool) -> None:
        self.waiting -= 1
        if self.waiting == 0 and self.since is not None:
            if recovered:
                waited = trio.current_time() - self.since
                self.outages += 1
                self.waited_s += waited
                log.warning("the database is back after %.1fs; resuming", waited)
            self.since = None


_watch: contextvars.ContextVar[OutageWatch | None] = contextvars.ContextVar(
    "runplane_outage_watch", default=None)


def current_watch() -> OutageWatch | None:
    """The outage watch of the run this task works for, if any."""
    return _watch.get()


def install_watch(watch: OutageWatch | None) -> contextvars.Token:
    """Make `watch` the current task's (and its future children's) watch; reset with the token."""
    return _watch.set(watch)


def reset_watch(token: contextvars.Token) -> None:
    _watch.reset(token)


def backoff_s(attempt: int, rng: random.Random | None = None) -> float:
    """The wait after the `attempt`-th failure (1-based): d = min(cap, initial·2^(n-1)),
    uniform in [d/2, d]."""
    ceiling = min(BACKOFF_CAP_S, BACKOFF_INITIAL_S * (2 ** max(0, attempt - 1)))
    return ceiling / 2 + (rng or random).random() * ceiling / 2


async def retry_transient(operation: Callable[[], Awaitable[T]], *,
                          delays: tuple[float, ...] = RETRY_DELAYS,
                          watch: OutageWatch | None = None) -> T:
    """`await operation()`, again while it fails transiently: through the outage budget of
    `watch` (default: the current run's), or after each of `delays` outside a run."""
    watch = watch if watch is not None else _watch.get()
    if watch is None:
        for delay in delays:
            try:
                return await operation()
            except NOT_RETRIED:
                raise
            except TRANSIENT:
                await trio.sleep(delay / 2 + random.random() * delay / 2)
        return await operation()
    return await _ride(operation, watch)


async def _ride(operation: Callable[[], Awaitable[T]], watch: OutageWatch) -> T:
    started: float | None = None
    failures = 0
    recovered = False
    try:
        while True:
            try:
                result = await operation()
            except NOT_RETRIED:
                raise
            except TRANSIENT as exc:
                now = trio.current_time()
                if started is None:
                    started = now
                    watch._begin(now, exc)
                failures += 1
                waited = now - started
                if watch.exhausted:
                    raise StoreOutageError(
                        f"the database is still out of reach and the run's outage budget of "
                        f"{watch.budget_s:g}s is spent: {exc}",
                        waited_s=waited, budget_s=watch.budget_s,
                        sqlstate=getattr(exc, "sqlstate", None),
                    ) from exc
                if waited >= watch.budget_s:
                    watch.exhausted = True
                    raise StoreOutageError(
                        f"the database stayed out of reach for {waited:.1f}s, past the outage "
                        f"budget of {watch.budget_s:g}s (RUNPLANE_OUTAGE_BUDGET_S): {exc}",
                        waited_s=waited, budget_s=watch.budget_s,
                        sqlstate=getattr(exc, "sqlstate", None),
                    ) from exc
                remaining = watch.budget_s - waited
                await trio.sleep(min(backoff_s(failures), remaining))
                continue
            recovered = True
            return result
    finally:
        if started is not None:
            watch._end(recovered)
