"""Completion diagnostics: a sink runs in the tenant's background task, never delaying or
changing a completion; the buffer is bounded; it is drained at close; no sink logs JSON."""

from __future__ import annotations

import json
import logging

import pytest
import trio
import trio.testing

from runplane.engine import open_tenant
from runplane.engine.diagnostics import DiagnosticsQueue
from runplane.engine.sheets import RowOutcome, SheetContract, admit, complete

from .conftest import fresh_schema
from .sheet_helpers import PLAY, new_run

CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
NS = "diag"


async def one_row(tenant, run, name="a"):
    return (await admit(tenant, run, NS, CONTRACT, [{"name": name}])).pending[0].key


async def test_a_blocked_sink_never_delays_a_completion(tenant):
    run = await new_run(tenant, PLAY, "r1")
    key = await one_row(tenant, run)
    release, started, seen = trio.Event(), trio.Event(), []

    async def stuck_sink(diagnostics):
        started.set()
        await release.wait()
        seen.append(diagnostics)

    with trio.fail_after(30):  # awaiting the sink inline would never return
        result = await complete(tenant, run, NS, CONTRACT,
                                [RowOutcome(key, "completed", {"score": 1})],
                                on_diagnostics=stuck_sink)
        assert result.committed_keys == (key,)
        await started.wait()
        assert seen == []  # the completion returned while its sink was still running
        again = await complete(tenant, run, NS, CONTRACT,
                               [RowOutcome(key, "completed", {"score": 2})],
                               on_diagnostics=stuck_sink)
        assert again.updated == 1
        release.set()
        await tenant.diagnostics.wait_idle()
    assert seen == [result.diagnostics, again.diagnostics]


async def test_a_full_buffer_drops_the_oldest_and_counts_them():
    queue = DiagnosticsQueue(capacity=3)
    release, seen = trio.Event(), []

    async def sink(item):
        await release.wait()
        seen.append(item)

    queue.open()
    queue.put(sink, 0)
    await trio.testing.wait_all_tasks_blocked()  # item 0 is in the sink, the buffer empty
    for item in range(1, 7):
        queue.put(sink, item)
    assert queue.dropped == 3  # 1, 2 and 3 made room for 4, 5 and 6
    release.set()
    await queue.wait_idle()
    assert seen == [0, 4, 5, 6] and queue.delivered == 4
    await queue.close()
    queue.put(sink, 7)  # after close: dropped, counted
    assert queue.dropped == 4 and seen == [0, 4, 5, 6]


async def test_the_buffer_is_drained_when_the_tenant_closes(dsn):
    seen = []

    def slow_plain_sink(diagnostics):
        seen.append(diagnostics.updated_rows)

    async def slow_async_sink(diagnostics):
        await trio.sleep(0.01)
        seen.append(diagnostics.updated_rows)

    schema = fresh_schema()
    async with open_tenant("org-test", dsn, schema=schema) as tenant:
        run = await new_run(tenant, PLAY, "r1")
        for i, sink in enumerate([slow_async_sink, slow_plain_sink, slow_async_sink]):
            key = await one_row(tenant, run, f"n{i}")
            await complete(tenant, run, NS, CONTRACT, [RowOutcome(key, "completed", {"score": i})],
                           on_diagnostics=sink)
        async with tenant.connection("sheet") as conn:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    assert seen == [1, 1, 1]
    assert tenant.diagnostics.dropped == 0 and tenant.diagnostics.delivered == 3


async def test_with_no_sink_each_completion_logs_one_json_line_at_debug(tenant, caplog):
    run = await new_run(tenant, PLAY, "r1")
    key = await one_row(tenant, run)
    with caplog.at_level(logging.DEBUG, logger="runplane.sheets.diagnostics"):
        result = await complete(tenant, run, NS, CONTRACT,
                                [RowOutcome(key, "completed", {"score": 1})])
    lines = [r for r in caplog.records if r.name == "runplane.sheets.diagnostics"]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG
    logged = json.loads(lines[0].getMessage())
    assert logged["outcome"] == "succeeded" and logged["updated_rows"] == 1
    assert logged["total_ms"] == result.diagnostics.total_ms


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        DiagnosticsQueue(capacity=0)
