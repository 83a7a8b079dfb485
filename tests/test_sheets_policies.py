"""Row-policy columns of a sheet: `_attempts` across runs, `_failed_runs` and `gave_up`,
and the migration of sheets created before these columns."""

from __future__ import annotations

import pytest

from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import RowOutcome, admit, complete, ensure_sheet, read_rows
from runplane.engine.sheets.layout import LATER_SYSTEM_COLUMNS, layout_for
from runplane.simulations.ports import CountingPort
from tests.sheet_helpers import CONTRACT, PLAY, counters_match, new_run, play_scope

NS = "policies"


@pytest.fixture(autouse=True, params=["returning_old", "snapshot_join"])
def completion_path(request, monkeypatch):
    from runplane.engine.sheets import completion

    if request.param == "snapshot_join":
        monkeypatch.setattr(completion, "RETURNING_OLD_SINCE", 10**9)
    return request.param


async def stored(tenant) -> dict[str, dict]:
    return {row["name"]: row for row in await read_rows(tenant, play_scope(tenant), NS)}


async def test_attempts_add_up_across_runs_and_a_replay_adds_nothing(tenant):
    first = await new_run(tenant, PLAY, "r1")
    (a, b) = (await admit(tenant, first, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])).pending
    outcomes = [RowOutcome(a.key, "failed", error="boom", attempts=3),
                RowOutcome(b.key, "completed", {"score": 1})]
    await complete(tenant, first, NS, CONTRACT, outcomes)
    await complete(tenant, first, NS, CONTRACT, outcomes)  # a replay (lost reply, flush)
    rows = await stored(tenant)
    assert (rows["a"]["_attempts"], rows["b"]["_attempts"]) == (3, 1)

    second = await new_run(tenant, PLAY, "r2")
    admission = await admit(tenant, second, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    assert [row.key for row in admission.pending] == [a.key]
    await complete(tenant, second, NS, CONTRACT,
                   [RowOutcome(a.key, "completed", {"score": 2}, attempts=2)])
    rows = await stored(tenant)
    assert (rows["a"]["_attempts"], rows["a"]["_status"], rows["b"]["_attempts"]) == (
        5, "enriched", 1)
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


async def test_a_row_inserted_by_completion_records_its_attempts(tenant):
    run = await new_run(tenant, PLAY, "r1")
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    # Outputs only: an outcome may not write an input cell (it would overwrite the input).
    await complete(tenant, run, NS, CONTRACT,
                   [RowOutcome("k-new", "completed", {"score": 1}, attempts=4)])
    (row,) = await read_rows(tenant, play_scope(tenant), NS)
    assert (row["_key"], row["_attempts"]) == ("k-new", 4)


async def test_give_up_after_counts_failed_runs_not_wakes(tenant):
    rows = [{"name": "a"}]

    async def fail_in(run) -> None:
        (row,) = (await admit(tenant, run, NS, CONTRACT, rows)).pending
        await complete(tenant, run, NS, CONTRACT, [RowOutcome(row.key, "failed", error="no")])

    first = await new_run(tenant, PLAY, "r1")
    await fail_in(first)
    await fail_in(first)  # a wake of the same run: still one failed run
    assert (await stored(tenant))["a"]["_failed_runs"] == 1
    admission = await admit(tenant, first, NS, CONTRACT, rows, give_up_after=1)
    assert [(row.reason, row.input_index) for row in admission.blocked] == [("gave_up", 0)]

    second = await new_run(tenant, PLAY, "r2")
    assert (await admit(tenant, second, NS, CONTRACT, rows, give_up_after=2)).pending
    await complete(tenant, second, NS, CONTRACT,
                   [RowOutcome(admission.blocked[0].key, "failed", error="no")])
    assert (await stored(tenant))["a"]["_failed_runs"] == 2

    third = await new_run(tenant, PLAY, "r3")
    counting = CountingPort(tenant)
    blocked = await admit(counting, third, NS, CONTRACT, rows, give_up_after=2)
    with_give_up = counting.round_trips
    counting.reset()
    assert [row.reason for row in blocked.blocked] == ["gave_up"] and not blocked.pending
    assert (await stored(tenant))["a"]["_status"] == "failed"  # not re-admitted
    # Raising the limit (or no limit) lets it run again, in as many round trips.
    assert (await admit(counting, third, NS, CONTRACT, rows, give_up_after=3)).pending
    assert counting.round_trips == with_give_up
    assert (await admit(tenant, third, NS, CONTRACT, rows)).pending
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


async def test_a_completed_row_starts_its_failed_runs_again(tenant):
    first = await new_run(tenant, PLAY, "r1")
    (row,) = (await admit(tenant, first, NS, CONTRACT, [{"name": "a"}])).pending
    await complete(tenant, first, NS, CONTRACT, [RowOutcome(row.key, "failed")])
    second = await new_run(tenant, PLAY, "r2")
    await admit(tenant, second, NS, CONTRACT, [{"name": "a"}])
    await complete(tenant, second, NS, CONTRACT, [RowOutcome(row.key, "completed", {"score": 1})])
    assert (await stored(tenant))["a"]["_failed_runs"] == 0


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
async def test_give_up_after_is_checked_before_any_query(tenant, value):
    run = await new_run(tenant, PLAY, "r1")
    counting = CountingPort(tenant)
    with pytest.raises(InvalidInputError, match="give_up_after"):
        await admit(counting, run, NS, CONTRACT, [{"name": "a"}], give_up_after=value)
    assert counting.round_trips == 0


@pytest.mark.parametrize("value", [0, True, 1.0])
def test_attempts_of_an_outcome_are_validated(value):
    with pytest.raises(InvalidInputError, match="attempts"):
        RowOutcome("k", "completed", attempts=value)


async def test_a_sheet_from_before_the_policy_columns_migrates_on_first_write(tenant):
    """An existing tenant's sheet lacks the columns: reading shows zeros without DDL, and the
    first writer (or `ensure_sheet`) adds them under the exclusive lock — no manual step."""
    run = await new_run(tenant, PLAY, "r1")
    (row,) = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending
    layout = layout_for(tenant, play_scope(tenant), NS)
    drops = ", ".join(f"DROP COLUMN {name}" for name in LATER_SYSTEM_COLUMNS)
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"ALTER TABLE {layout.qualified} {drops}")
    assert (await stored(tenant))["a"]["_attempts"] == 0

    await complete(tenant, run, NS, CONTRACT, [RowOutcome(row.key, "failed", attempts=2)])
    rows = await stored(tenant)
    assert (rows["a"]["_attempts"], rows["a"]["_failed_runs"], rows["a"]["_status"]) == (
        2, 1, "failed")

    async with tenant.connection("sheet") as conn:
        await conn.execute(f"ALTER TABLE {layout.qualified} {drops}")
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    async with tenant.connection("sheet") as conn:
        present = await conn.fetchval(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1)"
            " AND attname = ANY($2::text[]) AND NOT attisdropped",
            layout.qualified, list(LATER_SYSTEM_COLUMNS))
    assert present == len(LATER_SYSTEM_COLUMNS)
    second = await new_run(tenant, PLAY, "r2")
    admission = await admit(tenant, second, NS, CONTRACT, [{"name": "a"}], give_up_after=1)
    assert admission.pending  # the dropped count started again at zero


async def test_attempts_and_give_up_travel_through_the_gateway(tenant, completion_path):
    from .gateway_support import FAST_RETRY, serving, token_for
    from runplane.engine.gateway import open_gateway

    if completion_path != "returning_old":
        pytest.skip("the wire is the same on both completion paths")
    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
            first = await new_run(gateway, PLAY, "r1")
            (row,) = (await admit(gateway, first, NS, CONTRACT, [{"name": "a"}])).pending
            await complete(gateway, first, NS, CONTRACT,
                           [RowOutcome(row.key, "failed", error="x", attempts=3)])
            second = await new_run(gateway, PLAY, "r2")
            admission = await admit(gateway, second, NS, CONTRACT, [{"name": "a"}],
                                    give_up_after=1)
    assert [blocked.reason for blocked in admission.blocked] == ["gave_up"]
    rows = await stored(tenant)
    assert (rows["a"]["_attempts"], rows["a"]["_failed_runs"]) == (3, 1)
