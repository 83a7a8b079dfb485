"""Shared maps: one map over many worker processes, PostgreSQL as the coordinator.

Every test checks exact outcomes: each row enriched once (one call, `_attempts` = 1), the
coordinator's `MapResult` against the sheet, counters against COUNT(*).
"""

from __future__ import annotations

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import shared_maps as sm
from runplane.engine import shared_units
from runplane.engine.errors import InvalidInputError, LeaseLostError
from runplane.engine.sheets import RowOutcome, SheetContract
from runplane.engine.sheets.layout import layout_for

from .plays.scale_play import meet_tag, tag_pid
from .sheet_helpers import counters_match, play_scope, raw_rows

PLAY = "scale"
CONTRACT = SheetContract(("n",), ("pid", "double"))


async def sheet_state(port, namespace: str):
    layout = layout_for(port, play_scope(port, PLAY), namespace)
    async with port.connection("sheet") as conn:
        return await conn.fetch(f"SELECT _status, _attempts FROM {layout.qualified}")


async def test_workers_spread_a_map_over_two_processes(tenant, tmp_path, monkeypatch):
    # Both workers join before the map opens, so each first claim is half the units; the rows
    # then wait until both processes run rows (a fast worker alone could otherwise finish its
    # half and take the rest before the other one's next poll).
    monkeypatch.setenv("RUNPLANE_TEST_MEET", str(tmp_path))
    rows = [{"n": i} for i in range(3000)]  # six units
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            result = await run.map("nums", rows, meet_tag, contract=CONTRACT, workers=2,
                                   concurrency=8)
    stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n", "pid", "double"))
    assert len(stored) == 3000
    assert all(row["_status"] == "enriched" and row["double"] == 2 * row["n"]
               for row in stored.values())
    pids = {row["pid"] for row in stored.values()}
    assert len(pids) == 2 and __import__("os").getpid() not in pids
    state = await sheet_state(tenant, "nums")
    assert [r["_attempts"] for r in state] == [1] * 3000  # each row called exactly once
    assert (result.completed, result.failed, result.cached, result.fenced) == (3000, 0, 0, 0)
    assert result.executed == 3000 and result.admitted == 3000
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why
    status = await sm.map_status(tenant, run.ref, result.map_invocation_id)
    assert (status.state, status.done, status.units) == ("done", 6, 6)


async def test_a_rerun_of_a_shared_map_is_all_cache_hits(tenant):
    rows = [{"n": i} for i in range(700)]
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            await run.map("nums", rows, tag_pid, contract=CONTRACT, workers=1)
        async with open_run(tenant, PLAY) as run:
            again = await run.map("nums", rows, tag_pid, contract=CONTRACT, workers=1)
    assert (again.completed, again.cached, again.executed) == (0, 700, 0)


async def test_a_function_workers_cannot_find_is_refused_before_any_write(tenant):
    async def local(row):
        return {}

    async with open_run(tenant, PLAY) as run:
        try:
            await run.map("nums", [{"n": 1}], local, contract=CONTRACT, workers=1)
        except InvalidInputError as exc:
            assert "top level of a play file" in str(exc)
        else:
            raise AssertionError("a local function was accepted")
    async with tenant.connection("sheet") as conn:
        assert await conn.fetchval(
            f'SELECT count(*) FROM "{tenant.schema}".shared_maps') == 0


async def test_an_expired_holders_writes_are_rolled_back(tenant):
    """A holder whose lease was taken over cannot write: its admission (and, below, its
    completion) raises `LeaseLostError` and nothing of it lands; the new holder's does."""
    from runplane.actors.shared_worker import MapWorker, worker_plan

    rows = [{"n": i} for i in range(10)]
    async with open_run(tenant, PLAY) as run:
        mid = "map-x"
        from runplane.actors.map_state import MapPlan
        from runplane.actors.shared_map import publish_map

        plan = MapPlan(tenant, run.ref, None, "nums", CONTRACT, tag_pid)
        await publish_map(run, rows, plan, mid, lease_s=0.5)
        await sm.set_state(tenant, run.ref, mid, sm.OPEN, (sm.WAITING,))
        shared = (await sm.live_maps(tenant, PLAY))[0]
        old = MapWorker(tenant, "old", shared, worker_plan(tenant, shared, tag_pid, 4),
                        trio.CapacityLimiter(4), renew_s=60)
        new = MapWorker(tenant, "new", shared, worker_plan(tenant, shared, tag_pid, 4),
                        trio.CapacityLimiter(4), renew_s=60)
        [lease] = await sm.claim_units(tenant, run.ref, mid, "old")
        assert await sm.claim_units(tenant, run.ref, mid, "new") == []  # held
        await trio.sleep(0.7)  # the old lease expires
        [taken] = await sm.claim_units(tenant, run.ref, mid, "new")
        assert taken.holder != lease.holder and taken.claims == 2
        assert await old.run_unit(lease) is False  # its admission rolled back: lease lost
        assert await raw_rows(tenant, play_scope(tenant, PLAY), "nums") == {}
        assert await new.run_unit(taken) is True
        stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("pid",))
        assert all(row["_status"] == "enriched" and row["_attempt_id"] == taken.holder
                   for row in stored.values())
        status = await sm.map_status(tenant, run.ref, mid, counters=True)
        assert status.done == 1 and status.counters["completed"] == 10
        # The old holder's completion, computed before it lost the lease, cannot land either.
        outcomes = [RowOutcome(key, "completed", {"pid": -1, "double": -1}, input_index=index)
                    for key, index in ((k, r["_input_index"]) for k, r in stored.items())]
        with pytest.raises(LeaseLostError):
            await shared_units.complete_unit(tenant, run.ref, mid, "old", lease, "nums",
                                             CONTRACT, outcomes, {})
        after = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("pid",))
        assert after == stored
        await sm.set_state(tenant, run.ref, mid, sm.DONE, sm.LIVE)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why
