"""Map invocations: namespaces that normalize alike are one sheet but distinct map
invocations, and a wake never replays input other than the caller's list."""

from __future__ import annotations

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import array_input, sheets
from runplane.engine.errors import ConflictError
from runplane.engine.runs import new_run_id
from runplane.engine.values.scopes import PlayScope

from .run_helpers import fact_kinds, occurrences

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))


async def upper(row):
    return {"upper": row["name"].upper()}


async def test_two_maps_whose_namespaces_differ_only_in_case_admit_both_lists(tenant):
    async with open_run(tenant, "play") as run:
        first = await run.map("Companies", [{"name": "i1"}, {"name": "i2"}], upper,
                              contract=CONTRACT)
        second = await run.map("companies", [{"name": "i3"}], upper, contract=CONTRACT)
    assert (first.admitted, first.completed, first.map_invocation_id) == (2, 2, "map-0")
    assert (second.admitted, second.cached, second.completed) == (1, 0, 1)
    assert second.map_invocation_id == "map-1"
    stored = await sheets.read_rows(tenant, PlayScope(tenant.org_id, "play"), "COMPANIES")
    assert sorted((r["name"], r["upper"], r["_status"]) for r in stored) == [
        ("i1", "I1", "enriched"), ("i2", "I2", "enriched"), ("i3", "I3", "enriched")]


async def crash_after_staging(tenant, run_id: str, source: list) -> None:
    with trio.move_on_after(30) as crash:
        async with open_run(tenant, "play", run_id) as run:
            await run.stage_array("t", "map-0", source)
            crash.cancel()
            await trio.sleep_forever()
    assert crash.cancelled_caught


async def test_a_wake_with_a_different_list_than_the_sealed_one_conflicts(tenant):
    run_id = new_run_id()
    source = occurrences(1200, tag="first")
    await crash_after_staging(tenant, run_id, source)
    with pytest.raises(ConflictError, match="differs from the input staged"):
        async with open_run(tenant, "play", run_id) as woken:
            await woken.stage_array("t", "map-0", occurrences(1200, tag="changed"))
    # the same list still replays as staged
    await crash_after_staging(tenant, (run_id := new_run_id()), source)
    async with open_run(tenant, "play", run_id) as woken:
        staged = await woken.stage_array("t", "map-0", list(source))
        assert staged.manifest.source_rows == 1200


async def test_a_wake_with_a_different_list_than_the_one_still_staging_conflicts(tenant):
    run_id = new_run_id()
    source = occurrences(10, tag="first")
    async with open_run(tenant, "play", run_id, retire_on_exit=False) as run:
        scope = run.scope.map("t", "map-0")
        await array_input.begin(
            tenant, scope, source_fingerprint=array_input.source_fingerprint(source),
            source_rows=len(source), has_source_identities=False)
    assert (await array_input.get_manifest(tenant, scope)).state == "staging"
    with pytest.raises(ConflictError):
        async with open_run(tenant, "play", run_id) as woken:
            await woken.map("t", [{"name": "other"}], upper, contract=CONTRACT)
    assert await fact_kinds(tenant, run_id) == ["array_input_guard"]
