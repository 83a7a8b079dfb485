"""The superseded-runs simulation, CI-sized, and the schedules it found, replayed."""

from __future__ import annotations

from runplane.simulations import run_scenario
from runplane.simulations.superseded import MapPlan, Plan, run_example


def test_superseded_ci_sized_run_is_clean(dsn):
    """Whether a drawn example supersedes a run depends on timing; the plan below forces one."""
    report = run_scenario("superseded", examples=5, seed=20261130, dsn=dsn)
    assert (report.violations, report.examples) == ([], 5)


async def test_an_older_run_overtaken_mid_map_is_superseded_and_stops(dsn):
    """The older run calls one row at a time; the newest starts after the older's 7th call
    (mid-page: the older has admitted the rows after it) and the older's next call waits until
    the newest (6 at a time, retrying two rows) has finished every row, so the older's next
    completion is fenced: it reports `superseded` (events, not timing, force the order)."""
    plan = Plan(300, (
        MapPlan(0, 0, 1, 2, 5, 1, 0, frozenset(), 3, None),
        MapPlan(1, 30, 6, 0, 100, 5000, 0, frozenset({250, 280}), 2, None),
    ))
    violations, faults = await run_example(dsn, plan, hold_older_after=7)
    assert violations == [] and faults == {"superseded": 1, "retried": 2}


async def test_a_worker_batch_whose_rows_all_wait_in_backoff_does_not_stall_the_map(dsn):
    """Found by the simulation (seed 7): a worker batch whose every row was deferred for a retry
    sent an empty outcome batch, and the completer spun on it past its linger forever."""
    plan = Plan(284, (
        MapPlan(0, 9, 2, 2, 5, 5000, 0, frozenset({154, 256, 282}), 3, None),
        MapPlan(1, 26, 6, 1, 50, 4, 0, frozenset({23, 78, 102, 195, 230, 249}), 3, 0.0),
        MapPlan(2, 16, 3, 2, 100, 16, 50, frozenset({100, 150, 181, 229, 263}), 2, None),
    ))
    violations, faults = await run_example(dsn, plan)
    assert violations == [] and faults["retried"] >= 5
