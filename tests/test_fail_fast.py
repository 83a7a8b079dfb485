"""Plain functions run in threads; a map whose first rows all fail for one cause stops early."""

from __future__ import annotations

import collections
import threading
import time

import pytest

from runplane.actors import open_run
from runplane.actors.row_functions import FailFast, as_row_caller, is_async_function
from runplane.engine import sheets
from runplane.engine.errors import InvalidInputError
from runplane.engine.values.scopes import PlayScope

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))


def rows(n: int) -> list[dict]:
    return [{"name": f"r{i}"} for i in range(n)]


async def statuses(tenant) -> collections.Counter:
    found = await sheets.read_rows(tenant, PlayScope(tenant.org_id, "play"), "t", limit=10_000)
    return collections.Counter(row["_status"] for row in found)


def test_what_counts_as_an_async_function():
    import functools

    async def coro(row):
        return row

    class Tool:
        async def __call__(self, row):
            return row

    assert is_async_function(coro) and is_async_function(Tool())
    assert is_async_function(functools.partial(coro))
    assert not is_async_function(lambda row: row) and not is_async_function(len)
    assert as_row_caller(coro, 4) is coro
    assert getattr(as_row_caller(lambda row: row, 4), "runs_in_thread", False)


def test_the_fail_fast_watch():
    watch = FailFast(3)
    assert [watch.observe("TypeError", "x") for _ in range(3)] == [False, False, True]
    assert watch.tripped and "the first 3 rows all failed with TypeError" in watch.reason()
    mixed = FailFast(3)
    for cause in ("TypeError", "ValueError", "TypeError", "TypeError", "TypeError"):
        mixed.observe(cause, None)
    assert not mixed.tripped  # two causes disarm it
    one_ok = FailFast(2)
    for cause in ("TypeError", None, "TypeError", "TypeError"):
        one_ok.observe(cause, None)
    assert not one_ok.tripped  # a completed row disarms it


async def test_a_plain_function_runs_in_worker_threads(tenant):
    main_thread = threading.get_ident()
    threads: set[int] = set()

    def blocking(row):  # a plain def that blocks, as a requests-based function would
        threads.add(threading.get_ident())
        time.sleep(0.001)
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(40), blocking, contract=CONTRACT, concurrency=4)
    assert (result.completed, result.failed) == (40, 0)
    assert threads and main_thread not in threads
    assert await statuses(tenant) == {"enriched": 40}


async def test_a_plain_function_returning_a_coroutine_has_it_awaited(tenant):
    async def enrich(row, suffix):
        return {"upper": row["name"].upper() + suffix}

    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(5), lambda row: enrich(row, "!"), contract=CONTRACT)
    assert (result.completed, result.failed) == (5, 0)


@pytest.mark.parametrize("broken", ["raises", "returns a string"])
async def test_a_function_broken_for_every_row_stops_the_map_early(tenant, broken):
    calls = 0

    async def fn(row):
        nonlocal calls
        calls += 1
        if broken == "raises":
            raise TypeError(f"unsupported operand for {row['name']}")
        return "oops"

    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(500), fn, contract=CONTRACT, concurrency=4)
    assert result.stopped_early and not result.superseded
    cause = "TypeError" if broken == "raises" else "map function returned str"
    assert result.stop_reason.startswith(f"the first 20 rows all failed with {cause}")
    assert 20 <= calls < 100 and result.failed == calls
    assert run.stopped_early_maps == [("t", result)]
    left = await statuses(tenant)
    assert left["failed"] == calls and left["enriched"] == 0
    assert left["failed"] + left["pending"] <= 500  # the rest never ran


async def test_fail_fast_off_runs_every_row_and_one_good_row_disarms_it(tenant):
    async def always(row):
        raise TypeError("broken")

    async with open_run(tenant, "play") as run:
        result = await run.map("t", rows(60), always, contract=CONTRACT, fail_fast=False)
    assert (result.failed, result.stopped_early) == (60, False)

    async def first_works(row):
        if row["name"] == "r0":
            return {"upper": "R0"}
        raise TypeError("broken")

    async with open_run(tenant, "play2") as run:
        result = await run.map("t", rows(60), first_works, contract=CONTRACT, concurrency=1,
                               fail_fast=5)
    assert (result.completed, result.failed, result.stopped_early) == (1, 59, False)


async def test_a_bad_fail_fast_is_refused_before_any_query(tenant):
    async with open_run(tenant, "play") as run:
        with pytest.raises(InvalidInputError, match="fail_fast"):
            await run.map("t", rows(3), lambda row: {}, contract=CONTRACT, fail_fast=0)


async def test_a_rerun_of_rows_that_failed_before_is_not_stopped(tenant):
    async def fails_on_odd(row):
        if int(row["name"][1:]) % 2:
            raise ValueError(f"no data for {row['name']}")
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play") as run:
        first = await run.map("t", rows(100), fails_on_odd, contract=CONTRACT, concurrency=2)
    assert (first.completed, first.failed, first.stopped_early) == (50, 50, False)
    async with open_run(tenant, "play") as run:  # only the 50 failed rows run, and fail again
        again = await run.map("t", rows(100), fails_on_odd, contract=CONTRACT, concurrency=2)
    assert (again.cached, again.failed, again.stopped_early) == (50, 50, False)


async def test_a_rerun_with_the_function_still_broken_stops_again(tenant):
    calls = 0

    async def broken(row):
        nonlocal calls
        calls += 1
        raise TypeError("still broken")

    for _ in range(2):
        calls = 0
        async with open_run(tenant, "play") as run:
            result = await run.map("t", rows(300), broken, contract=CONTRACT, concurrency=2)
        assert result.stopped_early and calls < 100  # the failed rows admitted again trip it too

