"""Recorded lists: an unchanged rerun of a list is answered in one statement, exactly as the
ordinary path would answer it, and any write to the sheet since (even one still uncommitted
while the list was recorded or replayed) sends the next rerun down the ordinary path."""

from __future__ import annotations

import datetime

import trio

from runplane.actors import open_run
from runplane.engine.array_input import Occurrence
from runplane.engine.values.scopes import RunRef, RunScope
from runplane.engine.sheets import CellPolicy, SheetWrite, admit, read_rows
from runplane.engine.sheets import lists
from runplane.engine.sheets.layout import layout_for
from runplane.simulations.ports import CountingPort, GatedPort
from runplane.engine.ports import PortSettings

from .run_helpers import forget_recorded_lists
from .sheet_helpers import CONTRACT, PLAY, counters_match, new_run, play_scope, raw_rows

NS = "replayed"
ROWS = [{"name": f"n{i}"} for i in range(300)]


async def mapped(port, run_id: str, rows=ROWS, fn=None, **options):
    """Map `rows` in a new run `run_id`; returns its result and the rows the function got."""
    calls: list[dict] = []

    async def score(row):
        calls.append(row)
        return {"score": len(row["name"])}

    async with open_run(port, PLAY, run_id) as run:
        result = await run.map(NS, rows, fn or score, contract=CONTRACT, **options)
    return result, calls


def counts(result) -> tuple:
    return (result.admitted, result.cached, result.completed, result.failed, result.blocked,
            result.fenced, result.skipped, result.executed)


async def recorded(tenant) -> int:
    async with tenant.connection("sheet") as conn:
        return await conn.fetchval(f'SELECT count(*) FROM "{tenant.schema}".sheet_lists')


def replays(port: CountingPort) -> list[str]:
    return [sql for sql in port.statements if "sheet_lists" in sql and "membership AS" in sql]


def probes(port: CountingPort) -> list[str]:
    return [sql for sql in port.statements if "AS unsettled" in sql]


async def test_an_unchanged_rerun_is_answered_in_one_statement_as_the_ordinary_path_would(tenant):
    first, calls = await mapped(tenant, "first")
    assert first.completed == 300 and len(calls) == 300
    assert await recorded(tenant) == 1
    before = await raw_rows(tenant, play_scope(tenant), NS)

    port = CountingPort(tenant)
    replayed, calls = await mapped(port, "second")
    assert calls == [] and len(replays(port)) == 1
    sheet_table = layout_for(tenant, play_scope(tenant), NS).qualified
    assert [sql for sql in port.statements if sheet_table in sql] == []  # not even read
    # The ordinary path (no probe-first admission, so no replay) answers the same.
    ordinary, calls = await mapped(tenant, "third", fast_admission=False)
    assert calls == [] and counts(replayed) == counts(ordinary) == (300, 300, 0, 0, 0, 0, 0, 0)
    assert await raw_rows(tenant, play_scope(tenant), NS) == before  # no row touched
    # The replayed run owns its cache hits, as a probed rerun does.
    for run_id in ("second", "third"):
        owned = await read_rows(tenant, play_scope(tenant), NS, run_id=run_id, limit=1000)
        assert sorted(row["name"] for row in owned) == sorted(row["name"] for row in ROWS)
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


def recordings(port: CountingPort) -> list[str]:
    return [sql for sql in port.statements if "sheet_lists" in sql and "stale AS (" in sql]


async def test_the_record_goes_on_while_the_run_retires_and_the_exit_waits_for_it(tenant,
                                                                                monkeypatch):
    """The list's record and the run's retirement overlap (here each waits for the other to
    begin: one after the other, neither would), and the run's exit comes after both."""
    from runplane.actors import run as run_module

    recording, retiring = trio.Event(), trio.Event()
    record_list, guard_retirement = lists.record_list, run_module.retirement.guard_retirement

    async def record(*args, **kwargs):
        recording.set()
        with trio.fail_after(10):
            await retiring.wait()
        return await record_list(*args, **kwargs)

    async def retire(*args, **kwargs):
        retiring.set()
        with trio.fail_after(10):
            await recording.wait()
        await guard_retirement(*args, **kwargs)

    monkeypatch.setattr(lists, "record_list", record)
    monkeypatch.setattr(run_module.retirement, "guard_retirement", retire)
    first, _ = await mapped(tenant, "first")
    assert first.completed == 300 and await recorded(tenant) == 1
    port = CountingPort(tenant)
    again, calls = await mapped(port, "again")
    assert again.cached == 300 and not calls and len(replays(port)) == 1


async def test_a_map_that_proves_every_row_a_hit_records_its_list_without_a_key_check(tenant):
    """A first run of a list: its write ledger shows nobody else wrote the sheet, and every
    outcome gave a value, so the recording checks no key; the rerun replays it."""
    port = CountingPort(tenant)
    first, _ = await mapped(port, "first")
    [recording] = recordings(port)
    sheet_table = layout_for(tenant, play_scope(tenant), NS).qualified
    assert first.completed == 300 and sheet_table not in recording  # no row read
    assert await recorded(tenant) == 1
    port = CountingPort(tenant)
    result, calls = await mapped(port, "second")
    assert calls == [] and result.cached == 300 and len(replays(port)) == 1


async def test_another_writer_during_the_map_makes_the_recording_check_every_key(tenant):
    """A writer that re-admits a row the map completed already, while the map still runs,
    takes a `writes` value between the map's: no proof, so the recording checks every key,
    finds that row no cache hit, and records nothing; the rerun runs that row."""
    scope = play_scope(tenant)

    async def score(row):
        if row["name"] == "n150":  # once n3's completion committed
            while not any(r["_input_index"] == 3 and r["_status"] == "enriched"
                          for r in (await raw_rows(tenant, scope, NS)).values()):
                await trio.sleep(0.01)
            newer = await new_run(tenant, PLAY, "newer")  # its write version is newer
            await admit(tenant, newer, NS, CONTRACT, [ROWS[3]], force=True)  # n3 pending again
        return {"score": len(row["name"])}

    port = CountingPort(tenant)
    first, _ = await mapped(port, "first", fn=score, concurrency=1)
    [recording] = recordings(port)
    sheet_table = layout_for(tenant, play_scope(tenant), NS).qualified
    assert (first.completed, first.fenced) == (300, 0) and sheet_table in recording
    assert await recorded(tenant) == 0
    result, calls = await mapped(tenant, "second")
    assert calls == [ROWS[3]] and (result.completed, result.cached) == (1, 299)


def test_a_write_ledger_proves_only_contiguous_writes_without_deltas():
    from runplane.engine.sheets.write_ledger import WriteLedger, keeping, note_commit

    sheet, other = ("org", "play", "ns"), ("org", "play", "other")
    ledger = WriteLedger(sheet)
    assert ledger.proven_writes() is None  # nothing written: nothing proven
    with keeping(ledger):
        for writes in (7, 9, 8):  # committed in any order
            note_commit(sheet, writes, False)
        note_commit(other, 42, True)  # another sheet: not this ledger's
    note_commit(sheet, 11, False)  # outside `keeping`: not noted
    assert ledger.values == [7, 9, 8] and ledger.proven_writes() == 9
    ledger.note(11, False)  # 10 is missing: another writer's
    assert ledger.proven_writes() is None
    twice = WriteLedger(sheet)
    for writes in (5, 5, 7):  # as many values as 5..7 holds, but 6 missing: never proven
        twice.note(writes, False)
    assert twice.proven_writes() is None
    for spoiler in ((12, True), (None, False)):  # deltas found; a concurrent transaction
        spoiled = WriteLedger(sheet)
        spoiled.note(5, False)
        spoiled.note(*spoiler)
        assert spoiled.proven_writes() is None


async def test_a_write_since_the_recording_sends_the_rerun_down_the_ordinary_path(tenant):
    await mapped(tenant, "first")
    newer = await new_run(tenant, PLAY, "newer")
    await admit(tenant, newer, NS, CONTRACT, [ROWS[7]], force=True)  # n7 pending again
    port = CountingPort(tenant)
    result, calls = await mapped(port, "second")
    assert calls == [ROWS[7]] and (result.completed, result.cached) == (1, 299)
    assert probes(port) != []
    # That rerun ended with every row a cache hit: it recorded the list again.
    port = CountingPort(tenant)
    result, calls = await mapped(port, "third")
    assert calls == [] and result.cached == 300 and len(replays(port)) == 1
    # Counter deltas not folded yet (a shared map's concurrent writers) mean unknown writes.
    async with tenant.connection("sheet") as conn:
        await conn.execute(
            f'INSERT INTO "{tenant.schema}".sheet_counter_deltas'
            " (org_id, play, table_namespace, slot) VALUES ($1, $2, $3, 0)",
            tenant.org_id, PLAY, NS)
    port = CountingPort(tenant)
    result, calls = await mapped(port, "fourth")
    assert calls == [] and result.cached == 300 and probes(port) != []


async def parked_writer(tenant, nursery, run_id: str, row: dict):
    """A newer run re-admits `row` (force) and is parked before its COMMIT: it has taken the
    sheet's summary row and written, uncommitted. Returns the gate to release it."""
    newer = await new_run(tenant, PLAY, run_id)
    gated = GatedPort(tenant)
    gate = gated.gate(lambda b: b.kind == "query" and (b.sql or "").strip() == "COMMIT")
    nursery.start_soon(lambda: admit(gated, newer, NS, CONTRACT, [row], force=True))
    await gate.wait_reached()
    return gate


async def test_a_write_uncommitted_while_the_list_is_recorded_or_replayed_is_never_missed(tenant):
    await mapped(tenant, "first")
    async with trio.open_nursery() as nursery:
        # Replayed while a writer is inside its transaction: the rerun comes first.
        gate = await parked_writer(tenant, nursery, "w1", ROWS[3])
        result, calls = await mapped(tenant, "second")
        assert calls == [] and result.cached == 300
        gate.release()
    result, calls = await mapped(tenant, "third")  # the writer committed since
    assert calls == [ROWS[3]] and result.completed == 1

    await forget_recorded_lists(tenant)
    rerun = GatedPort(tenant)
    recording = rerun.gate(lambda b: b.kind == "query" and "sheet_lists" in (b.sql or "")
                           and "ON CONFLICT" in (b.sql or ""))
    answers = []

    async def fourth():
        answers.append(await mapped(rerun, "fourth"))

    async with trio.open_nursery() as nursery:
        # A rerun probes every row settled and is parked before it records the list; a writer
        # re-admits n5 and is parked before its COMMIT; the recording still sees n5 a cache hit
        # (and the sheet's `writes` before the writer's), so the list is recorded...
        nursery.start_soon(fourth)
        await recording.wait_reached()
        gate = await parked_writer(tenant, nursery, "w2", ROWS[5])
        recording.release()
        while not answers:
            await trio.sleep(0.01)
        result, calls = answers[0]
        assert calls == [] and result.cached == 300 and await recorded(tenant) == 1
        gate.release()
    result, calls = await mapped(tenant, "fifth")  # ...and the writer's commit outdates it
    assert calls == [ROWS[5]] and result.completed == 1
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


async def test_a_list_is_recorded_only_when_every_row_ends_a_cache_hit(tenant):
    async def empty_for_n1(row):
        return {"score": "" if row["name"] == "n1" else 1}  # "" is no cache hit

    result, _ = await mapped(tenant, "first", fn=empty_for_n1)
    assert result.completed == 300 and await recorded(tenant) == 0
    result, calls = await mapped(tenant, "second")
    assert calls == [ROWS[1]] and result.cached == 299

    async def fail_one(row):
        if row["name"] == "failing":
            raise ValueError("this row fails")
        return {"score": 1}

    other = [{"name": f"m{i}"} for i in range(50)] + [{"name": "failing"}]
    await forget_recorded_lists(tenant)
    result, _ = await mapped(tenant, "third", rows=other, fn=fail_one, fail_fast=False)
    assert result.failed == 1 and await recorded(tenant) == 0
    repeated = [{"name": "r1"}, {"name": "r1"}]
    result, _ = await mapped(tenant, "fourth", rows=repeated)
    assert result.skipped == 1 and await recorded(tenant) == 0
    result, _ = await mapped(tenant, "fifth", rows=[{"name": "f1"}], force=True)
    assert result.completed == 1 and await recorded(tenant) == 0


def test_a_list_digest_changes_with_any_value_type_or_key_order():
    ref = RunRef(RunScope("org", PLAY, "r"), 1)
    write = SheetWrite(ref, NS, CONTRACT)
    base = lists.list_digest(write, [{"name": "a", "n": 1}])
    # the run does not matter
    assert base == lists.list_digest(SheetWrite(RunRef(RunScope("org", PLAY, "other"), 9), NS,
                                                CONTRACT), [{"name": "a", "n": 1}])
    different = [
        [{"name": "a", "n": 1.0}], [{"name": "a", "n": True}], [{"n": 1, "name": "a"}],
        [{"name": "a", "n": 2}], [{"name": "a", "n": 1}, {"name": "a", "n": 1}],
    ]
    digests = {lists.list_digest(write, rows) for rows in different}
    assert base not in digests and len(digests) == len(different)
    assert lists.list_digest(SheetWrite(ref, "other", CONTRACT), [{"name": "a", "n": 1}]) != base
    assert lists.list_digest(write, [Occurrence({"name": "a"})]) is None
    assert lists.list_digest(write, [{"name": datetime.date(2026, 1, 1)}]) is None
    # what else holds the rows' objects does not matter, only their values (no memo)
    name = "".join(["sha", "red"])
    row = {"name": name, "n": 1000}  # one dict and one string, each held twice and here too
    assert lists.list_digest(write, [row, row]) == lists.list_digest(
        write, [{"name": "".join(["sh", "ared"]), "n": 1000}, {"name": "shared", "n": 1000}])
    # not core types (a subclass included), a cycle: no digest
    assert lists.list_digest(write, [type("Row", (dict,), {})(name="a")]) is None
    assert lists.list_digest(write, [{"name": type("Name", (str,), {})("a")}]) is None
    cyclic: list = [{"name": "a"}]
    cyclic[0]["self"] = cyclic
    assert lists.list_digest(write, cyclic) is None
    assert lists.recordable(_DirectPort(), write, 10)
    assert not lists.recordable(_DirectPort(), SheetWrite(ref, NS, CONTRACT, force=True), 10)
    assert not lists.recordable(_DirectPort(), SheetWrite(
        ref, NS, CONTRACT, cell_policies={"score": CellPolicy(stale_after_s=5)}), 10)
    assert not lists.recordable(_DirectPort(), write, lists.MAX_RECORDED_ROWS + 1)
    assert not lists.recordable(_DirectPort(sheet_lock_keys={"x": 1}), write, 10)


class _DirectPort:
    def __init__(self, sheet_lock_keys=None):
        self.settings = PortSettings("s", sheet_lock_keys=sheet_lock_keys or {})


async def test_a_map_that_began_staging_its_list_is_not_answered_from_the_record(tenant):
    """A wake of a map that began staging resumes its staging: the replay statement answers
    only a map with no begin or seal fact (it checks them itself, no manifest read beside)."""
    await mapped(tenant, "first")
    async with open_run(tenant, PLAY, "second") as run:
        write = SheetWrite(run.ref, NS, CONTRACT)
        digest = lists.list_digest(write, ROWS)
        await run.stage_array(NS, "map-0", ROWS)  # begun and sealed, as a wake finds it
        staged = run.ref.scope.map(NS, "map-0")
        assert await lists.replay_list(tenant, write, digest, staged) is None
        fresh = run.ref.scope.map(NS, "map-1")
        assert await lists.replay_list(tenant, write, digest, fresh) == len(ROWS)


async def test_a_map_write_whose_commit_is_unknown_leaves_no_proof(dsn, tenant, monkeypatch):
    """A completion of the map commits, but its reply is lost and its fate cannot be read
    (the server no longer knows the transaction): the map cannot note the `writes` value it
    left, so its ledger has a gap and the recording checks every key, as after another
    writer, and still records the list (every row is a hit); the rerun replays it."""
    from runplane.engine import open_tenant
    from runplane.engine.tenant import Tenant

    from .pg_proxy import open_pg_proxy

    async def fate_unknown(self, xid, on=None):
        return None  # as `txid_status` answers for a transaction too old to know

    monkeypatch.setattr(Tenant, "commit_status", fate_unknown)
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant(tenant.org_id, proxy.dsn, schema=tenant.schema) as proxied:
            async def score(row):
                if row == ROWS[-1]:  # the last row: its completion commits next
                    proxy.drop_commit_reply = 1
                return {"score": len(row["name"])}

            port = CountingPort(proxied)
            first, _ = await mapped(port, "first", fn=score, concurrency=1)
            assert proxy.fired == {"drop_commit_reply": 1}
    [recording] = recordings(port)
    sheet_table = layout_for(tenant, play_scope(tenant), NS).qualified
    assert first.completed == 300 and sheet_table in recording  # every key checked
    assert await recorded(tenant) == 1
    port = CountingPort(tenant)
    result, calls = await mapped(port, "second")
    assert calls == [] and result.cached == 300 and len(replays(port)) == 1
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail
