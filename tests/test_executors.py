"""Executors: a synchronous map function in a local process pool or on a Dask cluster."""

from __future__ import annotations

import os

import pytest
import trio

from runplane.actors import DaskExecutor, ProcessExecutor, open_run
from runplane.actors.executors import outside_event_loop
from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import SheetContract

from .plays.scale_play import burn, die_on_7, hang_on_3, tag_pid
from .sheet_helpers import counters_match, play_scope, raw_rows

PLAY = "scale"
CONTRACT = SheetContract(("n",), ("pid", "double"))


async def stored(tenant, namespace: str, fields=("n", "pid", "double")):
    return await raw_rows(tenant, play_scope(tenant, PLAY), namespace, fields)


async def test_processes_executor_uses_more_than_one_process(tenant):
    rows = [{"n": i} for i in range(300)]
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            result = await run.map("burn", rows, burn, contract=SheetContract(("n",), ("pid", "burn")),
                                   executor=ProcessExecutor(max_workers=2), concurrency=4)
    assert (result.completed, result.failed) == (300, 0)
    rows_stored = await stored(tenant, "burn", ("pid",))
    pids = {row["pid"] for row in rows_stored.values()}
    assert len(pids) >= 2 and os.getpid() not in pids


async def test_a_pool_process_that_dies_fails_only_its_row(tenant):
    rows = [{"n": i} for i in range(20)]
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            result = await run.map("die", rows, die_on_7, contract=CONTRACT,
                                   executor="processes", concurrency=2)
    assert (result.completed, result.failed) == (19, 1)
    by_n = {row["n"]: row for row in (await stored(tenant, "die")).values()}
    assert by_n[7]["_status"] == "failed"
    assert "pool process" in by_n[7]["_error"] and "exit code 3" in by_n[7]["_error"]
    assert all(by_n[n]["_status"] == "enriched" for n in range(20) if n != 7)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "die")
    assert ok, why


async def test_a_row_timeout_kills_the_call(tenant):
    rows = [{"n": i} for i in range(6)]
    with trio.fail_after(60):  # the hanging call sleeps 600 s: only killing it ends the map
        async with open_run(tenant, PLAY) as run:
            result = await run.map("hang", rows, hang_on_3, contract=CONTRACT,
                                   executor="processes", row_timeout_s=2.0, concurrency=2)
    assert (result.completed, result.failed, result.timed_out) == (5, 1, 1)
    by_n = {row["n"]: row for row in (await stored(tenant, "hang")).values()}
    assert by_n[3]["_error"] == "timed out after 2 s"


async def test_an_async_function_or_a_bad_executor_is_refused(tenant):
    async with open_run(tenant, PLAY) as run:
        with pytest.raises(InvalidInputError, match="synchronous"):
            await run.map("x", [{"n": 1}], tag_pid, contract=CONTRACT, executor="processes")
        with pytest.raises(InvalidInputError, match="executor must be"):
            await run.map("x", [{"n": 1}], burn, contract=CONTRACT, executor="threads")
        with pytest.raises(InvalidInputError, match="max_workers"):
            ProcessExecutor(max_workers=0)


async def test_shared_map_workers_run_the_function_in_their_own_pools(tenant):
    rows = [{"n": i} for i in range(600)]
    with trio.fail_after(180):
        async with open_run(tenant, PLAY) as run:
            result = await run.map("burn", rows, burn,
                                   contract=SheetContract(("n",), ("pid", "burn")),
                                   executor=ProcessExecutor(max_workers=1), workers=1)
    assert (result.completed, result.failed) == (600, 0)
    pids = {row["pid"] for row in (await stored(tenant, "burn", ("pid",))).values()}
    assert len(pids) == 1 and os.getpid() not in pids


async def test_dask_executor_on_a_local_cluster(tenant):
    import distributed

    def start():
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                           dashboard_address=None)
        return cluster, distributed.Client(cluster)

    cluster, client = await trio.to_thread.run_sync(outside_event_loop, start)
    try:
        rows = [{"n": i} for i in range(60)]
        with trio.fail_after(120):
            async with open_run(tenant, PLAY) as run:
                result = await run.map("dask", rows, burn,
                                       contract=SheetContract(("n",), ("pid", "burn")),
                                       executor=DaskExecutor(client), concurrency=4)
        assert (result.completed, result.failed) == (60, 0)
        pids = {row["pid"] for row in (await stored(tenant, "dask", ("pid",))).values()}
        worker_pids = set((await trio.to_thread.run_sync(
            outside_event_loop, lambda: client.run(os.getpid))).values())
        assert pids <= worker_pids and os.getpid() not in pids
        ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "dask")
        assert ok, why
    finally:
        await trio.to_thread.run_sync(outside_event_loop, client.close)
        await trio.to_thread.run_sync(outside_event_loop, cluster.close)
