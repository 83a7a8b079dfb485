"""The live runs list: `/ui/live/runs` sends the runs page's list (filtered by play and state)
as server-sent events, counted per org like a run's stream, ending with its session."""

from __future__ import annotations

import json

import pytest
import trio

from runplane.engine import runs
from runplane.engine.gateway import mint_token
from runplane.engine.values.scopes import RunScope

from .console_support import OTHER_ORG, SECRET, client, login_token, seed
from .gateway_support import serving


@pytest.fixture
async def seeded(tenant):
    return await seed(tenant)


@pytest.fixture
async def gateway_url(tenant):
    async with serving(tenant) as server:
        yield server.url


async def _events(lines, count: int) -> list[dict]:
    """The next `count` events' data from `lines` (one `aiter_lines()` of a stream)."""
    found = []
    async for line in lines:
        if line.startswith("data:"):
            found.append(json.loads(line[5:]))
            if len(found) == count:
                break
    return found


async def test_the_runs_list_updates_without_a_reload(tenant, gateway_url, seeded):
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        page = (await http.get("/ui/?play=alpha")).text
        assert 'data-live="/ui/live/runs?play=alpha"' in page and "<script>" not in page
        assert "data-live" not in (await http.get("/ui/?before=99999999")).text
        with trio.fail_after(30):
            async with http.stream("GET", "/ui/live/runs", params={"play": "alpha"}) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                lines = stream.aiter_lines()
                (first,) = await _events(lines, 1)
                assert [r["run_id"] for r in first["runs"]] == [seeded.alpha_run]
                assert first["runs"][0]["figures"]["completed"] == 61
                await runs.register(tenant, RunScope(tenant.org_id, "alpha", "run-later"))
                await runs.register(tenant, RunScope(tenant.org_id, "beta", "run-elsewhere"))
                (later,) = await _events(lines, 1)
        assert [r["run_id"] for r in later["runs"]] == ["run-later", seeded.alpha_run]
        assert later["runs"][0]["state"] == "open" and later["runs"][0]["figures"] is None
        with trio.fail_after(30):
            async with http.stream("GET", "/ui/live/runs", params={"state": "open"}) as stream:
                (opened,) = await _events(stream.aiter_lines(), 1)
        assert {r["run_id"] for r in opened["runs"]} == {"run-later", "run-elsewhere"}
        assert (await http.get("/ui/live/runs", params={"state": "bogus"})).status_code == 400
        assert (await http.get("/ui/live/runs", params={"org": OTHER_ORG})).status_code == 404
    async with client(gateway_url) as http:
        assert (await http.get("/ui/live/runs")).status_code == 401
        await login_token(http, mint_token(SECRET, OTHER_ORG))
        with trio.fail_after(30):
            async with http.stream("GET", "/ui/live/runs") as stream:
                (theirs,) = await _events(stream.aiter_lines(), 1)
        assert [r["run_id"] for r in theirs["runs"]] == [seeded.other_run]


async def test_counted_with_the_run_streams_and_ended_with_the_session(tenant, gateway_url,
                                                                      seeded, monkeypatch):
    from runplane.engine.console import routes

    monkeypatch.setattr(routes, "MAX_STREAMS", 1)
    async with client(gateway_url) as http, client(gateway_url) as other:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        await login_token(other, mint_token(SECRET, OTHER_ORG))
        with trio.fail_after(30):
            async with http.stream("GET", "/ui/live/runs") as stream:
                lines = stream.aiter_lines()
                await _events(lines, 1)
                assert (await http.get("/ui/live/runs")).status_code == 503
                assert (await http.get(f"/ui/live/runs/alpha/{seeded.alpha_run}")).status_code == 503
                async with other.stream("GET", "/ui/live/runs") as theirs:
                    assert theirs.status_code == 200  # another org still gets its own
                assert (await http.post("/ui/logout")).status_code == 303
                rest = [line async for line in lines if line.startswith("data:")]
                assert len(rest) <= 1  # the stream ended with the session
        with trio.fail_after(30):  # its slot was given back
            await login_token(http, mint_token(SECRET, tenant.org_id))
            async with http.stream("GET", "/ui/live/runs") as again:
                assert again.status_code == 200
