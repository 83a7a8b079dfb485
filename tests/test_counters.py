"""The counters simulation, CI-sized: concurrent admitters and completers on one sheet keep
`sheet_summary` and `sheet_column_summary` equal to a COUNT over the sheet in every snapshot."""

from __future__ import annotations

from runplane.engine.sheets import RowOutcome, admit, complete
from runplane.simulations import run_scenario
from runplane.simulations.counters import counters_match
from tests.sheet_helpers import CONTRACT, new_run, play_scope


def test_counters_ci_sized_run_is_clean(dsn):
    report = run_scenario("counters", examples=25, seed=20261130, dsn=dsn)
    assert (report.violations, report.examples, report.faults > 0) == ([], 25, True)


async def test_counters_match_detects_a_drifted_counter(tenant):
    run_ref = await new_run(tenant, "play", "r1")
    admission = await admit(tenant, run_ref, "ns", CONTRACT, [{"name": "a"}, {"name": "b"}])
    await complete(tenant, run_ref, "ns", CONTRACT,
                   [RowOutcome(admission.pending[0].key, "completed", {"score": 1})])
    scope = play_scope(tenant)
    assert await counters_match(tenant, scope, "ns") == (True, "")
    async with tenant.connection("sheet") as conn:
        await conn.execute(
            f'UPDATE "{tenant.schema}".sheet_column_summary SET failed = failed + 1'
        )
    ok, detail = await counters_match(tenant, scope, "ns")
    assert not ok and "score" in detail
