"""The gateway simulation, CI-sized: a run through a gateway over a faulty network applies
everything once and answers what direct calls answer; a broken invariant is reported."""

from __future__ import annotations

from runplane.simulations import run_scenario
from runplane.simulations.gateway import Plan, run_example


def test_gateway_ci_sized_run_is_clean(dsn):
    report = run_scenario("gateway", examples=4, seed=20261130, dsn=dsn)
    assert (report.violations, report.examples) == ([], 4)


async def test_every_kind_of_fault_fires_and_is_survived(dsn):
    faults = ("refuse", "drop_reply", "delay:0.02", "reset", "503", "503", "drop_reply", "pass",
              "drop_reply")
    violations, fired = await run_example(dsn, Plan(rows=12, staged=1200, faults=faults))
    assert violations == []
    assert dict(fired) == {"refuse": 1, "reset": 1, "drop_reply": 3, "delay": 1, "503": 2}
