"""The embedded supervisor: hosts runs in this process and drains the terminal outbox.

How it works
- `open_supervisor(tenant)` starts one drainer actor in its nursery and yields a `Supervisor`.
  `await sup.run(play, body)` runs `await body(run)` inside `open_run` (the run's own guard
  retires it when the body ends terminally) and then nudges the drainer.
- The drainer loops: lease a few due entries (`outbox.claim_due`: `FOR UPDATE SKIP LOCKED` plus
  a lease, so any number of drainers in any number of processes share one outbox without taking
  an entry twice), retire each on the `retirement` lane, mark it done. An entry whose retirement
  fails goes back with `next_attempt_at` pushed out by capped exponential backoff with jitter;
  a store failure of the drainer itself backs the loop off the same way. Entries leased by a
  process that died become due again when the lease expires, so pending work resumes after a
  restart. When nothing is due the drainer waits for a nudge or the poll interval (jittered).
- Only `pending` entries are drained: `open` entries belong to runs that may still be woken
  (cancelled or crashed). `abandon_after_s` opts in to retiring open entries untouched that long.
- Correctness rests on the database (lease fences on every settle, the run guard on every array
  write), never on this process's memory: `retired` is telemetry.
"""

from __future__ import annotations

import contextlib
import logging
import random
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import attrs
import trio

from runplane.engine.limits.bounds import is_number
from runplane.engine.errors import EngineError, InvalidInputError
from runplane.engine.ports import Port
from runplane.engine.sheets import Attempt
from runplane.engine.values.scopes import RunScope

from runplane.engine.runs import outbox

from . import retirement
from .backoff_delays import half_jittered_s
from .hosting import open_hosting_nursery
from .retirement import DEFAULT_LEASE_S, RELEASE_DEADLINE_S
from .run import Run, open_run

log = logging.getLogger("runplane.actors")

T = TypeVar("T")


def _positive(name: str):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if not is_number(value, above=0):
            raise InvalidInputError(f"{name} must be a positive number, got {value!r}")

    return check


def _non_negative(name: str):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if not is_number(value, 0):
            raise InvalidInputError(f"{name} must be a number >= 0, got {value!r}")

    return check


@attrs.define(eq=False)
class Supervisor:
    """A process-local host of runs and drainer of the tenant's terminal outbox."""

    port: Port
    poll_interval: float = attrs.field(default=1.0, validator=_positive("poll_interval"))
    lease_s: float = attrs.field(default=DEFAULT_LEASE_S, validator=_positive("lease_s"))
    batch: int = attrs.field(default=8, validator=_positive("batch"))
    backoff_base: float = attrs.field(default=0.5, validator=_positive("backoff_base"))
    backoff_cap: float = attrs.field(default=60.0, validator=_positive("backoff_cap"))
    abandon_after_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_non_negative("abandon_after_s")))
    owner: str = attrs.field(factory=lambda: outbox.new_owner_id("supervisor"))
    retired: list[RunScope] = attrs.field(init=False, factory=list)
    failures: int = attrs.field(init=False, default=0)
    _rng: random.Random = attrs.field(init=False, factory=random.Random, repr=False)
    _nudge: trio.Event = attrs.field(init=False, factory=trio.Event, repr=False)
    _settled: trio.Event = attrs.field(init=False, factory=trio.Event, repr=False)

    # -- hosting runs --------------------------------------------------------------------------
    async def run(self, play: str, body: Callable[[Run], Awaitable[T]],
                  run_id: str | None = None, *, attempt: Attempt | None = None,
                  retire_on_exit: bool = True, force: bool = False) -> T:
        """Run `await body(run)` inside a supervised run (`open_run` with these options) and
        return what it returns."""
        try:
            async with open_run(self.port, play, run_id, attempt=attempt, lease_s=self.lease_s,
                                retire_on_exit=retire_on_exit, force=force) as run:
                return await body(run)
        finally:
            self.nudge()

    def nudge(self) -> None:
        """Wake the drainer now instead of at its next poll."""
        self._nudge.set()

    # -- draining ------------------------------------------------------------------------------
    async def drain_once(self) -> list[RunScope]:
        """Lease the due entries once (up to `batch`), settle each; return those retired."""
        # A gateway token for some plays drains those plays only (an org-wide claim would be
        # refused); a tenant, or a token for every play, drains the whole org.
        plays = self.port.settings.token_plays
        entries = await outbox.claim_due(
            self.port, self.owner, limit=self.batch, lease_s=self.lease_s,
            abandon_after_s=self.abandon_after_s, **({"plays": list(plays)} if plays else {}),
        )
        done: list[RunScope] = []
        for entry in entries:
            if await self._settle(entry):
                done.append(entry.scope)
        return done

    async def _settle(self, entry: outbox.OutboxEntry) -> bool:
        settled = False
        try:
            outcome = await retirement.finish_entry(
                self.port, entry.scope, self.owner, lease_s=self.lease_s
            )
            settled = True
        except EngineError as exc:
            settled = True
            self.failures += 1
            delay = half_jittered_s(entry.attempts, initial=self.backoff_base, cap=self.backoff_cap,
                                  rng=self._rng)
            log.warning("outbox %s: retirement failed (retry in %.1fs): %s",
                        entry.scope.run_id, delay, exc)
            with contextlib.suppress(EngineError):
                await outbox.retry_later(self.port, entry.scope, self.owner, str(exc), delay)
            return False
        finally:
            if not settled:  # cancelled: hand the entry to the next drainer at once
                with trio.CancelScope(shield=True,
                                      deadline=trio.current_time() + RELEASE_DEADLINE_S):
                    with contextlib.suppress(EngineError):
                        await outbox.release(self.port, entry.scope, self.owner)
        if outcome.settled:
            self.retired.append(entry.scope)
            self._signal_settled()
        return outcome.settled

    def _signal_settled(self) -> None:
        self._settled.set()
        self._settled = trio.Event()

    async def wait_retired(self, scope: RunScope) -> None:
        """Wait until this supervisor has retired `scope` (bound it with a timeout)."""
        while scope not in self.retired:
            await self._settled.wait()

    async def _drainer(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        store_failures = 0
        while True:
            try:
                retired = await self.drain_once()
                store_failures = 0
            except EngineError as exc:
                store_failures += 1
                self.failures += 1
                delay = half_jittered_s(store_failures, initial=self.backoff_base,
                                      cap=self.backoff_cap, rng=self._rng)
                log.warning("supervisor: outbox unavailable (retry in %.1fs): %s", delay, exc)
                await trio.sleep(delay)
                continue
            if retired:
                continue  # more may be due
            wait = self.poll_interval * (0.75 + self._rng.random() / 2)
            with trio.move_on_after(wait):
                await self._nudge.wait()
            self._nudge = trio.Event()


@contextlib.asynccontextmanager
async def open_supervisor(tenant: Port, *, drain: bool = True,
                          **options: float | str | None) -> AsyncIterator[Supervisor]:
    """Host runs and (unless `drain=False`) drain the outbox until the block ends; `options`
    are the `Supervisor`'s settings (`poll_interval`, `lease_s`, `batch`, ...)."""
    sup = Supervisor(tenant, **options)
    async with open_hosting_nursery(cancel_on_exit=True) as nursery:
        if drain:
            await nursery.start(sup._drainer)
        yield sup
