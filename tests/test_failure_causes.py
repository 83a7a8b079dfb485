"""A failed row's cause is stored with it (`_cause`, indexed) and every surface groups by it:
`runplane failures` and its `--json`, `sheets.error_counts`, the console's top errors and its
failures page filtered by cause. Rows failed before the column read their cause from the
message."""

from __future__ import annotations

import json

from runplane.engine import sheets
from runplane.engine.sheets import RowOutcome, admit, complete
from runplane.engine.sheets.layout import column, layout_for

from .sheet_helpers import CONTRACT, PLAY, new_run, play_scope

NS = "causes"


async def causes_of(tenant, namespace: str = NS) -> dict[str, tuple[str, str | None, str | None]]:
    """name -> (status, error, cause) of every stored row."""
    layout = layout_for(tenant, play_scope(tenant), namespace)
    async with tenant.connection("sheet") as conn:
        records = await conn.fetch(f"SELECT _status, _error, _cause, {column('name')}::text AS name"
                                   f" FROM {layout.qualified}")
    return {json.loads(r["name"]): (r["_status"], r["_error"], r["_cause"]) for r in records}


async def test_a_failed_row_stores_its_cause_and_completing_or_readmitting_it_clears_it(tenant):
    run = await new_run(tenant, PLAY, "r1")
    rows = [{"name": "BGR"}, {"name": "LAX"}, {"name": "ok"}]
    bgr, lax, ok = (await admit(tenant, run, NS, CONTRACT, rows)).pending
    await complete(tenant, run, NS, CONTRACT, [
        # the worker's cause (it knew the row's inputs) is stored as given
        RowOutcome(bgr.key, "failed", error="quota exceeded for BGR",
                   cause="quota exceeded for <name>"),
        # an outcome without one gets its message's
        RowOutcome(lax.key, "failed", error="no data for r13 'LAX'"),
        RowOutcome(ok.key, "completed", {"score": 1}),
    ])
    assert await causes_of(tenant) == {
        "BGR": ("failed", "quota exceeded for BGR", "quota exceeded for <name>"),
        "LAX": ("failed", "no data for r13 'LAX'", "no data for rN '…'"),
        "ok": ("enriched", None, None),
    }
    second = await new_run(tenant, PLAY, "r2")
    readmitted = (await admit(tenant, second, NS, CONTRACT, rows[:2])).pending
    assert {row.key for row in readmitted} == {bgr.key, lax.key}
    stored = await causes_of(tenant)
    assert stored["BGR"] == stored["LAX"] == ("pending", None, None)
    await complete(tenant, second, NS, CONTRACT, [RowOutcome(bgr.key, "completed", {"score": 2})])
    assert (await causes_of(tenant))["BGR"] == ("enriched", None, None)


async def test_a_cause_travels_through_the_gateway(tenant):
    from runplane.engine.gateway import open_gateway

    from .gateway_support import FAST_RETRY, serving, token_for

    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
            run = await new_run(gateway, PLAY, "r1")
            bgr, lax = (await admit(gateway, run, NS, CONTRACT,
                                    [{"name": "BGR"}, {"name": "LAX"}])).pending
            await complete(gateway, run, NS, CONTRACT, [
                RowOutcome(bgr.key, "failed", error="quota exceeded for BGR",
                           cause="quota exceeded for <name>"),
                RowOutcome(lax.key, "failed", error="quota exceeded for LAX"),
            ])
    stored = await causes_of(tenant)
    assert stored["BGR"][2] == "quota exceeded for <name>"
    assert stored["LAX"][2] == "quota exceeded for LAX"  # no cause sent: the message's own


async def test_a_sheet_from_before_causes_gets_the_column_and_its_index_on_first_write(tenant):
    run = await new_run(tenant, PLAY, "r1")
    a, b = (await admit(tenant, run, NS, CONTRACT, [{"name": "a1"}, {"name": "b1"}])).pending
    await complete(tenant, run, NS, CONTRACT, [RowOutcome(a.key, "failed", error="no data for 7")])
    layout = layout_for(tenant, play_scope(tenant), NS)
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"ALTER TABLE {layout.qualified} DROP COLUMN _cause")  # and its index
    # Readers of the older sheet still group its failures, from the message.
    counts = await sheets.error_counts(tenant, play_scope(tenant), NS)
    assert [(c.pattern, c.count) for c in counts.causes] == [("no data for N", 1)]
    await complete(tenant, run, NS, CONTRACT, [RowOutcome(b.key, "failed", error="no data for 8")])
    async with tenant.connection("sheet") as conn:
        index = await conn.fetchval(
            "SELECT pg_get_indexdef(to_regclass($1))", layout.cause_index)
    assert index is not None and "WHERE (_cause IS NOT NULL)" in index, index
    stored = await causes_of(tenant)
    assert stored["a1"] == ("failed", "no data for 7", None)  # failed before: no stored cause
    assert stored["b1"] == ("failed", "no data for 8", "no data for N")
    counts = await sheets.error_counts(tenant, play_scope(tenant), NS)
    assert [(c.pattern, c.count, c.variants) for c in counts.causes] == [("no data for N", 2, 2)]
    assert counts.distinct_causes == 1

