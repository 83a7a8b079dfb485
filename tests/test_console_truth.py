"""The console tells the truth (§27, issue 35 items 5 and 9): rows/s never negative, retries of
this run only, the chart keeps its last minute when a run ends, the runs list and a run's page
show each run's own history, one word per row state on every page, and `runplane console`
starts on a schema that holds no runplane tables yet."""

from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
import trio

from runplane.actors import RowRetry, open_run
from runplane.engine import open_tenant
from runplane.engine.console import live, rates
from runplane.engine.gateway import mint_token

from .conftest import fresh_schema
from .console_support import CONTRACT, SECRET, client, login_token, upper
from .gateway_support import serving


def rows(n: int, prefix: str = "r") -> list[dict]:
    return [{"name": f"{prefix}{i:03d}"} for i in range(n)]


@pytest.fixture
async def console(tenant):
    """A gateway's console over the test tenant, and a client logged in to it."""
    async with serving(tenant) as server, client(server.url) as http:
        assert (await login_token(http, mint_token(SECRET, tenant.org_id))).status_code == 303
        yield http


async def progress_events(http: httpx.AsyncClient, play: str, run_id: str):
    """The run's live stream, one parsed `progress` payload at a time."""
    async with http.stream("GET", f"/ui/live/runs/{play}/{run_id}") as stream:
        assert stream.status_code == 200
        async for line in stream.aiter_lines():
            if line.startswith("data:"):
                yield json.loads(line[5:])


def visible_text(page: str) -> str:
    """What a person reads: the page without its tags (attribute values are not read)."""
    body = page.split("<main", 1)[-1]
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def run_row(page: str, run_id: str) -> str:
    match = re.search(r"<tr>(?:(?!</tr>).)*" + re.escape(run_id) + r"(?:(?!</tr>).)*</tr>", page)
    assert match, run_id
    return match.group(0)


def figure(row_html: str, name: str) -> int:
    match = re.search(rf'data-figure="{name}">(\d+)', row_html)
    assert match, (name, row_html)
    return int(match.group(1))


async def test_rows_per_second_stays_at_or_above_zero_through_a_force_run(tenant, console):
    """A `--force` run re-admits the sheet's completed rows (the sheet's completed counter
    drops): its rows/s is this run's completions over time, never negative."""
    async with open_run(tenant, "p") as first:
        await first.map("t", rows(40), upper, contract=CONTRACT)
    admitted, release = trio.Event(), trio.Event()

    async def gated(row: dict) -> dict:
        admitted.set()  # rows are handed out once force re-admitted them
        await release.wait()
        return {"upper": row["name"].upper()}

    events: list[dict] = []
    seen, mapped = trio.Event(), trio.Event()
    with trio.fail_after(60):
        async with open_run(tenant, "p", force=True) as second:
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    since_admitted = since_mapped = 0
                    async for event in progress_events(console, "p", second.run_id):
                        events.append(event)
                        seen.set()
                        since_admitted += admitted.is_set()
                        if since_admitted == 2:  # ticks seen with the rows re-admitted
                            release.set()
                        since_mapped += mapped.is_set()
                        if since_mapped == 3:  # and a few once the map is written
                            return

                nursery.start_soon(watch)
                await seen.wait()  # a first sample before force re-admits anything
                await second.map("t", rows(40), gated, contract=CONTRACT, concurrency=40)
                mapped.set()
    assert events, "the stream sent nothing"
    rates_seen = [t["rate"] for event in events for t in event["tables"]]
    assert rates_seen and min(rates_seen) >= 0, rates_seen
    assert events[-1]["tables"][0]["completed"] == 40


def test_a_rate_is_completions_over_the_last_minute_and_zero_when_none():
    window = rates.RateWindow()
    assert window.rate(100.0) == 0.0  # no samples: 0
    window.add(100.0, 10)
    assert window.rate(100.0) == 0.0  # one sample: nothing completed since it
    window.add(110.0, 60)
    assert window.rate(110.0) == 5.0
    window.add(105.0, 90)  # an older write seen late adds nothing
    window.add(120.0, 30)  # the entry was replaced (a wake): start over, never negative
    assert window.rate(120.0) == 0.0 and window.series() == []
    window.add(130.0, 50)
    assert window.rate(130.0) == 2.0
    assert window.rate(200.0) == 0.0  # nothing in the last 60 s
    assert rates.eta_s(10, 0.0) is None and rates.eta_s(0, 0.0) == 0.0
    assert rates.eta_s(10, 2.0) == 5.0


async def test_retried_counts_this_runs_retries_only(tenant, console):
    """Retried = calls of this run that raised and were called again: a run that retried
    nothing reads 0, however many attempts earlier runs made on its rows."""
    raised: set[str] = set()

    async def flaky(row: dict) -> dict:
        if row["name"] not in raised:
            raised.add(row["name"])
            raise ValueError("once")
        return {"upper": row["name"].upper()}

    retry = RowRetry(max_attempts=3, initial_s=0.0, jitter=False)
    async with open_run(tenant, "p") as first:
        assert (await first.map("t", rows(5), flaky, contract=CONTRACT, retry=retry)).retried == 5
    async with open_run(tenant, "p", force=True) as second:
        assert (await second.map("t", rows(5), upper, contract=CONTRACT)).retried == 0
    for run_id, retried in ((second.run_id, 0), (first.run_id, 5)):
        page = (await console.get(f"/ui/runs/p/{run_id}")).text
        shown = re.findall(r'data-field="retri(?:ed|es)">(\d+)<', page)
        assert shown == [str(retried)], (run_id, shown)
    runs = {r["run_id"]: r for r in (await console.get("/ui/api/runs")).json()["runs"]}
    assert runs[second.run_id]["figures"]["retried"] == 0
    assert runs[first.run_id]["figures"]["retried"] == 5


async def test_each_run_shows_its_own_history_after_later_runs_rewrote_its_rows(tenant,
                                                                                 console):
    """The runs list and a run's page show what each run did, never the rows it last wrote:
    an earlier run does not read 0/0/0/0 once a `force` run rewrote its rows."""
    source = rows(4) + [{"name": "bad0"}]
    async with open_run(tenant, "p") as first:
        await first.map("t", source, upper, contract=CONTRACT)

    async def fixed(row: dict) -> dict:
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "p", force=True) as second:
        await second.map("t", source, fixed, contract=CONTRACT)
    async with open_run(tenant, "p") as third:
        await third.map("t", source, fixed, contract=CONTRACT)
    page = (await console.get("/ui/")).text
    expected = {first.run_id: (5, 0, 4, 1, 0), second.run_id: (5, 0, 5, 0, 0),
                third.run_id: (5, 5, 0, 0, 0)}
    for run_id, want in expected.items():
        row_html = run_row(page, run_id)
        assert tuple(figure(row_html, name) for name in (
            "admitted", "cached", "completed", "failed", "retried")) == want, run_id
    listed = {r["run_id"]: r["figures"] for r in (await console.get("/ui/api/runs")).json()["runs"]}
    assert (listed[first.run_id]["completed"], listed[first.run_id]["failed"]) == (4, 1)
    run_page = (await console.get(f"/ui/runs/p/{first.run_id}")).text
    assert re.findall(r'data-field="completed">(\d+)<', run_page) == ["4"]
    assert re.findall(r'data-field="failed">(\d+)<', run_page) == ["1"]


async def test_a_run_page_shows_each_figure_once_and_keeps_it_live(tenant, console):
    """A fresh sheet, one run: the run page, loaded mid-run, names each figure once, and every
    figure it shows is one its live stream keeps up to date; once the run ended, this run's
    completed rows equal the sheet's."""
    some_done, release = trio.Event(), trio.Event()
    done = 0

    async def gated(row: dict) -> dict:
        nonlocal done
        if row["name"] >= "r010":
            some_done.set()
            await release.wait()
        done += 1
        return {"upper": row["name"].upper()}

    with trio.fail_after(60):
        async with open_run(tenant, "p") as run:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: run.map("t", rows(30), gated, contract=CONTRACT,
                                                   concurrency=1))
                await some_done.wait()
                mid = (await console.get(f"/ui/runs/p/{run.run_id}")).text
                release.set()
            async for event in progress_events(console, "p", run.run_id):
                if event["tables"] and event["tables"][0]["completed"] == 30:
                    break
    section = mid.split('<section class="map"', 1)[1].split("</section>", 1)[0]
    fields = re.findall(r'data-field="([^"]+)"', section)
    assert len(fields) == len(set(fields)), fields  # one figure, one place
    (table,) = event["tables"]
    assert set(fields) <= set(table) | {"rate", "eta"}, set(fields) - set(table)
    sheet = (await console.get("/ui/api/tables/p/t")).json()
    assert table["completed"] == table["sheet"]["completed"] == 30 == len(sheet["rows"])
    assert table["admitted"] == 30 and table["failed"] == table["sheet"]["failed"] == 0
    after = (await console.get(f"/ui/runs/p/{run.run_id}")).text
    assert re.findall(r'data-field="completed">(\d+)<', after) == ["30"]


async def test_row_states_read_the_same_words_on_every_page(tenant, console):
    """Stored values (`enriched`, `pending`) stay in storage and API filters; pages show
    queued, running, completed, failed."""
    async with open_run(tenant, "p") as run:
        await run.map("t", rows(3) + [{"name": "bad0"}], upper, contract=CONTRACT)
    table = (await console.get("/ui/tables/p/t")).text
    for path in ("/ui/", f"/ui/runs/p/{run.run_id}", "/ui/tables/p/t",
                 "/ui/tables/p/t?status=enriched"):
        text = visible_text((await console.get(path)).text)
        assert not re.search(r"\b(enriched|pending)\b", text), (path, text)
    assert '<option value="enriched">completed</option>' in table
    assert '<option value="pending">queued</option>' in table
    assert re.search(r"<td>completed</td>", table) and re.search(r"<td>failed</td>", table)
    filtered = (await console.get("/ui/api/tables/p/t?status=enriched")).json()["rows"]
    assert {r["_status"] for r in filtered} == {"enriched"} and len(filtered) == 3


async def test_the_rate_chart_keeps_its_last_minute_when_the_run_ends(tenant, console,
                                                                      monkeypatch):
    """Once a run ends, its stream keeps drawing the run's last minute (the chart does not go
    blank as idle ticks follow; `IDLE_INTERVAL_S` is shortened to see many of them)."""
    monkeypatch.setattr(live, "IDLE_INTERVAL_S", 0.01)
    batches = [trio.Event() for _ in range(3)]

    async def in_batches(row: dict) -> dict:
        await batches[int(row["name"][1:]) // 10].wait()
        return {"upper": row["name"].upper()}

    started = trio.Event()
    run_id = ""

    async def run_it() -> None:
        nonlocal run_id
        async with open_run(tenant, "p") as run:
            run_id = run.run_id
            started.set()
            await run.map("t", rows(30), in_batches, contract=CONTRACT)

    after: list[dict] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_it)
            await started.wait()
            batches[0].set()
            async for event in progress_events(console, "p", run_id):
                if event["state"] != "open":  # the run ended: idle ticks follow
                    after.append(event)
                    if len(after) == 80:  # more of them than the chart holds samples
                        break
                    continue
                completed = event["tables"][0]["completed"] if event["tables"] else 0
                ready = sum(b.is_set() for b in batches)
                if completed >= 10 * ready and ready < len(batches):
                    batches[ready].set()  # that batch is written: release the next one
    series = after[-1]["tables"][0]["series"]
    assert series and max(series) > 0, series


async def test_console_command_starts_on_a_schema_without_runplane_tables(dsn):
    """`runplane console` on a schema no run has created yet: it starts, creates nothing,
    shows an empty state, and fills in once a run creates the schema."""
    schema = fresh_schema()
    env = {**os.environ, "RUNPLANE_DSN": dsn, "RUNPLANE_SCHEMA": schema}
    child = subprocess.Popen([sys.executable, "-m", "runplane.cli", "console", "--bind",
                              "127.0.0.1:0"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        first = child.stdout.readline()
        assert "console listening on http://127.0.0.1:" in first, first + child.stderr.read()
        assert "no runplane tables yet" in first
        link = child.stdout.readline().strip()
        base = link.split("/ui/login", 1)[0]
        async with open_tenant("probe", dsn, schema="public", bootstrap=False) as probe:
            async with probe.connection("sheet") as conn:
                assert await conn.fetchval("SELECT to_regnamespace($1)", schema) is None
        async with httpx.AsyncClient(base_url=base, trust_env=False) as http:
            assert (await http.get(link)).status_code == 303
            empty = await http.get("/ui/")
            assert empty.status_code == 200 and 'id="empty"' in empty.text
            assert schema in empty.text
            listing = (await http.get("/ui/api/runs")).json()
            assert listing["runs"] == [] and listing["schema_ready"] is False
            assert (await http.get("/ui/tables/p/t")).status_code == 404
            async with open_tenant("probe", dsn, schema="public", bootstrap=False) as probe:
                async with probe.connection("sheet") as conn:  # still nothing created
                    assert await conn.fetchval("SELECT to_regnamespace($1)", schema) is None
            async with open_tenant("local", dsn, schema=schema) as tenant:  # a first run
                async with open_run(tenant, "p") as run:
                    await run.map("t", rows(3), upper, contract=CONTRACT)
            filled = await http.get("/ui/")
            assert filled.status_code == 200 and run.run_id in filled.text
            assert 'id="empty"' not in filled.text
            page = await http.get(f"/ui/runs/p/{run.run_id}")
            assert page.status_code == 200
            assert re.findall(r'data-field="completed">(\d+)<', page.text) == ["3"]
    finally:
        child.send_signal(signal.SIGINT)
        child.wait(timeout=30)
        async with open_tenant("probe", dsn, schema="public", bootstrap=False) as probe:
            async with probe.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
