"""What a shared-map worker holds of its claims: each unit's recorded and decided rows, and
one row's run under the map's policies.

How it works
- A `UnitWork` is one held unit: `recorded`, the settled mask the database has; `decided`,
  the rows settled since (the admission's cache hits, blocked and skipped rows, and rows that
  ran), with their outcomes and counters, which the next batch records (`taken`, then
  `recorded_batch` once its transaction committed). A `Claim` is the units claimed under one
  holder (one attempt): a batch of completions covers one claim.
`count_written` adds a written batch to `runplane_rows_total` (`engine.observability`).
It makes no store call.
"""

from __future__ import annotations

import collections
import attrs
import trio

from runplane.engine.observability.metrics import RowMeters, RowOutcome as Counted
from runplane.engine.sheets import AdmittedRow, Completion, OutcomeStatus, RowOutcome
from runplane.engine.shared.leases import UnitLease

from ..map_state import MapPlan
from ..mapper import call_row
from ..pacing import Pacer
from ..policies import RowTimeoutError


async def run_row(plan: MapPlan, pacer: Pacer | None,
                  admitted: AdmittedRow) -> tuple[RowOutcome, int]:
    """A row under the map's policies: called, retried in place while the retry policy says
    so; its outcome (recording the calls it took) and how many of its calls timed out."""
    calls = timeouts = 0
    while True:
        calls += 1
        if pacer is not None:
            await pacer.take()
        outcome, error = await call_row(plan, admitted, calls)
        if error is None:
            return outcome, timeouts
        if isinstance(error, RowTimeoutError):
            timeouts += 1
        if plan.retry is None or not plan.retry.retries(error, calls):
            return outcome, timeouts
        await trio.sleep(plan.retry.delay_s(calls))


@attrs.define(eq=False)
class UnitWork:
    """One held unit: what is recorded of it, and what was decided since."""

    lease: UnitLease
    recorded: int                   # the settled mask as the database has it
    decided: int = 0                # rows settled since (admission decisions, outcomes)
    outcomes: list[RowOutcome] = attrs.field(factory=list)
    tally: collections.Counter = attrs.field(factory=collections.Counter)  # admission's
    executed: int = 0               # rows run since, and their calls, retries and timeouts
    calls_made: int = 0
    timed_out: int = 0
    lost: bool = False
    calls: set[trio.CancelScope] = attrs.field(factory=set)

    def bit(self, input_index: int) -> int:
        return 1 << (input_index - self.lease.low)

    def finish(self, admitted: AdmittedRow, outcome: RowOutcome, timeouts: int) -> None:
        if not self.lost:
            self.decided |= 1 << (admitted.input_index - self.lease.low)
            self.outcomes.append(outcome)
            self.executed += 1
            self.calls_made += outcome.attempts
            self.timed_out += timeouts

    def taken(self) -> tuple[int, int, collections.Counter]:
        """What the next batch records: decided rows, outcomes, counters."""
        tally = collections.Counter(self.tally)
        tally.update(executed=self.executed, calls=self.calls_made,
                     retried=self.calls_made - self.executed, timed_out=self.timed_out)
        return self.decided, len(self.outcomes), tally

    def recorded_batch(self, decided: int, count: int, tally: collections.Counter) -> None:
        self.recorded |= decided
        self.decided &= ~decided
        del self.outcomes[:count]
        self.tally.subtract({k: tally[k] for k in self.tally})
        self.executed -= tally["executed"]
        self.calls_made -= tally["calls"]
        self.timed_out -= tally["timed_out"]


@attrs.define(eq=False)
class Claim:
    holder: str
    units: dict[int, UnitWork]

    @property
    def leases(self) -> list[UnitLease]:
        return [work.lease for work in self.units.values()]


def count_written(meters: RowMeters, outcomes: list[RowOutcome], completion: Completion,
                  tallies: list[collections.Counter]) -> None:
    """Count one written batch in `runplane_rows_total`: its outcomes (the last of a key wins,
    fenced ones as fenced) and its units' admission counters (cached, skipped, retried)."""
    fenced = {row.key for row in completion.fenced}
    last = {outcome.key: outcome.status for outcome in outcomes}
    completed = sum(1 for key, status in last.items()
                    if key not in fenced and status == OutcomeStatus.COMPLETED)
    counts = {Counted.COMPLETED: completed,
              Counted.FAILED: len(last) - len(fenced & last.keys()) - completed,
              Counted.FENCED: len(completion.fenced)}
    for tally in tallies:
        for outcome in (Counted.CACHED, Counted.SKIPPED, Counted.RETRIED):
            counts[outcome] = counts.get(outcome, 0) + tally[outcome.value]
    meters.add(counts)
