"""The crash_and_wake simulation, CI-sized, plus pinned plans for the interesting crash points."""

from __future__ import annotations

import pytest
import trio

from runplane.simulations import SCENARIOS, crash_and_wake
from runplane.simulations.crash_and_wake import Plan
from runplane.simulations.faults import FaultPlan


def test_crash_and_wake_is_registered():
    assert SCENARIOS["crash_and_wake"] == "runplane.simulations.crash_and_wake"


def test_crash_and_wake_simulation_ci_sized(dsn):
    report = crash_and_wake.run(examples=20, seed=20261130, dsn=dsn)
    assert report.examples == 20
    assert report.ok, "\n".join(report.violations[:5])


def plan(**changes) -> Plan:
    base = dict(rows=1500, source="list", failing=frozenset({3, 1200}), crash_phase="completion",
                crash_at=1, zombie=False, flush_fault=False, concurrency=4, first_faults=FaultPlan.quiet(),
                wake_faults=FaultPlan.quiet())
    return Plan(**{**base, **changes})


@pytest.mark.parametrize("pinned", [
    plan(crash_phase="staging", crash_at=2),             # mid-staging: the wake resumes puts
    plan(crash_phase="completion", crash_at=1),          # inside the first completion batch
    plan(crash_phase="executed", crash_at=700),          # half the rows computed
    plan(crash_phase="executed", crash_at=700, flush_fault=True),  # the flush itself fails
    plan(crash_phase="admission", crash_at=3, source="stream"),
    plan(crash_phase="completion", crash_at=2, zombie=True),   # a zombie attempt keeps writing
    plan(crash_phase="executed", crash_at=10, zombie=True, source="stream", concurrency=1),
], ids=["staging", "completion", "executed", "flush-fault", "admission-stream", "zombie", "zombie-stream"])
def test_pinned_crash_points(dsn, pinned):
    violations, _ = trio.run(crash_and_wake.run_example, dsn, pinned)
    assert violations == []
