"""Row policies of run.map: retries, timeouts, rate limits, giving up, superseded runs.

Every assertion is timing-independent: exact call counts, events that force the races, and
bounds that slowness can only make easier to meet.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest
import trio
import trio.testing

from runplane.actors import MapResult, RateLimit, RowRetry, open_run
from runplane.actors.admission import MAX_WORK_BATCH
from runplane.actors.pacing import LocalBucket
from runplane.engine import sheets
from runplane.engine.errors import InvalidInputError
from runplane.engine.values.scopes import PlayScope
from runplane.simulations.counters import counters_match

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))
NOW = RowRetry(max_attempts=3, initial_s=0.0, jitter=False)  # retries at once


def rows(n: int, tag: str = "r") -> list[dict]:
    return [{"name": f"{tag}{i}"} for i in range(n)]


async def aiter_rows(items):
    for item in items:
        yield item
        await trio.lowlevel.checkpoint()


async def stored(tenant, play="play", table="t") -> dict[str, dict]:
    found = await sheets.read_rows(tenant, PlayScope(tenant.org_id, play), table, limit=100_000)
    return {row["name"]: row for row in found}


class Flaky(Exception):
    pass


class Fatal(Exception):
    pass


async def test_retries_turn_transient_failures_into_completions_with_exact_calls(tenant):
    calls: collections.Counter = collections.Counter()

    async def fn(row):
        i = int(row["name"][1:])
        calls[i] += 1
        if i % 10 == 1 and calls[i] < 3:        # succeeds on its third call
            raise Flaky(f"flaky call {calls[i]}")
        if i % 10 == 2:                          # never succeeds
            raise Flaky(f"still down, call {calls[i]}")
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(100), fn, contract=CONTRACT, concurrency=5, retry=NOW)
    assert (result.completed, result.failed) == (90, 10)
    assert result.retried == 10 * 2 + 10 * 2 and result.timed_out == 0
    assert not result.superseded
    assert {i: n for i, n in calls.items() if n != 1} == {
        i: 3 for i in range(100) if i % 10 in (1, 2)}
    sheet = await stored(tenant)
    assert sheet["r11"]["_status"] == "enriched" and sheet["r11"]["_attempts"] == 3
    assert sheet["r12"]["_error"] == "still down, call 3"  # only the last error is kept
    assert sheet["r12"]["_attempts"] == 3 and sheet["r3"]["_attempts"] == 1

    # A second run calls the failed rows again (three more calls each): `_attempts` adds up.
    async with open_run(tenant, "play") as again:
        result = await again.map("t", rows(100), fn, contract=CONTRACT, retry=NOW)
    assert (result.cached, result.failed, result.retried) == (90, 10, 20)
    assert (await stored(tenant))["r12"]["_attempts"] == 6
    ok, detail = await counters_match(tenant, PlayScope(tenant.org_id, "play"), "t")
    assert ok, detail


async def test_give_up_on_and_retry_on_choose_what_is_retried(tenant):
    calls: collections.Counter = collections.Counter()

    async def fn(row):
        calls[row["name"]] += 1
        raise {"r0": Flaky, "r1": Fatal, "r2": KeyError}[row["name"]]("boom")

    policy = RowRetry(max_attempts=4, initial_s=0.0, retry_on=(Flaky, Fatal), give_up_on=Fatal)
    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(3), fn, contract=CONTRACT, retry=policy)
    assert dict(calls) == {"r0": 4, "r1": 1, "r2": 1}
    assert (result.failed, result.retried) == (3, 3)


async def test_a_timeout_cancels_a_call_that_would_sleep_forever(tenant):
    calls: collections.Counter = collections.Counter()

    async def fn(row):
        calls[row["name"]] += 1
        if row["name"] == "r0":
            await trio.sleep_forever()
        return {"upper": "x"}  # returns without a checkpoint: can never time out

    async with open_run(tenant, "play") as run:
        with trio.fail_after(60):
            result = await run.map("t", rows(20), fn, contract=CONTRACT, row_timeout_s=0.05,
                                   retry=RowRetry(max_attempts=2, initial_s=0.0))
    assert calls["r0"] == 2 and set(calls.values()) == {1, 2}
    assert (result.completed, result.failed, result.timed_out, result.retried) == (19, 1, 2, 1)
    row = (await stored(tenant))["r0"]
    assert (row["_status"], row["_error"], row["_attempts"]) == (
        "failed", "timed out after 0.05 s", 2)


async def test_a_row_in_a_long_backoff_does_not_stall_the_map(tenant):
    """One worker only: if the row waiting out its hour-long backoff held it, nothing else
    could run. The other 1,000 rows complete while it waits; then the map is cancelled."""
    calls: collections.Counter = collections.Counter()

    async def fn(row):
        calls[row["name"]] += 1
        if row["name"] == "r0":
            raise Flaky("try again in an hour")
        return {"upper": "x"}

    def on_progress(snapshot):
        if snapshot.completed == 1000:
            stop.cancel()

    with trio.CancelScope() as stop:
        async with open_run(tenant, "play", retire_on_exit=False) as run:
            with trio.fail_after(120):
                await run.map("t", aiter_rows(rows(1001)), fn, contract=CONTRACT, concurrency=1,
                              retry=RowRetry(max_attempts=2, initial_s=3600, jitter=False),
                              on_progress=on_progress)
    assert stop.cancelled_caught
    assert calls["r0"] == 1 and len(calls) == 1001
    statuses = collections.Counter(row["_status"] for row in (await stored(tenant)).values())
    assert statuses == {"enriched": 1000, "pending": 1}


async def test_the_delay_queue_is_bounded_by_the_admission_window_not_the_input(tenant):
    """Every row's first call fails and waits an hour. Admission stops handing rows out once
    `max_waiting_rows` rows wait, so the queue holds at most that plus the admission window
    (rows in the work channel and in the workers' hands), and admission reads at most a page
    more: far from the whole 5,000-row input. Once the map is idle, it is cancelled."""
    concurrency, limit, page_rows, total = 2, 50, 100, 5000
    window = 3 * concurrency * MAX_WORK_BATCH
    snapshots = []
    full = trio.Event()

    async def fn(row):
        raise Flaky("try again in an hour")

    def on_progress(snapshot):
        snapshots.append(snapshot)
        if snapshot.waiting >= limit:
            full.set()

    async with open_run(tenant, "play", retire_on_exit=False) as run:
        async def watch(cancel_scope):
            await full.wait()
            await trio.testing.wait_all_tasks_blocked(cushion=0.2)  # the map is parked
            cancel_scope.cancel()

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope)
                await run.map("t", aiter_rows(rows(total)), fn, contract=CONTRACT,
                              concurrency=concurrency, page_rows=page_rows,
                              max_waiting_rows=limit, on_progress=on_progress,
                              retry=RowRetry(max_attempts=2, initial_s=3600, jitter=False))
    assert full.is_set()
    assert max(s.waiting for s in snapshots) <= limit + window
    assert snapshots[-1].source_rows <= limit + window + 2 * page_rows < total
    assert all(s.completed == s.failed == 0 for s in snapshots)


async def test_give_up_after_blocks_a_row_that_failed_in_that_many_runs(tenant):
    calls: collections.Counter = collections.Counter()

    async def fn(row):
        calls[row["name"]] += 1
        if row["name"] == "r0":
            raise Fatal("never works")
        return {"upper": "x"}

    results: list[MapResult] = []
    for _ in range(3):
        async with open_run(tenant, "play") as run:
            results.append(await run.map("t", rows(3), fn, contract=CONTRACT, give_up_after=2,
                                         retry=RowRetry(max_attempts=2, initial_s=0.0)))
    assert calls == {"r0": 4, "r1": 1, "r2": 1}  # two runs of two calls each, then no more
    assert [(r.failed, r.blocked) for r in results] == [(1, 0), (1, 0), (0, 1)]
    assert [(b.key, b.reason) for b in results[2].blocked_rows] == [
        (sheets.row_key({"name": "r0"}, "t"), "gave_up")]
    row = (await stored(tenant))["r0"]
    assert (row["_failed_runs"], row["_attempts"], row["_status"]) == (2, 4, "failed")
    async with open_run(tenant, "play") as run:  # raising the limit lets it run again
        result = await run.map("t", rows(3), fn, contract=CONTRACT, give_up_after=3)
    assert result.failed == 1 and calls["r0"] == 5


async def test_the_local_rate_limit_spaces_calls(tenant):
    starts: list[float] = []

    async def fn(row):
        starts.append(trio.current_time())
        return {"upper": "x"}

    limit = RateLimit(per_second=40, burst=5)
    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(30), fn, contract=CONTRACT, concurrency=8,
                               rate_limit=limit)
    assert result.completed == 30
    first = starts[0]
    for k, started in enumerate(starts):  # the k-th call waits for its token, at least
        assert started - first >= (k - 5 + 1) / 40 - 1e-6


def test_the_local_bucket_issues_tokens_exactly_on_time():
    clock = trio.testing.MockClock(autojump_threshold=0)
    times: list[float] = []

    async def main():
        bucket = LocalBucket(per_second=10.0, capacity=3.0)

        async def taker():
            for _ in range(4):
                await bucket.take()
                times.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(taker)

    trio.run(main, clock=clock)
    assert times == pytest.approx([0, 0, 0] + [0.1 * k for k in range(1, 10)])


@pytest.mark.parametrize("kwargs, field", [
    ({"max_attempts": 0}, "max_attempts"), ({"initial_s": -1}, "initial_s"),
    ({"backoff": 0.5}, "backoff"), ({"retry_on": ValueError()}, "retry_on"),
    ({"jitter": 1}, "jitter"),
])
def test_a_bad_retry_policy_is_refused(kwargs, field):
    with pytest.raises((InvalidInputError, TypeError), match=field):
        RowRetry(**kwargs)


def test_backoff_is_capped_and_jittered_within_it():
    policy = RowRetry(initial_s=0.5, backoff=2.0, max_interval_s=30.0, jitter=False)
    assert [policy.delay_s(n) for n in (1, 2, 3, 7, 8, 5000)] == [0.5, 1, 2, 30, 30, 30]
    jittered = RowRetry(initial_s=0.5, backoff=2.0, max_interval_s=30.0)
    assert all(0 <= jittered.delay_s(3) <= 2 for _ in range(200))


@pytest.mark.parametrize("kwargs", [
    {"per_second": 0}, {"per_second": float("inf")}, {"per_second": 5, "burst": 0.5},
    {"per_second": 5, "key": ""}, {"per_second": 5, "key": "a\x00b"},
])
def test_a_bad_rate_limit_is_refused(kwargs):
    with pytest.raises(InvalidInputError):
        RateLimit(**kwargs)


async def test_bad_policies_raise_before_any_query(tenant):
    async def fn(row):
        return {}

    async with open_run(tenant, "play", retire_on_exit=False) as run:
        for bad in ({"retry": 3}, {"row_timeout_s": 0}, {"rate_limit": 5},
                    {"give_up_after": 0}):
            with pytest.raises(InvalidInputError, match=next(iter(bad))):
                await run.map("t", rows(2), fn, contract=CONTRACT, **bad)
    assert await stored(tenant) == {}


SHARED_CHILD = r"""
import json, sys, time
import trio
from runplane.actors import RateLimit, open_run
from runplane.engine import open_tenant, sheets

dsn, schema, tag, calls, per_second, burst = sys.argv[1:7]

async def main():
    starts = []
    async def fn(row):
        starts.append(time.time())
        return {"upper": "x"}
    async with open_tenant("org-test", dsn, schema=schema) as tenant:
        async with open_run(tenant, "play") as run:
            began = time.time()
            result = await run.map(
                "t", [{"name": f"{tag}{i}"} for i in range(int(calls))], fn,
                contract=sheets.SheetContract(inputs=("name",), outputs=("upper",)),
                rate_limit=RateLimit(float(per_second), burst=float(burst), key="shared-tool"))
    print(json.dumps({"began": began, "starts": starts, "completed": result.completed}))

trio.run(main)
"""


async def test_a_keyed_rate_limit_holds_across_two_processes(tenant, tmp_path):
    """Two processes share one key: however the OS schedules them, the calls started by any
    moment never exceed what the bucket could have issued by then (its burst plus the rate
    times the time since the first lease), plus one lease batch per process."""
    per_second, burst, calls = 50.0, 10.0, 40
    limit = RateLimit(per_second, burst=burst, key="shared-tool")
    script = tmp_path / "child.py"
    script.write_text(SHARED_CHILD)
    args = [sys.executable, str(script), tenant.dsn, tenant.schema]
    children = [await trio.lowlevel.open_process(
        [*args, tag, str(calls), str(per_second), str(burst)], stdout=subprocess.PIPE)
        for tag in ("a", "b")]
    outputs = []
    with trio.fail_after(120):
        for child in children:
            outputs.append(await _read_all(child))
            assert await child.wait() == 0
    assert [out["completed"] for out in outputs] == [calls, calls]
    began = min(out["began"] for out in outputs)
    starts = sorted(t for out in outputs for t in out["starts"])
    slack = 2 * limit.lease_size
    for k, started in enumerate(starts, start=1):
        assert k <= burst + per_second * (started - began) + slack, (k, started - began)
    sheet = await stored(tenant)
    assert len(sheet) == 2 * calls


async def _read_all(child) -> dict:
    chunks = []
    while True:
        chunk = await child.stdout.receive_some(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return json.loads(b"".join(chunks))


async def test_an_older_run_stops_when_a_newer_one_takes_its_rows(tenant):
    """Forced race: the older run admits 400 rows, 40 workers take 10-row batches and their
    calls wait; a newer run of the play takes every row and finishes them. Then the older run's
    first batch (rows 0-9) completes and comes back fenced as `stale_write_version`, while the
    other 39 workers are inside a call. From then on the older map may start at most
    `concurrency + one worker batch` calls (were it not to stop, its workers would call the 351
    rows left in their batches), returns `superseded`, and leaves the sheet to the newer run."""
    concurrency, total = 40, 400
    go, fenced_seen, old_admitted = trio.Event(), trio.Event(), trio.Event()
    old_calls = [0]
    calls_at_fence: list[int] = []

    async def old_fn(row):
        old_calls[0] += 1
        await go.wait()
        if int(row["name"][1:]) >= 10:
            await fenced_seen.wait()  # in progress when the fence comes back
        return {"upper": "old"}

    def on_old_progress(snapshot):
        if snapshot.admitted == total:
            old_admitted.set()
        if snapshot.superseded and not fenced_seen.is_set():
            calls_at_fence.append(old_calls[0])
            fenced_seen.set()

    async def new_fn(row):
        return {"upper": row["name"].upper()}

    results: dict[str, MapResult] = {}
    async with trio.open_nursery() as nursery:
        async with open_run(tenant, "play", retire_on_exit=False) as old:
            async def old_map():
                results["old"] = await old.map(
                    "t", rows(total), old_fn, contract=CONTRACT, concurrency=concurrency,
                    batch_rows=10, on_progress=on_old_progress)

            old.start_soon(old_map)
            with trio.fail_after(30):
                await old_admitted.wait()
            async with open_run(tenant, "play") as newer:
                results["new"] = await newer.map("t", rows(total), new_fn, contract=CONTRACT)
            go.set()
        nursery.cancel_scope.cancel()
    old_result, new_result = results["old"], results["new"]
    assert new_result.completed == total and not new_result.superseded
    assert old_result.superseded and old_result.superseded_by == newer.run_id
    assert old_result.completed == 0 and old_result.fenced >= 10
    assert {row.reason for row in old_result.fenced_rows} == {"stale_write_version"}
    (at_fence,) = calls_at_fence
    # Rows 0-9 finished and every other worker is inside one call; the workers that ran rows
    # 0-9 are too if their batches held more rows (a list's first units are small, so its
    # batches are: one worker batch per worker when the 400 rows were one unit).
    assert 10 + concurrency - 1 <= at_fence <= 10 + concurrency
    assert old_calls[0] - at_fence <= concurrency + MAX_WORK_BATCH
    sheet = await stored(tenant)
    assert len(sheet) == total and {row["_status"] for row in sheet.values()} == {"enriched"}
    assert all(row["upper"] == name.upper() for name, row in sheet.items())
    ok, detail = await counters_match(tenant, PlayScope(tenant.org_id, "play"), "t")
    assert ok, detail
