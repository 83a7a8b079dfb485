"""The console's actions (SPEC §32, §35): cancel a run from its page — a POST carrying the
session's form token, allowed by the token's `runs.cancel` claim, for the viewer's own runs
only; refused before anything is written otherwise."""

from __future__ import annotations

import re

import trio

from runplane.actors import open_run
from runplane.actors.cancellation import CANCELLED
from runplane.engine import open_tenant, sheets
from runplane.engine.console import open_console
from runplane.engine.console.auth import CONSOLE_ACTIONS, COOKIE
from runplane.engine.gateway import mint_token
from runplane.engine.runs.cancel import cancel_requested

from .console_support import OTHER_ORG, SECRET, client, login_token
from .gateway_support import serving

CONTRACT = sheets.SheetContract(inputs=("n",), outputs=("double",))
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def slow_map_until(run, started: trio.Event, rows: int = 5_000):
    done = 0

    async def double(row: dict) -> dict:
        nonlocal done
        await trio.sleep(0.005)
        done += 1
        if done >= 20:
            started.set()
        return {"double": row["n"] * 2}

    return await run.map("things", [{"n": i} for i in range(rows)], double, contract=CONTRACT,
                         concurrency=4)


async def test_cancel_from_the_run_page_stops_the_running_map(tenant):
    token = mint_token(SECRET, tenant.org_id, actions=(*CONSOLE_ACTIONS, "runs.cancel"))
    async with serving(tenant) as server, client(server.url) as http, \
            open_run(tenant, "alpha") as run:
        assert (await login_token(http, token)).status_code == 303
        started = trio.Event()
        async with trio.open_nursery() as nursery:
            outcome = {}

            async def mapping() -> None:
                outcome["result"] = await slow_map_until(run, started)
            nursery.start_soon(mapping)
            await started.wait()
            page = await http.get(f"/ui/runs/alpha/{run.run_id}")
            assert page.status_code == 200 and "Cancel run" in page.text
            csrf = CSRF.search(page.text).group(1)
            path = f"/ui/runs/alpha/{run.run_id}/cancel"
            # without the form token, or with another one: refused, nothing stamped
            assert (await http.post(path, data={})).status_code == 403
            assert (await http.post(path, data={"csrf": "x" * len(csrf)})).status_code == 403
            assert not await cancel_requested(tenant, run.scope)
            done = await http.post(path, data={"csrf": csrf})
            assert done.status_code == 303
            assert done.headers["location"] == f"/ui/runs/alpha/{run.run_id}?done=requested"
            shown = await http.get(done.headers["location"])
            assert "Cancellation requested" in shown.text
        result = outcome["result"]
    assert run.cancelled and result.stopped_early and result.stop_reason == CANCELLED
    assert result.completed < 5_000


async def test_a_token_without_the_claim_and_another_orgs_run_are_refused(tenant):
    reader = mint_token(SECRET, tenant.org_id, actions=CONSOLE_ACTIONS)
    async with open_tenant(OTHER_ORG, tenant.dsn, schema=tenant.schema) as other, \
            open_run(other, "alpha", retire_on_exit=False) as theirs, \
            open_run(tenant, "alpha", retire_on_exit=False) as mine:
        async with serving(tenant) as server, client(server.url) as http:
            assert (await login_token(http, reader)).status_code == 303
            page = await http.get(f"/ui/runs/alpha/{mine.run_id}")
            assert page.status_code == 200 and "Cancel run" not in page.text  # no claim, no form
            csrf = server.console.sessions.csrf(http.cookies.get(COOKIE))
            refused = await http.post(f"/ui/runs/alpha/{mine.run_id}/cancel",
                                      data={"csrf": csrf}, headers={"accept": "application/json"})
            assert refused.status_code == 403 and "runs.cancel" in refused.json()["error"]
        operator = mint_token(SECRET, tenant.org_id, actions=("*",))
        async with serving(tenant) as server, client(server.url) as http:
            assert (await login_token(http, operator)).status_code == 303
            csrf = server.console.sessions.csrf(http.cookies.get(COOKIE))
            for org in (None, OTHER_ORG):  # the other org's run: not found, like a made-up one
                answer = await http.post(f"/ui/runs/alpha/{theirs.run_id}/cancel",
                                         params={"org": org} if org else None,
                                         data={"csrf": csrf})
                assert answer.status_code == 404
        assert not await cancel_requested(other, theirs.scope)
        assert not await cancel_requested(tenant, mine.scope)


async def test_the_local_console_cancels_with_its_one_time_login(tenant):
    async with open_run(tenant, "alpha", retire_on_exit=False) as run:
        async with open_console(dsn=tenant.dsn, schema=tenant.schema,
                                bind="127.0.0.1:0") as server, client(server.url) as http:
            link = server.login_url()
            assert (await http.get(link.removeprefix(server.url))).status_code == 303
            page = await http.get(f"/ui/runs/alpha/{run.run_id}", params={"org": tenant.org_id})
            csrf = CSRF.search(page.text).group(1)
            answer = await http.post(f"/ui/runs/alpha/{run.run_id}/cancel",
                                     params={"org": tenant.org_id}, data={"csrf": csrf},
                                     headers={"accept": "application/json"})
            assert answer.status_code == 200 and answer.json() == {"answer": "requested"}
        assert await cancel_requested(tenant, run.scope)
