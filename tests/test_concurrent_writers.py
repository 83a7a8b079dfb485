"""Concurrent sheet writers (a shared map's unit writes): they do not wait for each other, an
ordinary writer waits for them and folds their counter deltas, and counters stay exact."""

from __future__ import annotations

import trio

from runplane.actors import open_run
from runplane.engine.shared import maps as sm
from runplane.engine.shared import units as shared_units
from runplane.engine.errors import LeaseLostError
from runplane.engine.ports import table
from runplane.engine.shared.leases import claim_units
from runplane.engine.sheets import RowOutcome, SheetWrite, admit, ensure_sheet
from runplane.engine.sheets.completion import complete_write
from runplane.engine.sheets.sheet_txn import UnitGuard
from runplane.simulations.ports import GatedPort

from .plays.scale_play import tag_pid
from .sheet_helpers import CONTRACT, counters_match, new_run, play_scope, raw_rows
from .test_shared_map import CONTRACT as SHARED_CONTRACT, PLAY

NS = "concurrent"


async def _lock_waiters(tenant) -> int:
    async with tenant.connection("retirement") as conn:
        return await conn.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted")


async def _delta_rows(tenant) -> int:
    async with tenant.connection("retirement") as conn:
        return await conn.fetchval(
            f"SELECT (SELECT count(*) FROM {table(tenant, 'sheet_counter_deltas')})"
            f" + (SELECT count(*) FROM {table(tenant, 'sheet_column_deltas')})")


async def _next_ordinary_writer_folds(tenant) -> None:
    """An ordinary write (a new row) leaves no delta behind, and counters stay exact."""
    run = await new_run(tenant, "play", "folder")
    await admit(tenant, run, NS, CONTRACT, [{"name": "c"}])
    assert await _delta_rows(tenant) == 0
    ok, why = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, why


async def _two_writers(tenant, second_concurrent: bool) -> tuple[dict, bool]:
    """Writer A (concurrent) parks inside its transaction, after the lock statement; writer B
    completes another row meanwhile. Whether B finished while A was parked."""
    run = await new_run(tenant, "play", f"r-{second_concurrent}")
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    a, b = (row.key for row in admission.pending)
    gated = GatedPort(tenant)
    parked = gated.gate_query(4)  # BEGIN, settings, lock: parked before its write statement
    results: dict = {}
    finished_while_parked = False

    async def writer_a() -> None:
        results["a"] = await complete_write(gated, SheetWrite(run, NS, CONTRACT),
                                            [RowOutcome(a, "completed", {"score": 1})],
                                            guard=UnitGuard(concurrent=True))

    async def writer_b() -> None:
        results["b"] = await complete_write(tenant, SheetWrite(run, NS, CONTRACT),
                                            [RowOutcome(b, "completed", {"score": 2})],
                                            guard=UnitGuard(concurrent=second_concurrent))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer_a)
            await parked.wait_reached()
            nursery.start_soon(writer_b)
            while "b" not in results and not await _lock_waiters(tenant):
                await trio.sleep(0.01)
            finished_while_parked = "b" in results
            parked.release()
    assert results["a"].committed_keys == (a,) and results["b"].committed_keys == (b,)
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["score"])
    assert (stored[a]["score"], stored[b]["score"]) == (1, 2)
    return results, finished_while_parked


async def test_concurrent_writers_do_not_wait_for_each_other_and_counters_stay_exact(tenant):
    _, finished = await _two_writers(tenant, second_concurrent=True)
    assert finished  # B committed while A held its transaction open
    assert await _delta_rows(tenant) > 0  # their counters are deltas, summed by readers
    ok, why = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, why
    await _next_ordinary_writer_folds(tenant)  # into the summary rows


async def test_an_ordinary_writer_waits_for_concurrent_writers(tenant):
    _, finished = await _two_writers(tenant, second_concurrent=False)
    assert not finished  # B queued behind A (the summary row A holds FOR SHARE)
    ok, why = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, why
    # B's lock statement read the sheet before A committed, so A's deltas wait for the next
    # ordinary writer, which folds them.
    await _next_ordinary_writer_folds(tenant)


async def _published_concurrent(tenant, namespace: str, map_invocation_id: str) -> bool:
    async with tenant.connection("retirement") as conn:
        return await conn.fetchval(
            f"SELECT config->>'concurrent' = 'true' FROM {table(tenant, 'shared_maps')}"
            " WHERE table_namespace = $1 AND map_invocation_id = $2", namespace,
            map_invocation_id)


async def test_a_list_with_a_repeated_row_is_written_one_worker_at_a_time(tenant):
    distinct = [{"n": i} for i in range(1200)]
    repeated = distinct[:600] + distinct[:600]  # each row twice, in different units
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            first = await run.map("distinct", distinct, tag_pid, contract=SHARED_CONTRACT,
                                  workers=2)
            second = await run.map("repeated", repeated, tag_pid, contract=SHARED_CONTRACT,
                                   workers=2)
    assert await _published_concurrent(tenant, "distinct", first.map_invocation_id)
    assert not await _published_concurrent(tenant, "repeated", second.map_invocation_id)
    assert (first.completed, first.skipped) == (1200, 0)
    for namespace, count in (("distinct", 1200), ("repeated", 600)):
        stored = await raw_rows(tenant, play_scope(tenant, PLAY), namespace, ("n", "double"))
        assert len(stored) == count
        assert all(row["_status"] == "enriched" and row["double"] == 2 * row["n"]
                   for row in stored.values())
        ok, why = await counters_match(tenant, play_scope(tenant, PLAY), namespace)
        assert ok, why


async def test_a_concurrent_write_to_a_map_not_published_so_is_refused(tenant):
    # A map published not concurrent, its unit claimed by hand: a concurrent admission of it
    # is refused by the lease check and writes nothing.
    repeated = [{"n": 1}, {"n": 1}]
    async with open_run(tenant, PLAY) as run:
        await ensure_sheet(tenant, run.scope.play_scope, "dups", SHARED_CONTRACT)
        await sm.publish(tenant, run.ref, "m-1", "dups", config={"concurrent": False},
                         function="f", play_digest="d", units=[(0, 0, 2)])
        await sm.set_state(tenant, run.ref, "m-1", sm.OPEN, (sm.WAITING,))
        leases = await claim_units(tenant, run.ref, "m-1", "w/1", limit=1)
        try:
            await shared_units.admit_units(tenant, run.ref, "m-1", leases, "dups",
                                           SHARED_CONTRACT, repeated, [0, 1], concurrent=True)
        except LeaseLostError:
            pass
        else:
            raise AssertionError("a concurrent admission of a map not published so was taken")
        assert await raw_rows(tenant, run.scope.play_scope, "dups", ["n"]) == {}
