"""A run's timeline on its page: registered, maps started and ended (with their retries and units
claimed again), cancellation, the run's end, in time order, from what the store keeps."""

from __future__ import annotations

import json

from runplane.actors import RowRetry, open_run
from runplane.engine import runs
from runplane.engine.console.timeline import EventKind, run_timeline
from runplane.engine.gateway import mint_token
from runplane.engine.runs.cancel import request_cancel
from runplane.engine.values.scopes import RunScope

from .console_support import CONTRACT, SECRET, client, login_token
from .gateway_support import serving


async def test_a_finished_runs_timeline_with_its_retries(tenant):
    raised: set[str] = set()

    async def flaky(row: dict) -> dict:
        if row["name"] not in raised:
            raised.add(row["name"])
            raise ValueError("once")
        return {"upper": row["name"].upper()}

    retry = RowRetry(max_attempts=3, initial_s=0.0, jitter=False)
    async with open_run(tenant, "p") as run:
        await run.map("t", [{"name": f"n{i}"} for i in range(4)], flaky, contract=CONTRACT,
                      retry=retry)
        await run.map("u", [{"name": "x"}], flaky, contract=CONTRACT, retry=retry)
    events = await run_timeline(tenant, tenant.org_id, "p", run.run_id)
    assert [(e.kind, e.table) for e in events] == [
        (EventKind.REGISTERED, None), (EventKind.MAP_STARTED, "t"), (EventKind.MAP_ENDED, "t"),
        (EventKind.MAP_STARTED, "u"), (EventKind.MAP_ENDED, "u"), (EventKind.RUN_ENDED, None)]
    assert [e.at for e in events] == sorted(e.at for e in events)
    assert events[2].text == ("map of t finished: 4 completed, 0 failed, 0 cached; "
                              "4 calls retried")
    assert events[-1].text in ("run ended (retiring)", "run ended (done)")
    async with serving(tenant) as server, client(server.url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        page = (await http.get(f"/ui/runs/p/{run.run_id}")).text
        assert 'id="timeline"' in page and "4 calls retried" in page
        assert page.index('data-event="registered"') < page.index('data-event="run_ended"')
        api = (await http.get(f"/ui/api/runs/p/{run.run_id}")).json()
        assert [e["event"] for e in api["timeline"]] == [e.kind.value for e in events]
        json.dumps(api)


async def test_cancellation_and_units_claimed_again(tenant):
    scope = RunScope(tenant.org_id, "p", "run-cancelled")
    await runs.register(tenant, scope)
    await request_cancel(tenant, scope)
    # a shared map whose units were claimed again (a lease taken over), as its tables hold it
    s = f'"{tenant.schema}"'
    async with tenant.connection("sheet") as conn:
        await conn.execute(
            f"INSERT INTO {s}.run_maps (org_id, play, run_id, map_key, table_namespace, state,"
            " started_at, ended_at, completed, stop_reason) VALUES ($1, 'p', $2, 'map-0', 't',"
            " 'stopped_early', now() + interval '1 second', now() + interval '3 seconds', 7,"
            " 'cancelled')", tenant.org_id, scope.run_id)
        await conn.execute(
            f"INSERT INTO {s}.shared_maps (org_id, play, run_id, map_invocation_id, epoch,"
            " table_namespace, config, function, play_digest, units, lease_s) VALUES"
            " ($1, 'p', $2, 'map-0', 1, 't', '{}', 'f', 'd', 3, 30)", tenant.org_id, scope.run_id)
        await conn.execute(
            f"INSERT INTO {s}.shared_units (org_id, play, run_id, map_invocation_id, unit, page,"
            " low, row_count, claims) SELECT $1, 'p', $2, 'map-0', u, 0, 0, 1, c FROM"
            " unnest(ARRAY[0, 1, 2], ARRAY[1, 3, 2]) AS x(u, c)", tenant.org_id, scope.run_id)
    events = await run_timeline(tenant, tenant.org_id, "p", scope.run_id)
    kinds = [e.kind for e in events]
    assert kinds[0] is EventKind.REGISTERED and EventKind.CANCEL_REQUESTED in kinds
    assert kinds[-2:] == [EventKind.MAP_STARTED, EventKind.MAP_ENDED]
    assert events[-1].text == ("map of t stopped early (cancelled): 7 completed, 0 failed, "
                               "0 cached; 3 units claimed again (leases taken over or released)")
    assert EventKind.PUBLISHED in kinds
    assert await run_timeline(tenant, tenant.org_id, "p", "no-such-run") == []


async def test_an_outage_the_run_rode_out_is_on_its_timeline(tenant):
    """The database goes away for a second mid-map (a real proxy: a statement in flight is
    severed and connects hang until the proxy lets them through) and comes back: the run rides
    it out, and its timeline shows the wait between the map's start and end, with how long it
    lasted. The map's later rows wait until the severed call has recovered, so the outage has
    ended (and is written with the map's next history write) before the map ends."""
    import trio

    from runplane.actors.retry import retry_transient
    from runplane.engine import open_tenant

    from .conftest import fresh_schema
    from .pg_proxy import open_pg_proxy

    async with open_pg_proxy(tenant.dsn) as proxy:
        async with open_tenant("org-outage", proxy.dsn, schema=fresh_schema(),
                               outage_budget_s=30) as proxied:
            halfway, recovered = trio.Event(), trio.Event()
            attempts = []

            async def slow(row: dict) -> dict:
                if row["n"] >= 100:
                    halfway.set()
                if row["n"] >= 200:
                    await recovered.wait()
                await trio.sleep(0.001)
                return {"upper": row["name"].upper()}

            async def in_flight() -> None:  # the first attempt is severed mid-statement
                attempts.append(1)
                async with proxied.connection("receipts") as conn:
                    await conn.execute("SELECT pg_sleep($1)", 5.0 if len(attempts) == 1 else 0)

            async def outage() -> None:
                await halfway.wait()
                async with trio.open_nursery() as nursery:
                    async def call() -> None:
                        await retry_transient(in_flight)  # with the run's outage watch
                        recovered.set()
                    nursery.start_soon(call)
                    await trio.sleep(0.2)
                    proxy.set_blackhole(True, sever=True)
                    await trio.sleep(1.0)
                    proxy.set_blackhole(False)

            async with open_run(proxied, "p") as run, trio.open_nursery() as nursery:
                nursery.start_soon(outage)
                result = await run.map("t", [{"name": f"n{i}", "n": i} for i in range(600)],
                                       slow, contract=CONTRACT, concurrency=4)
            assert result.completed == 600, result
            assert run.outage.outages >= 1 and len(attempts) >= 2
            events = await run_timeline(proxied, proxied.org_id, "p", run.run_id)
    kinds = [e.kind for e in events]
    assert EventKind.OUTAGE in kinds, kinds
    outage_event = events[kinds.index(EventKind.OUTAGE)]
    assert kinds.index(EventKind.MAP_STARTED) < kinds.index(EventKind.OUTAGE) \
        < kinds.index(EventKind.MAP_ENDED)
    seconds = float(outage_event.text.split("waited ")[1].split(" s")[0])
    assert 0.5 <= seconds <= 30, outage_event.text
