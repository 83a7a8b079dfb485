"""The run history: each map's entry while it runs, when it ends, and after a crash."""

from __future__ import annotations

import datetime

import attrs
import pytest
import trio

from runplane.actors import open_run
from runplane.engine.runs import history
from runplane.engine import sheets
from runplane.engine.errors import InvalidInputError
from runplane.engine.values.scopes import PlayScope

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))


def rows(n: int) -> list[dict]:
    return [{"name": f"r{i}"} for i in range(n)]


def test_a_record_cannot_be_built_invalid():
    now = datetime.datetime.now(datetime.timezone.utc)
    assert history.MapRecord("map-0", "t", "finished", now, completed=3).completed == 3
    for bad in ({"state": "exploded"}, {"completed": -1}, {"map_key": ""}):
        with pytest.raises(InvalidInputError):
            history.MapRecord(**{"map_key": "map-0", "table_namespace": "t", "state": "running",
                                 "started_at": now, **bad})


async def test_each_map_records_what_it_did(tenant):
    async def fn(row):
        if row["name"].endswith("3"):
            raise ValueError("no")
        return {"upper": row["name"].upper()}

    async def stream():
        for row in rows(7):
            yield row

    async with open_run(tenant, "play") as run:
        await run.map("t", rows(30), fn, contract=CONTRACT)
        await run.map("Other Table", stream(), fn, contract=CONTRACT)
    scope = PlayScope(tenant.org_id, "play")
    stored = await history.list_maps(tenant, scope, [run.run_id, "no-such-run"])
    by_key = {(entry.record.table_namespace, entry.record.map_id): entry.record
              for entry in stored}
    assert {entry.record.map_key for entry in stored} == {"t/map-0", "other_table/stream-0"}
    listed, streamed = by_key[("t", "map-0")], by_key[("other_table", "stream-0")]
    assert (listed.state, listed.admitted, listed.completed, listed.failed, listed.running) == (
        "finished", 30, 27, 3, 0)
    assert (streamed.state, streamed.admitted, streamed.completed, streamed.failed) == (
        "finished", 7, 6, 1)
    assert listed.duration_s is not None and listed.duration_s >= 0
    assert await history.live_maps(tenant, scope) == []  # nothing is running now


async def test_two_tables_first_maps_in_one_run_keep_their_own_history(tenant):
    """Map ids count per table: the first list map of each table is `map-0`, and the history
    keeps both (the second used to overwrite the first)."""
    async def fn(row):
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play") as run:
        await run.map("a", rows(3), fn, contract=CONTRACT)
        await run.map("b", rows(5), fn, contract=CONTRACT)
    stored = await history.list_maps(tenant, PlayScope(tenant.org_id, "play"), [run.run_id])
    assert sorted((e.record.table_namespace, e.record.map_id, e.record.admitted)
                  for e in stored) == [("a", "map-0", 3), ("b", "map-0", 5)]


async def test_a_crashed_map_keeps_its_last_counts_until_the_wake_replaces_them(tenant):
    started = trio.Event()
    run_id = None

    async def slow(row):
        started.set()
        await trio.sleep(0.01)
        return {"upper": row["name"].upper()}

    with trio.move_on_after(30):
        async with trio.open_nursery() as nursery:
            async def crash_when_running():
                await started.wait()
                scope = PlayScope(tenant.org_id, "play")
                while not any(entry.record.completed for entry in
                              await history.live_maps(tenant, scope)):
                    await trio.sleep(0.05)  # until a heartbeat wrote some completed rows
                nursery.cancel_scope.cancel()  # a crash: the run is cancelled mid-map

            nursery.start_soon(crash_when_running)
            async with open_run(tenant, "play") as run:
                run_id = run.run_id
                await run.map("t", rows(2000), slow, contract=CONTRACT, concurrency=2)
    scope = PlayScope(tenant.org_id, "play")
    [crashed] = await history.list_maps(tenant, scope, [run_id])
    # cancelled in its process (as Ctrl-C does): `interrupted` at once; a SIGKILL leaves
    # `running`, read as interrupted once it is stale
    assert crashed.record.state == "interrupted" and crashed.record.ended_at is None
    assert crashed.record.completed > 0  # its last counts
    async with open_run(tenant, "play", run_id) as woken:  # the wake finishes the map

        async def fast(row):
            return {"upper": row["name"].upper()}

        result = await woken.map("t", rows(2000), fast, contract=CONTRACT)
    [entry] = await history.list_maps(tenant, scope, [run_id])
    assert (entry.record.state, entry.record.admitted) == ("finished", 2000)
    assert entry.record.cached == result.cached > 0  # what finished before the crash


async def test_a_late_heartbeat_never_replaces_the_maps_last_entry(tenant):
    """A heartbeat still under way when its map ends may land after the last entry: it changes
    nothing; a wake (a new call of the map, another `started_at`) replaces the entry."""
    async with open_run(tenant, "play") as run:
        await run.map("t", rows(3), lambda row: {"upper": row["name"].upper()},
                      contract=CONTRACT)
    scope = PlayScope(tenant.org_id, "play")
    [done] = await history.list_maps(tenant, scope, [run.run_id])
    heartbeat = history.MapRecord(done.record.map_key, "t", "running", done.record.started_at,
                                  admitted=1, running=1)
    await history.record_map(tenant, run.scope, heartbeat)
    [entry] = await history.list_maps(tenant, scope, [run.run_id])
    assert (entry.record.state, entry.record.admitted) == ("finished", 3)
    woken = attrs.evolve(heartbeat, started_at=done.record.started_at
                         + datetime.timedelta(seconds=1))
    await history.record_map(tenant, run.scope, woken)
    [entry] = await history.list_maps(tenant, scope, [run.run_id])
    assert (entry.record.state, entry.record.admitted) == ("running", 1)
