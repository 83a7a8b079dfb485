"""Force, reuse, write modes and receipt batches through a gateway answer as direct calls do."""

from __future__ import annotations

import collections

from runplane.actors import open_run
from runplane.engine import receipts, sheets

from .gateway_support import gateway, server  # noqa: F401
from .sheet_helpers import counters_match, play_scope

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("score",))
NS = "through"


async def test_force_reuse_and_write_modes_through_a_gateway(tenant, gateway):
    calls: collections.Counter = collections.Counter()

    async def fn(row):
        calls[row["name"]] += 1
        return {"score": 1}

    rows = [{"name": f"n{i}"} for i in range(200)]
    async with open_run(gateway, "play", "first") as run:
        await run.map(NS, rows, fn, contract=CONTRACT)
    async with open_run(gateway, "play", "second") as run:
        assert (await run.map(NS, rows, fn, contract=CONTRACT)).cached == 200
        found = await sheets.read_rows(gateway, run.scope.play_scope, NS, run_id="second")
        assert len(found) == 200  # the rows it reused
    async with open_run(gateway, "play", "third", force=True) as run:
        assert (await run.map(NS, rows, fn, contract=CONTRACT)).completed == 200
        appended = await sheets.append_rows(gateway, run.ref, NS, CONTRACT, rows[:2],
                                            idempotency_key="k")
        assert [r.input_index for r in appended.pending] == [200, 201]
        claimed = await receipts.claim(gateway, run.ref, "r", lease_s=30)
        assert claimed.disposition == "claimed"
        assert await receipts.release(gateway, run.ref, ["r"]) == ["r"]
        done = await receipts.complete_many(gateway, run.ref, {"r": 1, "s": 2})
        assert {k: r.output for k, r in done.items()} == {"r": 1, "s": 2}
    assert set(calls.values()) == {2}
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail
    async with open_run(gateway, "play", "fourth") as run:
        replaced = await sheets.replace_rows(gateway, run.ref, NS, CONTRACT, rows[:3])
        assert replaced.inserted == 3
    assert (await sheets.summary(tenant, play_scope(tenant), NS)).total == 3


async def test_a_blocked_sink_never_delays_a_completion_through_a_gateway(tenant, gateway):
    import trio

    run = await sheets_run(gateway, tenant)
    key = (await sheets.admit(gateway, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    release, started, seen = trio.Event(), trio.Event(), []

    async def stuck_sink(diagnostics):
        started.set()
        await release.wait()
        seen.append(diagnostics)

    with trio.fail_after(30):  # awaiting the sink inline would never return
        done = await sheets.complete(gateway, run, NS, CONTRACT,
                                     [sheets.RowOutcome(key, "completed", {"score": 1})],
                                     on_diagnostics=stuck_sink)
        assert done.committed_keys == (key,)
        await started.wait()
        assert seen == []  # the completion returned while its sink was still running
        release.set()
        await gateway.diagnostics.wait_idle()
    assert len(seen) == 1 and seen[0].input_rows == 1


async def sheets_run(gateway, tenant):
    from runplane.engine import runs
    from runplane.engine.values.scopes import RunScope

    return await runs.register(gateway, RunScope(tenant.org_id, "play", "diag"))


async def test_a_failed_outcome_with_a_lone_surrogate_travels_normalized(tenant, gateway):
    run = await sheets_run(gateway, tenant)
    key = (await sheets.admit(gateway, run, NS, CONTRACT, [{"name": "s"}])).pending[0].key
    done = await sheets.complete(gateway, run, NS, CONTRACT,
                                 [sheets.RowOutcome(key, "failed", error="bad \ud800 byte")])
    assert done.committed_keys == (key,)
    direct = await sheets.read_rows(tenant, play_scope(tenant), NS)
    assert [r["_error"] for r in direct if r["_key"] == key] == ["bad \ufffd byte"]
