"""run.map: the admission → workers → completer pipeline, its fences, bounds and cancellation."""

from __future__ import annotations

import collections

import pytest
import trio
import trio.testing

from runplane.actors import MapResult, open_run
from runplane.engine import sheets
from runplane.engine.errors import InvalidInputError
from runplane.engine.runs import new_run_id

from .run_helpers import fact_kinds, outbox_state

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))


def rows(n: int, tag: str = "r") -> list[dict]:
    return [{"name": f"{tag}{i}"} for i in range(n)]


async def aiter_rows(items, pulled: list[int] | None = None):
    for item in items:
        if pulled is not None:
            pulled[0] += 1
        yield item
        await trio.lowlevel.checkpoint()


def counting(fn=None):
    calls: collections.Counter = collections.Counter()

    async def wrapped(row):
        calls[row["name"]] += 1
        if fn is not None:
            return await fn(row)
        return {"upper": row["name"].upper()}

    return wrapped, calls


async def sheet(tenant, play="play", table="t") -> dict[str, dict]:
    found = await sheets.read_rows(tenant, sheets_scope(tenant, play), table, limit=100_000)
    return {row["name"]: row for row in found}


def sheets_scope(tenant, play):
    from runplane.engine.values.scopes import PlayScope

    return PlayScope(tenant.org_id, play)


async def count_star(tenant, play="play", table="t") -> dict[str, int]:
    found = await sheets.read_rows(tenant, sheets_scope(tenant, play), table, limit=100_000)
    return collections.Counter(row["_status"] for row in found)


async def test_list_source_is_staged_mapped_and_retired(tenant):
    async def fn(row):
        if row["name"].endswith("3"):
            raise ValueError(f"no data for {row['name']}")
        return {"upper": row["name"].upper()}

    wrapped, calls = counting(fn)
    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(250), wrapped, contract=CONTRACT, concurrency=7)
    assert isinstance(result, MapResult)
    assert (result.admitted, result.cached, result.completed, result.failed, result.blocked,
            result.fenced) == (250, 0, 225, 25, 0, 0)
    assert set(calls.values()) == {1} and len(calls) == 250
    stored = await sheet(tenant)
    assert stored["r1"]["upper"] == "R1" and stored["r1"]["_status"] == "enriched"
    assert stored["r13"]["_status"] == "failed" and stored["r13"]["_error"] == "no data for r13"
    assert stored["r7"]["_input_index"] == 7
    summary = await sheets.summary(tenant, run.scope.play_scope, "t")
    assert (summary.total, summary.completed, summary.failed) == (250, 225, 25)
    assert await fact_kinds(tenant, run.run_id) == ["array_input_guard"]
    assert await outbox_state(tenant, run.run_id) == "done"

    # A second run finds the enriched rows cached and re-runs only the failed ones.
    wrapped, calls = counting()
    async with open_run(tenant, "play") as again:
        result = await again.map("t", rows(250), wrapped, contract=CONTRACT)
    assert (result.admitted, result.cached, result.completed, result.failed) == (250, 225, 25, 0)
    assert sorted(calls) == sorted(f"r{i}" for i in range(250) if i % 10 == 3)


async def test_async_iterable_source_is_admitted_page_by_page(tenant):
    wrapped, calls = counting()
    async with open_run(tenant, "play") as run:
        result = await run.map("t", aiter_rows(rows(2345)), wrapped, contract=CONTRACT,
                               page_rows=500)
    assert (result.admitted, result.completed, result.failed) == (2345, 2345, 0)
    assert len(calls) == 2345
    stored = await sheet(tenant)
    assert stored["r2344"]["_input_index"] == 2344 and stored["r2344"]["upper"] == "R2344"
    assert await count_star(tenant) == {"enriched": 2345}


async def test_bad_return_values_fail_only_their_row(tenant):
    async def fn(row):
        i = int(row["name"][1:])
        if i == 0:
            return "not a dict"
        if i == 1:
            return {"upper": float("nan")}
        if i == 2:
            return None
        if i == 3:
            raise RuntimeError()
        return {"upper": "ok"}

    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(6), fn, contract=CONTRACT)
    assert (result.completed, result.failed) == (3, 3)
    stored = await sheet(tenant)
    assert "expected a dict" in stored["r0"]["_error"]
    assert "output.upper" in stored["r1"]["_error"]
    assert stored["r2"]["_status"] == "enriched"
    assert stored["r3"]["_error"] == "RuntimeError"


async def test_bad_arguments_raise_before_any_query(tenant):
    async def fn(row):
        return {}

    async with open_run(tenant, "play", retire_on_exit=False) as run:
        with pytest.raises(InvalidInputError):
            await run.map("t", rows(3), fn, contract=("name",))
        with pytest.raises(InvalidInputError):
            await run.map("t", rows(3), fn, contract=CONTRACT, concurrency=0)
        with pytest.raises(InvalidInputError):
            await run.map("t", iter(rows(3)), fn, contract=CONTRACT)
    async with tenant.connection("sheet") as conn:
        assert await conn.fetchval(f'SELECT count(*) FROM "{tenant.schema}".sheet_summary') == 0
    assert await fact_kinds(tenant, run.run_id) == []


async def test_cancellation_flushes_outcomes_already_computed(tenant):
    """Rows 0..K-1 finish at once, the others hang in the user function. The completer never
    flushes on its own (huge linger and batch), so when the map is cancelled the finished rows
    exist only in memory: the shielded flush must write them, and a wake must run only the
    others."""
    finished = 37

    done = []
    crash = trio.CancelScope()

    async def fn(row):
        if int(row["name"][1:]) >= finished:
            await trio.sleep_forever()
        done.append(row["name"])
        if len(done) == finished:
            crash.cancel()  # lands at the workers' next checkpoints
        return {"upper": row["name"].upper()}

    wrapped, calls = counting(fn)
    run_id = new_run_id()
    snapshots = []
    with crash:
        async with open_run(tenant, "play", run_id) as run:
            # page_rows=200: one admission unit (no ramp of smaller first units), so every
            # row is admitted before the crash
            await run.map("t", rows(200), wrapped, contract=CONTRACT, concurrency=8,
                          linger_s=3600, batch_rows=10_000, on_progress=snapshots.append,
                          page_rows=200)
    assert crash.cancelled_caught
    assert await outbox_state(tenant, run_id) == "open"
    assert await count_star(tenant) == {"enriched": finished, "pending": 200 - finished}
    assert snapshots[-1].completed == finished

    wrapped, woken_calls = counting()
    async with open_run(tenant, "play", run_id) as woken:
        result = await woken.map("t", rows(200), wrapped, contract=CONTRACT)
    assert result.cached == finished and result.completed == 200 - finished
    assert not set(woken_calls) & {f"r{i}" for i in range(finished)}
    assert await count_star(tenant) == {"enriched": 200}
    assert await fact_kinds(tenant, run_id) == ["array_input_guard"]


async def test_rows_owned_by_a_newer_run_are_blocked_not_executed(tenant):
    old_id = new_run_id()
    async with open_run(tenant, "play", old_id, retire_on_exit=False):
        pass

    async def hang(row):
        await trio.sleep_forever()

    def crash_when_admitted(snapshot):
        if snapshot.admitted == 40:
            crash.cancel()

    with trio.CancelScope() as crash:  # a newer run admits the rows and crashes
        async with open_run(tenant, "play") as newer:
            await newer.map("t", rows(40), hang, contract=CONTRACT,
                            on_progress=crash_when_admitted)
    wrapped, calls = counting()
    async with open_run(tenant, "play", old_id) as old:
        result = await old.map("t", rows(40), wrapped, contract=CONTRACT)
    assert result.blocked == 40 and result.completed == 0 and not calls
    assert {row.reason for row in result.blocked_rows} == {"newer_run"}
    assert old.epoch < newer.epoch


async def test_a_stale_run_is_fenced_at_completion(tenant):
    release = trio.Event()

    async def slow(row):
        await release.wait()
        return {"upper": "old"}

    async def hang(row):
        await trio.sleep_forever()

    results: list[MapResult] = []
    async with trio.open_nursery() as nursery:
        async with open_run(tenant, "play", retire_on_exit=False) as old:
            old_admitted = trio.Event()

            def on_old_progress(snapshot):
                if snapshot.admitted == 30:
                    old_admitted.set()

            async def old_map():
                results.append(await old.map("t", aiter_rows(rows(30)), slow, contract=CONTRACT,
                                             on_progress=on_old_progress))

            old.start_soon(old_map)
            with trio.fail_after(10):
                await old_admitted.wait()  # old admitted; its workers wait
            newer_admitted = trio.Event()

            def on_progress(snapshot):
                if snapshot.admitted == 30:
                    newer_admitted.set()

            async def newer_map():
                async with open_run(tenant, "play", retire_on_exit=False) as newer:
                    await newer.map("t", aiter_rows(rows(30)), hang, contract=CONTRACT,
                                    on_progress=on_progress)

            nursery.start_soon(newer_map)
            with trio.fail_after(10):
                await newer_admitted.wait()
            release.set()
        nursery.cancel_scope.cancel()
    (result,) = results
    assert result.fenced == 30 and result.completed == 0
    assert {row.reason for row in result.fenced_rows} == {"stale_write_version"}
    assert await count_star(tenant) == {"pending": 30}


async def test_channels_are_bounded_whatever_the_source_size(tenant):
    pulled = [0]
    gate = trio.Event()

    async def blocked(row):
        await gate.wait()
        return {"upper": "x"}

    with trio.CancelScope() as stop:
        async with open_run(tenant, "play", retire_on_exit=False) as run:
            async def watch():
                # Everything stalls once the bounded channels are full (a cushion, because a
                # task waiting on the database also counts as blocked).
                with trio.fail_after(30):
                    await trio.testing.wait_all_tasks_blocked(cushion=0.5)
                stop.cancel()

            run.start_soon(watch)
            await run.map("t", aiter_rows(rows(1_000_000), pulled), blocked, contract=CONTRACT,
                          concurrency=4, page_rows=100)
    # The source was pulled only as far as the bounded channels reach: a few pages.
    assert 0 < pulled[0] <= 1_000


async def test_progress_snapshots_are_monotone_and_end_at_the_result(tenant):
    snapshots = []
    async with open_run(tenant, "play") as run:
        result = await run.map("t", aiter_rows(rows(1500)), counting()[0], contract=CONTRACT,
                               on_progress=snapshots.append, page_rows=300)
    assert snapshots
    for before, after in zip(snapshots, snapshots[1:]):
        assert after.admitted >= before.admitted and after.completed >= before.completed
    last = snapshots[-1]
    assert (last.admitted, last.completed, last.executed) == (result.admitted, result.completed,
                                                              1500)


async def test_a_store_error_in_an_actor_comes_out_as_itself(tenant):
    async def fn(row):
        return {"upper": "x"}

    async with open_run(tenant, "play", retire_on_exit=False) as run:
        with pytest.raises(InvalidInputError):  # admission refuses a row that is not a dict
            await run.map("t", aiter_rows([{"name": "ok"}, "not a row"]), fn, contract=CONTRACT)


async def test_duplicates_across_pages_run_once(tenant):
    source = [{"name": f"r{i % 150}"} for i in range(600)]
    wrapped, calls = counting()
    async with open_run(tenant, "play") as run:
        result = await run.map("t", aiter_rows(source), wrapped, contract=CONTRACT,
                               page_rows=100, concurrency=3)
    assert len(calls) == 150 and set(calls.values()) == {1}
    assert result.completed == 150
    assert result.admitted + result.skipped == 600
    assert result.admitted == 150 + result.cached
    assert await count_star(tenant) == {"enriched": 150}


async def test_no_permit_is_held_while_user_code_runs(tenant):
    arrived = []
    all_in = trio.Event()
    seen = []

    async def fn(row):
        arrived.append(row["name"])
        if len(arrived) == 4:
            # The run's background reporters (rows in a call, every few seconds) may hold a
            # permit for a statement's length; the workers never do: within two seconds the
            # permits must all read zero while the four stay inside the function.
            for _ in range(200):
                in_use = {lane: stats.in_use for lane, stats in tenant.permits().items()}
                if not any(in_use.values()):
                    break
                await trio.sleep(0.01)
            seen.append(in_use)
            all_in.set()
        await all_in.wait()
        return {"upper": "x"}

    async with open_run(tenant, "play") as run:
        result = await run.map("t", aiter_rows(rows(4)), fn, contract=CONTRACT, concurrency=4,
                               linger_s=3600)
    assert result.completed == 4
    # All four workers are inside the user function at once, and nobody holds a permit.
    assert seen == [{lane: 0 for lane in tenant.permits()}]


async def test_the_cancellation_flush_gives_up_at_its_deadline(tenant):
    from runplane.simulations.ports import GatedPort

    port = GatedPort(tenant)
    armed = [False]
    gate = port.gate(lambda b: armed[0] and b.kind == "checkout")
    crash = trio.CancelScope()
    done = []

    async def fn(row):
        done.append(row["name"])
        if len(done) == 5:
            armed[0] = True  # from now on the store hangs at the next checkout
            crash.cancel()
        return {"upper": "x"}

    with trio.fail_after(20):
        with crash:
            async with open_run(port, "play", retire_on_exit=False) as run:
                await run.map("t", aiter_rows(rows(5)), fn, contract=CONTRACT,
                              linger_s=3600, flush_deadline_s=0.3)
    assert crash.cancelled_caught and gate.reached.is_set()  # the flush tried, then gave up
    assert await count_star(tenant) == {"pending": 5}


async def test_a_zombie_attempt_of_the_same_run_is_fenced_by_the_new_attempt(tenant):
    """Attempt a1 of a run admitted the rows and is stuck in the user function when attempt a2
    of the same run (same epoch) takes over and finishes them; a1's late outcomes must be
    fenced as superseded, never overwrite a2's."""
    run_id = new_run_id()
    release = trio.Event()
    zombie_admitted = trio.Event()
    results: list[MapResult] = []

    async def zombie_fn(row):
        await release.wait()
        return {"upper": "zombie"}

    def on_zombie_progress(snapshot):
        if snapshot.admitted == 20:
            zombie_admitted.set()

    async def zombie():
        async with open_run(tenant, "play", run_id, retire_on_exit=False,
                            attempt=sheets.Attempt("a1", 1, lease_s=0.0)) as run:
            results.append(await run.map("t", aiter_rows(rows(20)), zombie_fn,
                                         contract=CONTRACT, on_progress=on_zombie_progress))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(zombie)
        with trio.fail_after(10):
            await zombie_admitted.wait()
        wrapped, calls = counting()
        async with open_run(tenant, "play", run_id, retire_on_exit=False,
                            attempt=sheets.Attempt("a2", 2)) as run:
            taken = await run.map("t", aiter_rows(rows(20)), wrapped, contract=CONTRACT)
        assert taken.completed == 20 and len(calls) == 20
        release.set()
    (late,) = results
    assert late.fenced == 20 and late.completed == 0
    assert {row.reason for row in late.fenced_rows} == {"attempt_superseded"}
    stored = await sheet(tenant)
    assert {row["upper"] for row in stored.values()} == {f"R{i}" for i in range(20)}


async def test_a_wake_replays_the_staged_list(tenant):
    """The wake passes the same list (a different one is a ConflictError: see
    test_map_invocations); the staged pages are what runs."""
    run_id = new_run_id()

    async def hang(row):
        await trio.sleep_forever()

    def crash_when_admitted(snapshot):
        if snapshot.admitted == 1200:
            crash.cancel()

    with trio.CancelScope() as crash:
        async with open_run(tenant, "play", run_id) as run:
            # page_rows=200: no ramp of small first units, whose many small work batches
            # would fill the work channel before all 1200 hanging rows are admitted
            await run.map("t", rows(1200), hang, contract=CONTRACT, page_rows=200,
                          on_progress=crash_when_admitted)
    assert crash.cancelled_caught
    wrapped, calls = counting()
    async with open_run(tenant, "play", run_id) as woken:
        result = await woken.map("t", rows(1200), wrapped, contract=CONTRACT)
    assert result.completed == 1200 and len(calls) == 1200
    assert set(await sheet(tenant)) == {f"r{i}" for i in range(1200)}
    assert await fact_kinds(tenant, run_id) == ["array_input_guard"]


async def test_a_map_rides_through_transient_store_faults(tenant):
    """Dropped connections (before a statement, or after it applied with the reply lost) hit
    staging, admission and completion; every call is retried and the result is exact."""
    from runplane.simulations.faults import Fault, FaultPlan, FaultyPort

    # Faults spaced wider than any one call: a dropped connection every 38th store boundary,
    # and half a cycle later three lost replies in a row (a lost reply cannot apply at a
    # checkout or a BEGIN, so one of the three lands on a statement).
    def kind(i: int) -> str:
        return "unavailable" if i % 38 == 6 else "lost_reply" if i % 38 in (25, 26, 27) else "none"

    steps = [Fault(kind(i)) for i in range(400)]
    port = FaultyPort(tenant, FaultPlan(steps))
    wrapped, calls = counting()
    async with open_run(port, "play") as run:
        result = await run.map("t", rows(2500), wrapped, contract=CONTRACT, concurrency=4)
    assert port.by_kind.get("unavailable", 0) >= 1 and port.by_kind.get("lost_reply", 0) >= 1
    assert (result.admitted, result.completed, result.failed, result.fenced) == (2500, 2500, 0, 0)
    assert await count_star(tenant) == {"enriched": 2500}
    summary = await sheets.summary(tenant, run.scope.play_scope, "t")
    assert (summary.total, summary.completed) == (2500, 2500)
    assert await fact_kinds(tenant, run.run_id) == ["array_input_guard"]
