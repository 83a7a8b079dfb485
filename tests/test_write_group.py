"""A map's own sheet writes overlapping (`engine.sheets.write_group`): the group's transactions
hold the sheet lock at once, nobody else's do, and the counters stay exact."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from runplane.engine.shared import maps as shared_maps
from runplane.engine.sheets import admit, complete, ensure_sheet, summary
from runplane.engine.sheets import lists, write_group
from runplane.engine.sheets.layout import layout_for
from runplane.engine.sheets.write_group import GroupTxn, Turn, WriteGroup
from runplane.engine.sheets.sheet_write import SheetWrite
from runplane.engine.sheets.write_ledger import WriteLedger, keeping
from runplane.simulations.ports import CountingPort, GatedPort
from tests.sheet_helpers import (
    CONTRACT, completions, counters_match, is_commit, named_rows, new_run, play_scope,
)

NS = "grouped"


def group_of(port, run) -> WriteGroup:
    layout = layout_for(port, play_scope(port), NS)
    return write_group.group_of(port, (layout.counter_args, run.run_id, run.epoch))


async def writes_of(tenant) -> int:
    layout = layout_for(tenant, play_scope(tenant), NS)
    async with tenant.connection("sheet") as conn:
        return await conn.fetchval(
            f'SELECT writes FROM "{tenant.schema}".sheet_summary WHERE org_id = $1 AND play = $2'
            " AND table_namespace = $3", *layout.counter_args)


async def test_a_maps_own_admission_and_completion_hold_the_sheet_lock_at_once(tenant):
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    run = await new_run(tenant, "play", "r1")
    port = GatedPort(tenant)
    first = await admit(port, run, NS, CONTRACT, named_rows("a", 50))  # alone: the ordinary way
    group = group_of(port, run)
    assert group.token is not None and group.overlapped == 0
    ordinary_commit = port.gate(is_commit)   # the completion below, the ordinary way
    held_commit = port.gate(                 # the admission after it, in the group's turn
        lambda b: is_commit(b) and b.checkout != ordinary_commit.boundary.checkout)
    results: dict[str, object] = {}

    async def run_one(name, call):
        results[name] = await call()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_one, "complete_a", lambda: complete(
                port, run, NS, CONTRACT, completions(first)))
            await ordinary_commit.wait_reached()
            # Enters while the group's ordinary transaction is in flight: waits for its token.
            nursery.start_soon(run_one, "admit_b", lambda: admit(
                port, run, NS, CONTRACT, named_rows("b", 40)))
            while not group.waiting:
                await trio.sleep(0.01)
            ordinary_commit.release()
            await held_commit.wait_reached()  # the admission holds the row FOR SHARE ...
            # ... and another write of the group goes through meanwhile, to its COMMIT:
            await admit(port, run, NS, CONTRACT, named_rows("c", 30))
            held_commit.release()
    assert group.overlapped == 2  # the second and the third admission, in the group's turn
    assert results["complete_a"].updated == 50
    assert len(results["admit_b"].pending) == 40
    assert (await counters_match(tenant, play_scope(tenant), NS))[0]
    counts = await summary(tenant, play_scope(tenant), NS)
    assert (counts.total, counts.completed, counts.queued) == (120, 50, 70)


async def test_another_writer_ends_the_groups_turn(tenant):
    """The group's token no longer holds once another run wrote the sheet: its transaction
    finds the summary row unclaimed and runs again the ordinary way, with the same outcome."""
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    run = await new_run(tenant, "play", "r1")
    other = await new_run(tenant, "play", "r2")
    port = CountingPort(tenant)
    await admit(port, run, NS, CONTRACT, named_rows("a", 10))
    group = group_of(port, run)
    token = group.token
    await admit(tenant, other, NS, CONTRACT, named_rows("z", 5))  # another writer: writes moves on
    assert await writes_of(tenant) == token + 1
    group.in_flight.append(GroupTxn(frozenset(), Turn.GROUP, token))  # a write of it in flight
    port.reset()
    admission = await admit(port, run, NS, CONTRACT, named_rows("b", 20))
    assert len(admission.pending) == 20
    claims = [sql for sql in port.statements if "AND s.writes = " in sql]
    assert len(claims) == 1  # tried in the group's turn once, then went the ordinary way
    assert group.overlapped == 0 and group.token == token + 2
    assert (await counters_match(tenant, play_scope(tenant), NS))[0]


async def test_a_live_shared_map_of_the_sheet_keeps_the_group_out(tenant):
    """Opening a shared map adds one to its sheet's `writes` (a shared map's writers hold the
    row shared without a token); while it is live, a group's transaction goes the ordinary
    way even with a token that holds."""
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    run = await new_run(tenant, "play", "r1")
    port = CountingPort(tenant)
    await admit(port, run, NS, CONTRACT, named_rows("a", 10))
    before = await writes_of(tenant)
    other = await new_run(tenant, "play", "r2")
    await shared_maps.publish(tenant, other, "map-0", NS, config={}, function="f",
                              play_digest="d", units=[(0, 0, 1)])
    assert await shared_maps.set_state(tenant, other, "map-0", shared_maps.OPEN,
                                       [shared_maps.WAITING])
    assert await writes_of(tenant) == before + 1
    group = group_of(port, run)
    group.token = before + 1  # as if the group's own transaction had left that value
    group.in_flight.append(GroupTxn(frozenset(), Turn.GROUP, group.token))
    port.reset()
    await admit(port, run, NS, CONTRACT, named_rows("b", 10))
    assert len([sql for sql in port.statements if "AND s.writes = " in sql]) == 1
    assert group.overlapped == 0
    assert (await counters_match(tenant, play_scope(tenant), NS))[0]


async def lock_waiters(tenant) -> int:
    """Backends of this test's schema waiting for a lock (the other run's lock statement)."""
    async with tenant.connection("sheet") as conn:
        return await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND position($1 in query) > 0", tenant.schema)


async def overlap_while_another_run_waits(tenant, chain: int) -> tuple[int, bool]:
    """A group whose transactions overlap without a gap — each held at its COMMIT until the
    next one holds the summary row (or waits for it the ordinary way) — while another run's
    admission waits for the row exclusively. Returns (the group's transactions committed while
    the other waited, whether it got in before the chain of `chain` admissions ended)."""
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    run = await new_run(tenant, "play", "r1")
    other = await new_run(tenant, "play", "r2")
    port = GatedPort(tenant)
    await admit(port, run, NS, CONTRACT, named_rows("start", 5))  # alone: the ordinary way
    group = group_of(port, run)
    gated: set[int] = set()  # the checkouts of the admissions already held
    other_done = trio.Event()
    committed: list[int] = []  # the group's count when the other started, and when it ended

    def next_commit():
        return port.gate(lambda b: is_commit(b) and b.checkout not in gated)

    async def other_writer():
        committed.append(group.overlapped)
        await admit(tenant, other, NS, CONTRACT, named_rows("other", 5))
        committed.append(group.overlapped)
        other_done.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            held = next_commit()
            nursery.start_soon(admit, port, run, NS, CONTRACT, named_rows("t0", 5))  # ordinary
            gated.add((await held.wait_reached()).checkout)
            for i in range(1, chain + 1):
                if i == 2:  # the group overlaps from here: another run's write asks for the row
                    nursery.start_soon(other_writer)
                    while not await lock_waiters(tenant):
                        await trio.sleep(0.01)
                before = list(group.in_flight)
                after = next_commit()
                nursery.start_soon(admit, port, run, NS, CONTRACT, named_rows(f"t{i}", 5))
                while not group.waiting and len(group.in_flight) == len(before):
                    await trio.sleep(0.002)
                entered = [t for t in group.in_flight if t not in before]
                if entered and entered[0].turn is Turn.GROUP:
                    await after.wait_reached()  # it holds the row beside the one before
                held.release()  # the one before commits
                gated.add((await after.wait_reached()).checkout)
                held = after
                await trio.sleep(0.02)  # time for a waiting writer to take the row
                if other_done.is_set():
                    break
            got_in = other_done.is_set()
            held.release()
            await other_done.wait()
    assert (await counters_match(tenant, play_scope(tenant), NS))[0]
    return committed[1] - committed[0], got_in


async def test_another_runs_writer_gets_in_while_the_group_keeps_overlapping(tenant):
    """PostgreSQL grants a `FOR SHARE` lock beside other sharers even while an exclusive
    locker waits, so a group whose transactions always overlap would keep another run's write
    out for as long as the map lasts: every `ORDINARY_EVERY` one goes the ordinary way, and
    the waiting writer takes the row before it."""
    overlapped, got_in = await overlap_while_another_run_waits(tenant, chain=40)
    assert got_in, "the other run's write waited for the sheet's lock as long as the group ran"
    # the one holding the row when the other asked, then at most ORDINARY_EVERY more
    assert overlapped <= write_group.ORDINARY_EVERY + 1


async def test_a_list_maps_group_folds_its_deltas_into_its_proof(tenant):
    """What a list map does before it records its list: its write group's deltas folded by
    one ordinary transaction inside its ledger, which then proves the sheet's `writes`."""
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    run = await new_run(tenant, "play", "r1")
    layout = layout_for(tenant, play_scope(tenant), NS)
    ledger = WriteLedger(layout.counter_args)
    with keeping(ledger):
        first = await admit(tenant, run, NS, CONTRACT, named_rows("a", 20))  # alone: ordinary
        group = ledger.group  # the list map's own group, kept on its ledger
        assert isinstance(group, WriteGroup) and group.token is not None
        group.in_flight.append(GroupTxn(frozenset(), Turn.GROUP, group.token))
        await complete(tenant, run, NS, CONTRACT, completions(first))  # in the group's turn
        assert group.overlapped == 1 and group.deltas
        group.in_flight.clear()
        await lists.fold_deltas(tenant, SheetWrite(run, NS, CONTRACT))
    assert ledger.proven_writes() == await writes_of(tenant)
    async with tenant.connection("sheet") as conn:
        assert await conn.fetchval(
            f'SELECT count(*) FROM "{tenant.schema}".sheet_counter_deltas WHERE org_id = $1'
            " AND play = $2 AND table_namespace = $3", *layout.counter_args) == 0
    counts = await summary(tenant, play_scope(tenant), NS)
    assert (counts.total, counts.completed) == (20, 20)
    assert (await counters_match(tenant, play_scope(tenant), NS))[0]


async def test_a_transaction_sharing_a_row_with_one_in_flight_goes_the_ordinary_way():
    group = WriteGroup(token=8)
    alone = await group.enter(["a"])  # nothing of the group in flight: the ordinary way
    assert alone.turn is Turn.ORDINARY
    group.leave(alone, committed=True, writes=9)
    group.in_flight.append(GroupTxn(frozenset({"a"}), Turn.GROUP, 9))  # "a" on its way
    joined = await group.enter(["b"])
    assert joined.turn is Turn.GROUP and joined.token == 9
    assert (await group.enter(["a", "c"])).turn is Turn.ORDINARY


async def test_a_transaction_waits_for_its_groups_ordinary_one():
    group = WriteGroup(token=3)
    ordinary = await group.enter(["a"], ordinary=True)
    entered: list[GroupTxn] = []

    async def second():
        entered.append(await group.enter(["b"]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert not entered  # it waits for the token that one leaves
        group.leave(ordinary, committed=True, writes=4)
    assert entered[0].turn is Turn.GROUP and entered[0].token == 4


async def test_every_so_often_one_goes_the_ordinary_way():
    group = WriteGroup(token=1)
    group.in_flight.append(GroupTxn(frozenset({"x"}), Turn.GROUP, 1))  # in flight throughout
    for i in range(write_group.ORDINARY_EVERY):
        txn = await group.enter([str(i)])
        assert txn.turn is Turn.GROUP
        group.leave(txn, committed=True)
    assert group.overlapped == write_group.ORDINARY_EVERY and group.deltas
    late = await group.enter(["late"])
    assert late.turn is Turn.ORDINARY
    group.leave(late, committed=True, writes=2)
    assert (group.token, group.since_ordinary, group.deltas) == (2, 0, False)


@pytest.mark.parametrize("group_first", [True, False])
def test_a_ledger_excuses_only_its_own_groups_deltas(group_first):
    ledger = WriteLedger(("org", "play", "ns"))
    ledger.note(5, False)
    if group_first:
        ledger.note(None, False, group=True)
    ledger.note(6, True)  # an ordinary transaction that found deltas
    assert ledger.proven_writes() == (6 if group_first else None)


def test_a_port_keeps_its_most_recent_groups(monkeypatch):
    """A gateway is not told when a client's map ends: past `MAX_GROUPS` the least recently
    used group is dropped, and its writer starts again with an ordinary transaction."""
    monkeypatch.setattr(write_group, "MAX_GROUPS", 2)
    port = object.__new__(WriteGroup)  # any object that can be weakly referenced
    first = write_group.group_of(port, ("a",))
    first.token = 5
    write_group.group_of(port, ("b",))
    assert write_group.group_of(port, ("a",)) is first  # used again: now the most recent
    write_group.group_of(port, ("c",))  # drops "b"
    assert write_group.group_of(port, ("a",)) is first
    fresh = write_group.group_of(port, ("b",))
    assert fresh.token is None  # a new group: no token, so its first write is ordinary
