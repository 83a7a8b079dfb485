"""The routing simulation, CI-sized: orgs over three databases moved under load, the mover and
the writers crashing; nothing lost, nothing twice, counters exact, no stray rows."""

from __future__ import annotations

from runplane.simulations import run_scenario


def test_routing_ci_sized_run_is_clean(dsn):
    report = run_scenario("routing", examples=4, seed=20261202, dsn=dsn)
    assert (report.violations, report.examples) == ([], 4)
    assert report.fault_counts["moves"] > 0
    assert report.fault_counts["direct writers"] > 0  # placed tenants following their org
