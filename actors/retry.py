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
  to the last failure. The budget is a wall-clock bound on the outage, which begins when the
  first failing attempt began (a connect that times out counts from its start): every attempt
  is cut off once it has gone unanswered for the budget — while the run is waiting for the
  database, at the outage's start plus the budget — and connects (their ladder included,
  `engine.pg.connects_until`) never wait past that. An attempt cut off raises
  `StoreOutageError` like a failure past the budget (a store call is one short batch: one that
  the database leaves unanswered for the whole budget is an outage, as over a network that
  drops packets). From then on the run is ending: later calls under the same watch (the
  shielded flush of computed outcomes, the run's guard) try once, for at most
  `ENDING_ATTEMPT_S`, and do not wait. The same holds inside `hurry_if_waiting()` while the
  database looks away — calls wait for it, or a connect its caller gave up on had waited past
  `STALL_S` unanswered (a hung connect fails no call before the budget cuts it): the flush of a
  map cancelled during an outage, so Ctrl-C exits at once instead of flushing against a
  database that is away. An outage ends when a call
  answers again; calls that gave up (cancelled) leave it under way. The watch
  tells observers (progress output) that the run is waiting for the database and since when,
  and logs one warning when a wait begins and one when the database is back.
- Outside a run (the supervisor's drainer, which has its own backoff), `RETRY_DELAYS` are the
  waits before attempts 2, 3, …, jittered the same way.
- Every wait is cancellable.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import math
import random
from typing import Awaitable, Callable, Iterator, TypeVar

import attrs
import trio

from runplane.engine import pg
from runplane.engine.observability import metrics
from runplane.engine.runs.outages import MAX_OUTAGES, Outage
from runplane.engine.errors import (
    GatewayUnavailableError, RollbackFailedError, StoreOutageError, StoreUnavailableError,
    TransactionStateUnknownError,
)

from .backoff_delays import half_jittered_s

T = TypeVar("T")

log = logging.getLogger("runplane.actors")

RETRY_DELAYS = (0.05, 0.25, 1.0, 2.0)
BACKOFF_INITIAL_S = 0.05
BACKOFF_CAP_S = 2.0
ENDING_ATTEMPT_S = 0.5  # one try of a call once the run is ending (budget spent, or hurried)
STALL_S = 0.5  # a connect given up after this long unanswered marks the database as away
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
    # the connects of the run's tasks: one unanswered past `STALL_S` says the database may be
    # away though no call failed yet (`engine.pg.ConnectWatch`; cleared when a call answers)
    connects: pg.ConnectWatch = attrs.field(factory=lambda: pg.ConnectWatch(STALL_S))
    # attempts in flight: their cancel scopes, and when each began
    _attempts: dict = attrs.field(factory=dict, repr=False)
    # outages that ended and are not yet written for the run's timeline (`take_ended`)
    _ended: list[Outage] = attrs.field(factory=list, repr=False)

    def take_ended(self) -> list[Outage]:
        """The outages that ended since the last call (`engine.runs.outages`)."""
        ended, self._ended = self._ended, []
        return ended

    def give_back(self, outages: list[Outage]) -> None:
        """Outages that could not be written: written with the next ones."""
        self._ended[:0] = outages[-MAX_OUTAGES:]

    def attempt_deadline(self, ending: bool) -> float:
        """The trio time at which an attempt starting now is cut off: after the budget, from
        the start of the outage if one is under way, else from its own start."""
        now = trio.current_time()
        if ending:
            return now + ENDING_ATTEMPT_S
        if self.since is None and self.budget_s <= 0:
            return math.inf  # a zero budget ends the run at its first failure, never sooner
        return (now if self.since is None else min(now, self.since)) + self.budget_s

    def away(self) -> bool:
        """Whether the database looks away: calls are waiting for it, or a connect of the run's
        tasks has gone unanswered past `STALL_S` (in flight, or given up on): a connect that
        hangs fails no call until the budget cuts it, so Ctrl-C can arrive before any failure.
        A statement that is merely slow does not count: a busy server answers connects."""
        return self.since is not None or self.connects.stalled()

    def waiting_s(self) -> float | None:
        """Seconds the run has been waiting for the database, or None when it is not: since a
        call first failed for it, or, before any did, since a connect that has gone unanswered
        past `STALL_S` began (a server that accepts no connection fails no call until a
        deadline cuts the attempt, tens of seconds later: the wait is shown from the start)."""
        since = self.since if self.since is not None else self.connects.stalled_at()
        if since is None:
            return None
        return max(0.0, trio.current_time() - since)

    def _begin(self, at: float, error: BaseException | str) -> None:
        if self.waiting == 0:
            if self.since is None:  # else an outage its callers gave up on is still under way
                self.since = at
                log.warning("waiting for the database (outage budget %gs): %s",
                            self.budget_s, error)
            for scope in self._attempts:  # attempts in flight end with the budget too
                scope.deadline = min(scope.deadline, self.since + self.budget_s)
        self.waiting += 1

    def _end(self, recovered: bool) -> None:
        """A waiting call ended. The outage ends when one recovers, or when any call succeeds
        (`_answered`); calls that gave up (cancelled, or out of budget) leave it under way."""
        self.waiting -= 1
        if recovered and self.waiting == 0:
            self._answered()

    def _answered(self) -> None:
        if self.since is None:
            return
        waited = trio.current_time() - self.since
        self.outages += 1
        self.waited_s += waited
        metrics.outage_ended(waited)  # `runplane_store_outage_seconds_total`
        began = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=waited)
        self._ended = [*self._ended, Outage(began, waited)][-MAX_OUTAGES:]
        log.warning("the database is back after %.1fs; resuming", waited)
        self.since = None
        if not self.exhausted:
            for scope, began in self._attempts.items():
                scope.deadline = began + self.budget_s if self.budget_s > 0 else math.inf


_watch: contextvars.ContextVar[OutageWatch | None] = contextvars.ContextVar(
    "runplane_outage_watch", default=None)


def current_watch() -> OutageWatch | None:
    """The outage watch of the run this task works for, if any."""
    return _watch.get()


def install_watch(watch: OutageWatch | None) -> tuple[contextvars.Token, contextvars.Token]:
    """Make `watch` the current task's (and its future children's) watch, and its connect
    watch theirs (`engine.pg.ConnectWatch`); reset with the token."""
    return _watch.set(watch), pg.watch_connects(None if watch is None else watch.connects)


def reset_watch(token: tuple[contextvars.Token, contextvars.Token]) -> None:
    pg.reset_connect_watch(token[1])
    _watch.reset(token[0])


_hurry: contextvars.ContextVar[bool] = contextvars.ContextVar("runplane_hurry", default=False)


@contextlib.contextmanager
def hurry_if_waiting() -> Iterator[bool]:
    """In the block, when the database looks away (`OutageWatch.away`), store calls try once,
    for at most `ENDING_ATTEMPT_S`, and do not wait: for teardown that must not wait out the
    budget (a map cancelled during an outage). Yields whether the run was waiting."""
    watch = _watch.get()
    waiting = watch is not None and watch.away()
    token = _hurry.set(waiting or _hurry.get())
    try:
        yield waiting
    finally:
        _hurry.reset(token)


def backoff_s(attempt: int, rng: random.Random | None = None) -> float:
    """The wait after the `attempt`-th failure (1-based): d = min(cap, initial·2^(n-1)),
    uniform in [d/2, d] (`actors.backoff_delays`)."""
    return half_jittered_s(attempt, initial=BACKOFF_INITIAL_S, cap=BACKOFF_CAP_S, rng=rng)


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
    started: float | None = None  # when this call's first failed attempt began
    failures = 0
    recovered = False
    try:
        while True:
            attempt_at = trio.current_time()
            ending = watch.exhausted or _hurry.get()
            cut_at = watch.attempt_deadline(ending)
            error: BaseException | None = None
            with trio.CancelScope(deadline=cut_at) as cut:
                watch._attempts[cut] = attempt_at
                try:
                    with pg.connects_until(None if cut_at == math.inf else cut_at):
                        result = await operation()
                except NOT_RETRIED:
                    raise
                except TRANSIENT as exc:
                    error = exc
                finally:
                    del watch._attempts[cut]
            if error is None and not cut.cancelled_caught:
                recovered = True
                watch.connects.clear()
                if started is None and watch.waiting == 0:
                    watch._answered()  # an outage whose calls gave up is over
                return result
            now = trio.current_time()
            if started is None:
                started = attempt_at
                watch._begin(attempt_at, error or "no answer")
            failures += 1
            outage_began = min(started, watch.since if watch.since is not None else started)
            waited = now - outage_began
            if ending or cut.cancelled_caught or waited >= watch.budget_s:
                raise _outage_error(watch, waited, error, hurried=ending and not watch.exhausted)
            remaining = outage_began + watch.budget_s - now
            await trio.sleep(min(backoff_s(failures), remaining))
    finally:
        if started is not None:
            watch._end(recovered)


def _outage_error(watch: OutageWatch, waited: float, error: BaseException | None, *,
                  hurried: bool) -> StoreOutageError:
    """The error that ends a call: the budget is spent (the run ends), or the run is ending."""
    reason = str(error) if error is not None else "the attempt was cut off at the budget"
    sqlstate = getattr(error, "sqlstate", None)
    if watch.exhausted:
        message = (f"the database is still out of reach and the run's outage budget of "
                   f"{watch.budget_s:g}s is spent: {reason}")
    elif hurried:
        message = (f"the database is still out of reach and the run is ending (outage budget "
                   f"{watch.budget_s:g}s): {reason}")
    else:
        message = (f"the database stayed out of reach for {waited:.1f}s, past the outage "
                   f"budget of {watch.budget_s:g}s (RUNPLANE_OUTAGE_BUDGET_S): {reason}")
    if not hurried:
        watch.exhausted = True
    outage = StoreOutageError(message, waited_s=waited, budget_s=watch.budget_s, sqlstate=sqlstate)
    if error is not None:
        outage.__cause__ = error
    return outage
