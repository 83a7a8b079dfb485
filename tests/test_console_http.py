"""The console over HTTP: every endpoint's login requirement, a token's org and plays, escaping,
the one-time link, keyset pages and the live stream."""

from __future__ import annotations

import csv
import os
import io
import json

import pytest
import trio

from runplane.engine.console import open_console
from runplane.engine.console.serve import check_loopback
from runplane.engine.errors import InvalidInputError
from runplane.engine.gateway import mint_token
from runplane.engine.tenant import DEFAULT_LANES

from .console_support import (EVIL, OTHER_ORG, OTHER_SECRET, SECRET, client, cookie_header,
                              login_token, run_ids, seed)
from .gateway_support import serving
from .sheet_helpers import table_locked


def pages_of(seeded) -> list[str]:
    return ["/ui/", f"/ui/runs/alpha/{seeded.alpha_run}", "/ui/tables/alpha/t",
            "/ui/failures/alpha/t"]


def data_of(seeded) -> list[str]:
    return ["/ui/api/runs", f"/ui/api/runs/alpha/{seeded.alpha_run}", "/ui/api/tables/alpha/t",
            "/ui/api/failures/alpha/t", "/ui/export/alpha/t.jsonl", "/ui/export/alpha/t.csv",
            f"/ui/live/runs/alpha/{seeded.alpha_run}"]


@pytest.fixture
async def seeded(tenant):
    return await seed(tenant)


@pytest.fixture
async def gateway_url(tenant):
    async with serving(tenant) as server:
        yield server.url


async def test_without_a_session_nothing_is_shown(gateway_url, seeded):
    async with client(gateway_url) as http:
        for path in pages_of(seeded):
            response = await http.get(path)
            assert response.status_code == 303, path
            assert response.headers["location"] == "/ui/login"
            assert not run_ids(response.text)
        for path in data_of(seeded):
            response = await http.get(path)
            assert response.status_code == 401, path
            assert response.json()["code"] == "unauthenticated"
        # a made-up cookie is no session either
        http.cookies.set("runplane_console", "forged", path="/ui")
        assert (await http.get("/ui/api/runs")).status_code == 401
        login = await http.get("/ui/login")
        assert login.status_code == 200 and 'name="token"' in login.text


async def test_login_needs_a_valid_token_that_allows_the_console_reads(tenant, gateway_url):
    async with client(gateway_url) as http:
        huge = await login_token(http, "x" * 20_000)
        assert huge.status_code == 413 and "set-cookie" not in huge.headers
        bad = await login_token(http, "not-a-token")
        assert bad.status_code == 401 and "set-cookie" not in bad.headers
        other_secret = await login_token(http, mint_token("another-secret-" + "y" * 32, tenant.org_id))
        assert other_secret.status_code == 401
        narrow = await login_token(http, mint_token(SECRET, tenant.org_id,
                                                    actions=("receipts.*",)))
        assert narrow.status_code == 403 and "actions claim" in narrow.text
        token = mint_token(SECRET, tenant.org_id)
        good = await login_token(http, token)
        assert good.status_code == 303 and good.headers["location"] == "/ui/"
        cookie = cookie_header(good)
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        assert token not in cookie
        assert (await http.get("/ui/api/runs")).status_code == 200
        out = await http.post("/ui/logout")
        assert out.status_code == 303
        assert (await http.get("/ui/api/runs")).status_code == 401


async def test_a_token_sees_exactly_its_org_and_plays(tenant, gateway_url, seeded):
    token = mint_token(SECRET, tenant.org_id, plays=("alpha",))
    async with client(gateway_url) as http:
        assert (await login_token(http, token)).status_code == 303
        page = await http.get("/ui/")
        assert page.status_code == 200
        assert run_ids(page.text) == {seeded.alpha_run}
        listing = (await http.get("/ui/api/runs")).json()["runs"]
        assert [r["run_id"] for r in listing] == [seeded.alpha_run]
        assert listing[0]["figures"]["completed"] == 61 and listing[0]["figures"]["failed"] == 3
        for path in (f"/ui/runs/beta/{seeded.beta_run}", "/ui/tables/beta/u",
                     f"/ui/runs/alpha/{seeded.other_run}",
                     f"/ui/runs/alpha/{seeded.other_run}?org={OTHER_ORG}",
                     f"/ui/tables/alpha/t?org={OTHER_ORG}", f"/ui/?org={OTHER_ORG}"):
            response = await http.get(path)
            assert response.status_code == 404, path
            assert OTHER_SECRET not in response.text and "beta-row" not in response.text
        for path in (f"/ui/api/runs/beta/{seeded.beta_run}", "/ui/api/failures/beta/u",
                     "/ui/export/beta/u.jsonl", f"/ui/export/alpha/t.csv?org={OTHER_ORG}",
                     f"/ui/live/runs/beta/{seeded.beta_run}", f"/ui/api/runs?org={OTHER_ORG}",
                     f"/ui/live/runs/alpha/{seeded.other_run}?org={OTHER_ORG}"):
            assert (await http.get(path)).status_code == 404, path
        rows = (await http.get("/ui/api/tables/alpha/t?status=enriched")).json()["rows"]
        assert rows and all(OTHER_SECRET not in json.dumps(r) for r in rows)
        assert (await http.get(f"/ui/runs/alpha/{seeded.alpha_run}")).status_code == 200

    other = mint_token(SECRET, OTHER_ORG)
    async with client(gateway_url) as http:
        await login_token(http, other)
        assert run_ids((await http.get("/ui/")).text) == {seeded.other_run}
        assert (await http.get(f"/ui/runs/alpha/{seeded.alpha_run}")).status_code == 404
        text = (await http.get("/ui/tables/alpha/t")).text
        assert OTHER_SECRET in text and "r001" not in text


async def test_values_are_escaped_and_inline_scripts_forbidden(tenant, gateway_url, seeded):
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        for path in ("/ui/tables/alpha/t", "/ui/tables/alpha/t?key=%3Cscript", "/ui/failures/alpha/t",
                     f"/ui/runs/alpha/{seeded.alpha_run}"):
            response = await http.get(path)
            assert response.status_code == 200, path
            assert "<script>alert" not in response.text
            assert "&lt;script&gt;alert" in response.text or "&lt;script" in response.text and \
                "key=" in path, path
            policy = response.headers["content-security-policy"]
            assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert (await http.get("/ui/static/console.js")).status_code == 200
        assert (await http.get("/ui/static/../auth.py")).status_code == 404


async def test_table_pages_by_keyset_with_filters(tenant, gateway_url, seeded):
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        keys, after = [], None
        while True:
            params = {"after": json.dumps(after)} if after else {}
            page = (await http.get("/ui/api/tables/alpha/t", params=params)).json()
            keys += [row["_key"] for row in page["rows"]]
            after = page["next"]
            if after is None:
                break
        assert len(keys) == len(set(keys)) == 64
        failed = (await http.get("/ui/api/failures/alpha/t")).json()["rows"]
        assert len(failed) == 3 and all(r["_status"] == "failed" for r in failed)
        assert (await http.get("/ui/api/tables/alpha/t?status=bogus")).status_code == 400
        assert (await http.get("/ui/api/tables/alpha/t?after=%5B1%5D")).status_code == 400
        html = (await http.get("/ui/failures/alpha/t")).text
        assert "<details>" in html and "no data for bad0" in html
        html = (await http.get("/ui/tables/alpha/t")).text
        assert 'id="next"' in html and 'href="/ui/export/alpha/t.csv"' in html


async def test_live_stream_sends_counters(tenant, gateway_url, seeded):
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        events = []
        with trio.fail_after(20):
            async with http.stream("GET", f"/ui/live/runs/alpha/{seeded.alpha_run}") as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                async for line in stream.aiter_lines():
                    if line.startswith("data:"):
                        events.append(json.loads(line[5:]))
                        if len(events) == 1:
                            break
        (table,) = events[-1]["tables"]
        assert table["table"] == "t" and table["completed"] == 61 and table["failed"] == 3


async def test_console_command_server_one_time_link_and_every_org(tenant, seeded):
    async with open_console(dsn=tenant.dsn, schema=tenant.schema, bind="127.0.0.1:0") as server:
        link = server.login_url()
        assert link.startswith(server.url + "/ui/login?once=")
        async with client(server.url) as http:
            assert (await http.get("/ui/api/runs")).status_code == 401
            first = await http.get(link.removeprefix(server.url))
            assert first.status_code == 303 and "HttpOnly" in cookie_header(first)
            seen = run_ids((await http.get("/ui/")).text)
            assert seen == {seeded.alpha_run, seeded.beta_run, seeded.other_run}
            other = await http.get(f"/ui/tables/alpha/t?org={OTHER_ORG}")
            assert OTHER_SECRET in other.text
            # its pool has the console lane only: every page and endpoint reads on that lane
            for path in [*pages_of(seeded), *data_of(seeded)[:-1]]:
                response = await http.get(path, params={"org": tenant.org_id})
                assert response.status_code == 200, path
            assert (await http.post("/ui/login", data={"token": "x"})).status_code == 401
        async with client(server.url) as http:
            again = await http.get(link.removeprefix(server.url))
            assert again.status_code == 401 and "set-cookie" not in again.headers
            assert (await http.get("/ui/")).status_code == 303


def test_console_refuses_network_binds():
    for bind in ("0.0.0.0:8788", "192.168.1.5:80", "example.com:80", "8788"):
        with pytest.raises(InvalidInputError):
            check_loopback(bind)
    for bind in ("127.0.0.1:0", "localhost:8788", "[::1]:8788"):
        check_loopback(bind)


def test_tenants_have_a_small_console_lane():
    assert DEFAULT_LANES["console"] == 2


def test_a_missing_chromium_skips_the_browser_tests_except_under_ci(monkeypatch):
    from .browser_support import chromium_path

    monkeypatch.delenv("RUNPLANE_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        chromium_path()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y chromium"):
        chromium_path()


async def test_keyset_pages_cross_into_rows_without_an_input_index(tenant, seeded):
    from runplane.engine.console import queries, rows

    sheet = queries.layout(tenant, tenant.org_id, "alpha", "t")
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"UPDATE {sheet.qualified} SET _input_index = NULL "
                           "WHERE _input_index % 5 = 0")
        expected = await conn.fetchval(f"SELECT count(*) FROM {sheet.qualified}")
    seen, after, pages = [], None, 0
    while True:
        page = await rows.rows_page(tenant, tenant.org_id, "alpha", "t",
                                    rows.RowsQuery(after=after, limit=7))
        seen += [(row["_input_index"], row["_key"]) for row in page.rows]
        pages += 1
        after = page.next
        if after is None:
            break
    assert len(seen) == len({key for _, key in seen}) == expected == 64
    indexed = [index for index, _ in seen if index is not None]
    assert indexed == sorted(indexed) and all(index is None for index, _ in seen[len(indexed):])
    assert pages == 10
    failed = await rows.rows_page(tenant, tenant.org_id, "alpha", "t",
                                  rows.RowsQuery(status="failed"))
    assert {row["_status"] for row in failed.rows} == {"failed"} and len(failed.rows) == 3


async def test_a_scan_that_takes_too_long_shows_unknown_figures_not_an_error(tenant, gateway_url,
                                                                            seeded):
    from runplane.engine.console import queries

    sheet = queries.layout(tenant, tenant.org_id, "alpha", "t")
    # an exclusive lock makes every scan of the sheet wait
    async with table_locked(tenant, sheet.qualified, "ACCESS EXCLUSIVE"):
        # what a run did is its run history: no sheet scan, so it is shown all the same
        runs = await queries.list_runs(tenant, queries.RunsQuery(org=tenant.org_id, plays=("alpha",)))
        assert [run.figures.completed for run in runs] == [61]
        (table,) = await queries.run_tables(tenant, tenant.org_id, "alpha", seeded.alpha_run)
        assert table.top_errors is None and table.mine.figures.completed == 61
        assert table.counters.completed == 61
        async with client(gateway_url) as http:
            await login_token(http, mint_token(SECRET, tenant.org_id))
            page = await http.get("/ui/?play=alpha")
            assert page.status_code == 200 and "counting took too long" not in page.text
            page = await http.get(f"/ui/runs/alpha/{seeded.alpha_run}")
            assert page.status_code == 200 and "counting took too long" in page.text
    (table,) = await queries.run_tables(tenant, tenant.org_id, "alpha", seeded.alpha_run)
    assert sum(c.count for c in table.top_errors) == 3  # its three failed rows, by cause


async def test_live_streams_are_limited_per_org(tenant, gateway_url, seeded, monkeypatch):
    from runplane.engine.console import routes

    monkeypatch.setattr(routes, "MAX_STREAMS", 1)
    path = f"/ui/live/runs/alpha/{seeded.alpha_run}"
    async with client(gateway_url) as mine, client(gateway_url) as other:
        await login_token(mine, mint_token(SECRET, tenant.org_id))
        await login_token(other, mint_token(SECRET, OTHER_ORG))
        async def keep_reading(started: trio.Event) -> None:
            async with mine.stream("GET", path) as first:
                async for line in first.aiter_lines():
                    if line.startswith("data:"):
                        started.set()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                started = trio.Event()
                nursery.start_soon(keep_reading, started)
                await started.wait()
                assert (await mine.get(path)).status_code == 503  # this org's one stream is open
                async with other.stream("GET", f"/ui/live/runs/alpha/{seeded.other_run}") as theirs:
                    assert theirs.status_code == 200  # another org still gets its own
                nursery.cancel_scope.cancel()


async def test_console_reads_cannot_write(tenant, seeded):
    from runplane.engine.console import queries
    from runplane.engine.errors import DatabaseError

    sql = f'INSERT INTO "{tenant.schema}".meta (key, value) VALUES ($1, $2)'
    with pytest.raises(DatabaseError, match="read-only"):
        await queries.read(tenant, lambda conn: conn.execute(sql, "console", "wrote"))
    assert tenant.permits()["console"].acquired == 1


async def test_runs_page_by_epoch_keyset_with_filters(tenant, gateway_url, seeded):
    from runplane.engine import runs
    from runplane.engine.values.scopes import RunScope

    for i in range(60):
        await runs.register(tenant, RunScope(tenant.org_id, "many", f"run-{i:02d}"))
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        first = (await http.get("/ui/api/runs", params={"play": "many"})).json()
        assert [r["run_id"] for r in first["runs"]] == [f"run-{i:02d}" for i in range(59, 9, -1)]
        second = (await http.get("/ui/api/runs", params={"play": "many",
                                                          "before": first["next_before"]})).json()
        assert [r["run_id"] for r in second["runs"]] == [f"run-{i:02d}" for i in range(9, -1, -1)]
        assert second["next_before"] is None
        assert 'id="older"' in (await http.get("/ui/?play=many")).text
        done = (await http.get("/ui/api/runs", params={"state": "done"})).json()["runs"]
        assert {r["run_id"] for r in done} == {seeded.alpha_run, seeded.beta_run}
        open_runs = (await http.get("/ui/api/runs", params={"state": "open"})).json()["runs"]
        assert len(open_runs) == 50 and all(r["resume"] is None or r["state"] == "open"
                                            for r in open_runs)
        assert (await http.get("/ui/api/runs", params={"state": "nope"})).status_code == 400


async def test_exports_stream_a_tables_rows_as_json_lines_and_csv(tenant, gateway_url, seeded):
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id, plays=("alpha",)))
        lines = (await http.get("/ui/export/alpha/t.jsonl")).text.splitlines()
        found = [json.loads(line) for line in lines]
        assert len(found) == 64 and len({row["_key"] for row in found}) == 64
        assert found[0]["name"] == EVIL  # row order: input index first
        response = await http.get("/ui/export/alpha/t.csv?status=failed")
        assert response.headers["content-type"].startswith("text/csv")
        assert 'filename="alpha-t.csv"' in response.headers["content-disposition"]
        table = list(csv.reader(io.StringIO(response.text)))
        assert table[0][-3:] == ["_key", "_status", "_error"] and "name" in table[0]
        assert len(table) == 4 and {row[table[0].index("_status")] for row in table[1:]} == {"failed"}
        assert (await http.get("/ui/export/alpha/t.parquet")).status_code == 400
        assert (await http.get("/ui/export/alpha/nope.csv")).status_code == 404
        assert (await http.get("/ui/export/alpha/t.csv?status=bogus")).status_code == 400
        assert OTHER_SECRET not in (await http.get("/ui/export/alpha/t.jsonl")).text


async def test_a_run_page_lists_the_workers_of_its_plays_shared_maps(tenant, gateway_url, seeded):
    from runplane.engine.shared import maps as shared_maps

    await shared_maps.join(tenant, "alpha", "worker-one")  # as `runplane worker` does
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        page = (await http.get(f"/ui/runs/alpha/{seeded.alpha_run}")).text
        other = (await http.get(f"/ui/runs/beta/{seeded.beta_run}")).text
    assert "Workers of the play" in page and f"<td class=\"num\">{os.getpid()}</td>" in page
    assert "Workers of the play" not in other  # another play's workers are not listed
