"""The shared-map simulation, CI-sized: workers race over leases with crashes, stalls and lost
replies; every row is written exactly once by its unit's last holder."""

from __future__ import annotations

from runplane.simulations import run_scenario


def test_shared_map_ci_sized_run_is_clean_and_its_faults_fire(dsn):
    report = run_scenario("shared_map", examples=8, seed=20261201, dsn=dsn)
    assert (report.violations, report.examples) == ([], 8)
    faults = report.fault_counts
    # Which worker claims which unit is timing: a drawn fault may not fire in every run, but
    # over eight examples crashes or stalls do, and some unit is taken over.
    assert faults["crashed"] + faults["stalled"] > 0 and faults["takeovers"] > 0
