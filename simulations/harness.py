"""What every scenario does the same way: a fresh schema per example, N hypothesis examples.

How it works
- `open_example_tenant(org_id, dsn)` opens a tenant on a fresh schema `sim_<16 hex>` for one
  example and, however the example ends, drops that schema (CASCADE) before the tenant closes,
  so examples never see each other's rows and a long run leaves nothing behind.
- `run_examples(name, plans, run_example, examples=, seed=, dsn=, regressions=)` lets hypothesis
  draw `examples` plans from the `plans` strategy (no example database, no deadline, every health
  check suppressed: an example is a whole concurrent run against a real server), plus a seed for
  trio's scheduler, and runs each in its own `trio.run(run_example, dsn, plan)`.
  `run_example` returns `(violations, faults injected)` — a count, or a mapping of counts by
  kind of fault, which the report also keeps by kind.
- A violation fails the example: `InvariantViolated` is raised inside it, so hypothesis shrinks
  the plan (and the scheduler seed) to a minimal failing schedule and prints it
  (`Falsifying example: example(plan=..., scheduler=...)`); the minimal example's violations
  end up in the report, which still counts every example run and every fault injected.
- Replay: trio's scheduler draws from one module-level `random.Random`
  (`trio._core._run._r`: it shuffles each batch of runnable tasks). It is registered with
  hypothesis (`register_random`, so it is restored after each example) and seeded with the drawn
  `scheduler` value just before `trio.run`; a plan together with its scheduler seed replays the
  same schedule of tasks (database timing aside).
- Regressions: a scenario lists the failing schedules found as `REGRESSIONS`, pairs
  `(plan, scheduler)`; each runs as an explicit `@example` before anything is drawn, in every
  run of the scenario (and so in every test run that runs it).
- The fault ports an example makes (`faults.collect_ports`) are tallied into the report: faults
  drawn, fired, neutralized (a cancel with no cancellable scope) and not reached (the actor finished
  first).
- Scenarios call both from their own `run_example` and `run(examples, seed, dsn=None)`; the
  tests call a scenario's `run_example` directly to replay a pinned plan.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import (TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Protocol,
                    TypeVar)

import trio
import trio._core._run as trio_run
from hypothesis import (HealthCheck, example as hypothesis_example, given, register_random,
                        seed as hypothesis_seed, settings, strategies as st)

from runplane.engine import Tenant, open_tenant
from runplane.engine.ports import SHEET_LANE
from runplane.engine.sql import quote_ident

from . import resolve_dsn
from .faults import collect_ports
from .report import SimulationReport

if TYPE_CHECKING:
    from .faults import FaultyPort


class DescribedPlan(Protocol):
    """A drawn plan: `describe()` names what was drawn, so a violation can be reproduced."""

    def describe(self) -> str: ...


P = TypeVar("P", bound=DescribedPlan)
RunExample = Callable[[str, P], Awaitable[tuple[list[str], "int | Mapping[str, int]"]]]


@contextlib.asynccontextmanager
async def open_example_tenant(org_id: str, dsn: str) -> AsyncIterator[Tenant]:
    """A tenant of `org_id` on a fresh schema, dropped when the block exits."""
    schema = f"sim_{uuid.uuid4().hex[:16]}"
    async with open_tenant(org_id, dsn, schema=schema) as tenant:
        try:
            yield tenant
        finally:
            async with tenant.connection(SHEET_LANE) as conn:
                await conn.execute(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE")


# The scheduler's random source (verified in trio 0.35's `_core/_run.py`: `_r = random.Random()`;
# once hypothesis is imported, trio's hypothesis plugin sets `_ALLOW_DETERMINISTIC_SCHEDULING`,
# and each batch of runnable tasks is sorted by spawn order and shuffled with `_r`). Registered
# so hypothesis restores it after every example; seeded per example with the drawn `scheduler`.
SCHEDULER_RANDOM = trio_run._r
register_random(SCHEDULER_RANDOM)
SCHEDULER_SEEDS = st.integers(0, 2**32 - 1)


class InvariantViolated(AssertionError):
    """An example broke an invariant; carries the plan and scheduler seed that did it."""

    def __init__(self, violations: list[str], plan: DescribedPlan, scheduler: int) -> None:
        self.violations = list(violations)
        self.plan = plan
        self.scheduler = scheduler
        super().__init__("; ".join(self.violations))


def replay(run_example: RunExample[P], dsn: str, plan: P, scheduler: int = 0):
    """Run one plan under the scheduler seed `scheduler`, as an example of `run_examples` does
    (the tests use it to replay a pinned or a shrunk schedule)."""
    state = SCHEDULER_RANDOM.getstate()
    SCHEDULER_RANDOM.seed(scheduler)
    try:
        return trio.run(run_example, dsn, plan)
    finally:
        SCHEDULER_RANDOM.setstate(state)


def run_examples(
    name: str,
    plans: st.SearchStrategy[P],
    run_example: RunExample[P],
    *,
    examples: int,
    seed: int | None,
    dsn: str | None,
    regressions: Iterable[tuple[P, int]] = (),
) -> SimulationReport:
    """Run the `regressions`, then `examples` hypothesis examples of `plans`, through
    `run_example`; the first violation fails, shrinks and is reported with its minimal schedule."""
    dsn = resolve_dsn(dsn)
    report = SimulationReport(name)

    @settings(max_examples=examples, database=None, deadline=None, print_blob=False,
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @given(plan=plans, scheduler=SCHEDULER_SEEDS)
    def example(plan: P, scheduler: int) -> None:
        SCHEDULER_RANDOM.seed(scheduler)
        with collect_ports() as ports:
            violations, faults = trio.run(run_example, dsn, plan)
        report.examples += 1
        for port in ports:
            report.drawn_faults["drawn"] += port.drawn
            report.drawn_faults["fired"] += port.injected
            report.drawn_faults["neutralized"] += port.neutralized
            report.drawn_faults["not reached"] += port.drawn - port.injected - port.neutralized
        if isinstance(faults, Mapping):
            report.fault_counts.update(faults)
            faults = sum(faults.values())
        report.faults += faults
        if violations:
            report.failing_examples += 1
            raise InvariantViolated(violations, plan, scheduler)

    for plan, scheduler in reversed(list(regressions)):
        example = hypothesis_example(plan=plan, scheduler=scheduler)(example)
    if seed is not None:
        example = hypothesis_seed(seed)(example)
    try:
        example()
    except InvariantViolated as failure:
        # Raised by the last (minimal) example hypothesis replayed after shrinking.
        record_failure(report, failure)
    except BaseExceptionGroup as group:
        # hypothesis's FlakyFailure: the shrunk example passed when replayed (database timing).
        failures = group.subgroup(InvariantViolated)
        if failures is None:
            raise
        while isinstance(failures, BaseExceptionGroup):
            failures = failures.exceptions[0]
        record_failure(report, failures, note=" (flaky on replay)")
    return report


def record_failure(report: SimulationReport, failure: InvariantViolated, note: str = "") -> None:
    report.minimal = (failure.plan, failure.scheduler)
    # hypothesis attaches "Falsifying example: example(plan=..., scheduler=...)" as a note.
    report.notes.extend(getattr(failure, "__notes__", ()))
    report.violations.extend(
        f"{violation} [{failure.plan.describe()}; scheduler={failure.scheduler}]{note}"
        for violation in failure.violations
    )


def unfired(port_faults: Mapping[str, FaultyPort]) -> list[str]:
    """Violations for fault-injecting ports that drew faults but met no boundary at all (the
    port was never wired into the calls it was meant to disturb). `port_faults` maps a label to
    a `FaultyPort`."""
    return [
        f"{label}: {port.drawn} faults drawn, but the port met no boundary"
        for label, port in port_faults.items()
        if port.drawn and port.boundaries_met == 0
    ]
