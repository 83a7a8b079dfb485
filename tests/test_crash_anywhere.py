"""Crash anywhere: the play killed with SIGKILL at its k-th statement, for a seeded
sample of k, then woken in a fresh process; every check holds."""

from __future__ import annotations

import signal

import trio

from runplane.engine import open_tenant
from runplane.simulations import SCENARIOS, crash_anywhere


def test_crash_anywhere_is_registered():
    assert SCENARIOS["crash_anywhere"] == "runplane.simulations.crash_anywhere"


def test_the_adapter_kills_the_child_just_before_the_kth_statement(dsn):
    async def main():
        async with open_tenant(crash_anywhere.ORG, dsn, schema="crash_probe") as tenant:
            process = await crash_anywhere.spawn(dsn, tenant.schema, "play-probe", "run-probe", 3)
        return process

    process = trio.run(main)
    assert process.returncode == -signal.SIGKILL
    assert "SIGKILL before statement 3:" in process.stderr.decode()
    assert process.stdout == b""  # it never got to report


def test_boundaries_are_all_of_them_or_a_seeded_sample():
    assert crash_anywhere.choose_boundaries(12, 200, None) == list(range(1, 13))
    sample = crash_anywhere.choose_boundaries(500, 30, 7)
    assert len(sample) == 30 == len(set(sample)) and sample == crash_anywhere.choose_boundaries(500, 30, 7)
    assert len(crash_anywhere.choose_boundaries(10_000, 10_000, 1)) == crash_anywhere.MAX_BOUNDARIES


def test_a_wrong_outcome_is_caught(dsn, monkeypatch):
    """The checks are not vacuous: a model that disagrees with what the play stores fails."""
    model = crash_anywhere.expected
    monkeypatch.setattr(crash_anywhere, "expected",
                        lambda i: ("enriched", "wrong", None) if i == 0 else model(i))

    async def main():
        async with open_tenant(crash_anywhere.ORG, dsn, schema="crash_wrong") as tenant:
            return await crash_anywhere.check_boundary(tenant, dsn, 20)

    violations, killed = trio.run(main)
    assert killed is not None and any("row 0" in v for v in violations), violations


def test_crash_anywhere_ci_sized(dsn):
    report = crash_anywhere.run(examples=30, seed=20261201, dsn=dsn)
    print(report.summary())
    assert report.ok, "\n".join(report.violations[:5])
    assert report.examples >= 30
    assert report.faults >= report.examples - 2  # a k past the end of a shorter run finishes
