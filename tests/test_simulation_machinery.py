"""The simulation machinery itself: a broken invariant fails the hypothesis example, shrinks to a
minimal schedule and replays with the same schedule; drawn crash points must fire; phases are
marked by the actors."""

from __future__ import annotations

import collections

import attrs
import trio
from hypothesis import strategies as st

from runplane.actors import open_run, phases
from runplane.engine import sheets
from runplane.simulations import crash_and_wake
from runplane.simulations.faults import COUNTED_KINDS, FaultPlan, FaultyPort, fault_plans
from runplane.simulations.harness import SCHEDULER_RANDOM, open_example_tenant, replay, run_examples
from runplane.simulations.ports import HookedPort


@attrs.frozen
class ProbePlan:
    tasks: int
    faults: FaultPlan

    def describe(self) -> str:
        return f"tasks={self.tasks} faults={[f.kind for f in self.faults.steps]}"


PROBE_PLANS = st.builds(ProbePlan, st.integers(2, 6), fault_plans(max_steps=8))


async def broken_probe(dsn: str, plan: ProbePlan):
    """A tiny scenario with a deliberately broken invariant: it 'fails' when at least two faults
    were injected and trio's scheduler ran the tasks out of their start order — so a failure
    replays only with the same plan and the same scheduler seed."""
    order: list[int] = []

    async def task(i: int) -> None:
        await trio.lowlevel.checkpoint()
        order.append(i)

    # First, before any I/O: the order is then a function of the scheduler seed alone.
    async with trio.open_nursery() as nursery:
        for i in range(plan.tasks):
            nursery.start_soon(task, i)
    async with open_example_tenant("org-probe", dsn) as tenant:
        port = FaultyPort(tenant, plan.faults)
        for _ in range(4):
            with port.cancellable():
                try:
                    async with port.connection("receipts") as conn:
                        await conn.fetchval("SELECT 1")
                except Exception:
                    pass
    violations = []
    if port.injected >= 2 and order != sorted(order):
        violations.append(f"broken on purpose: order {order}")
    return violations, port.by_kind


def test_a_broken_invariant_fails_shrinks_and_replays_the_same_schedule(dsn):
    report = run_examples("probe", PROBE_PLANS, broken_probe, examples=60, seed=3, dsn=dsn)
    assert not report.ok and report.minimal is not None
    assert any(note.startswith(("Falsifying", "Failing test case")) for note in report.notes)
    plan, scheduler = report.minimal
    # Shrunk: the fewest tasks, and exactly the two faults the invariant needs, nothing else.
    assert plan.tasks == 2
    assert [step.kind for step in plan.faults.steps] == ["delay", "delay"]
    assert report.examples > 1 and report.faults >= 2
    # Replays: the same plan under the same scheduler seed fails the same way, every time.
    for _ in range(3):
        violations, _ = replay(broken_probe, dsn, plan, scheduler)
        assert len(violations) == 1 and report.violations[0].startswith(violations[0] + " [")
    # ... and the schedule is what makes it fail: some other seed runs the tasks in order.
    assert any(replay(broken_probe, dsn, plan, other)[0] == [] for other in range(scheduler + 1, scheduler + 30))
    # A committed regression runs first, as an explicit example, and fails at once.
    again = run_examples("probe", PROBE_PLANS, broken_probe, examples=5, seed=3, dsn=dsn,
                         regressions=[(plan, scheduler)])
    assert again.examples == 1 and again.minimal == (plan, scheduler)
    assert again.violations == report.violations


def test_trio_schedules_from_the_registered_random_once_hypothesis_is_imported():
    import trio._core._run as trio_run

    assert trio_run._ALLOW_DETERMINISTIC_SCHEDULING  # trio's hypothesis plugin ran
    assert SCHEDULER_RANDOM is trio_run._r

    async def order_of_five(seed: int) -> list[int]:
        order: list[int] = []

        async def task(i: int) -> None:
            await trio.lowlevel.checkpoint()
            order.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(task, i)
        return order

    def run_seeded(seed: int) -> list[int]:
        SCHEDULER_RANDOM.seed(seed)
        return trio.run(order_of_five, seed)

    state = SCHEDULER_RANDOM.getstate()
    try:
        orders = {seed: run_seeded(seed) for seed in range(20)}
        assert all(run_seeded(seed) == order for seed, order in orders.items())  # replayable
        assert len({tuple(order) for order in orders.values()}) > 1  # and the seed matters
    finally:
        SCHEDULER_RANDOM.setstate(state)


def test_the_scheduler_seed_is_restored_after_a_replay(dsn):
    state = SCHEDULER_RANDOM.getstate()
    replay(broken_probe, dsn, ProbePlan(2, FaultPlan.quiet()), 12345)
    assert SCHEDULER_RANDOM.getstate() == state


def test_a_clean_run_counts_examples_and_faults(dsn):
    async def clean(dsn, plan):
        violations, by_kind = await broken_probe(dsn, plan)
        return [], by_kind

    report = run_examples("probe", PROBE_PLANS, clean, examples=8, seed=5, dsn=dsn)
    assert report.ok and report.examples == 8 and report.minimal is None
    assert report.faults == sum(report.fault_counts.values())
    assert set(report.fault_counts) <= COUNTED_KINDS
    # Every drawn fault is accounted for: fired, neutralized, or never reached.
    tally = report.drawn_faults
    assert tally["fired"] == report.faults
    assert tally["drawn"] == tally["fired"] + tally["neutralized"] + tally["not reached"] > 0


def test_a_crash_point_that_never_fires_fails_the_example(dsn):
    plan = crash_and_wake.Plan(
        rows=1, source="list", failing=frozenset(), crash_phase="admission", crash_at=10**6,
        zombie=False, flush_fault=False, concurrency=1, first_faults=FaultPlan.quiet(),
        wake_faults=FaultPlan.quiet())
    violations, _ = trio.run(crash_and_wake.run_example, dsn, plan)
    assert any("crash point admission#1000000 never fired" in v for v in violations), violations


async def test_actors_mark_their_phases(tenant):
    seen: collections.Counter = collections.Counter()

    class Record:
        async def at_boundary(self, boundary) -> None:
            seen[phases.current()] += 1

    port = HookedPort(tenant, Record())
    contract = sheets.SheetContract(inputs=("i",), outputs=("double",))

    async def double(row: dict) -> dict:
        assert phases.current() is None  # user code runs outside every actor phase
        return {"double": 2 * row["i"]}

    async with open_run(port, "play-phases") as run:
        await run.map("numbers", [{"i": i} for i in range(5)], double, contract=contract)
    assert {"staging", "admission", "completion", "retirement"} <= set(seen), seen
    assert phases.current() is None
