"""Metrics and JSON logs (SPEC §31): `/metrics` parsed with prometheus_client's own parser after
real runs, compared with `runplane runs --json`; the gateway's and console's `/metrics` behind
the operator's secret; bounded labels."""

from __future__ import annotations

import json
import signal
import subprocess
import uuid

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from runplane.actors import open_run
from runplane.engine import sheets
from runplane.engine.console import open_console
from runplane.engine.gateway import open_gateway
from runplane.engine.observability import metrics
from runplane.engine.observability.exposition import TOKEN_ENV

from .cli_helpers import RUNPLANE, ROOT, cli_env, run_cli, schema, wait_for_text, write_play  # noqa: F401
from .gateway_support import FAST_RETRY, serving, token_for

METRICS_SECRET = "operator-metrics-secret-" + "m" * 16
CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))


@pytest.fixture(autouse=True)
def fresh_play_labels():
    """The play cap counts this process's plays; a suite's earlier tests used many."""
    metrics._plays.known.clear()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics text, keyed by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def rows_total(found: dict, play: str, table: str, outcome: str) -> float:
    key = ("runplane_rows_total", (("outcome", outcome), ("play", play), ("table", table)))
    return found.get(key, 0.0)


def test_a_runs_metrics_and_json_logs_agree_with_runs_json(tmp_path, schema):
    """`runplane run --metrics-bind ... --log-format json`: the run's completed and failed
    counts scraped from its own listener equal `runplane runs --json`; every stderr line is a
    JSON object with the §31 keys, the map's lines naming its org, play, run and map."""
    names = [f"n{i}" for i in range(40)] + [f"bad{i}" for i in range(3)]
    play, rows = write_play(tmp_path, names)
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    env = cli_env(RUNPLANE_SCHEMA=schema, PLAY_HOLD="1")
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([*RUNPLANE, "run", str(play), "--input", str(rows),
                                 "--metrics-bind", "127.0.0.1:0", "--log-format", "json"],
                                stdout=stdout, stderr=stderr, text=True, env=env, cwd=ROOT)
    try:
        wait_for_text(out, "held", proc)
        lines = [json.loads(line) for line in err.read_text().splitlines()]
        url = next(line["message"].split()[-1] for line in lines
                   if line["message"].startswith("runplane: metrics at "))
        answer = httpx.get(url, timeout=10)
        assert answer.status_code == 200
        assert httpx.get(url.replace("/metrics", "/other"), timeout=10).status_code == 404
        found = samples(answer.text)
        listed = run_cli("runs", "ops", "--json", env=cli_env(RUNPLANE_SCHEMA=schema))
        assert listed.returncode == 0, listed.stderr
        (run,) = json.loads(listed.stdout)["runs"]
        assert run["completed"] == rows_total(found, "ops", "things", "completed") == 40
        assert run["failed"] == rows_total(found, "ops", "things", "failed") == 3
        assert run["cached"] == rows_total(found, "ops", "things", "cached") == 0
        assert found[("runplane_rows_running", ())] == 0
        calls = found[("runplane_row_seconds_count", ())]
        assert calls == 43
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    records = [json.loads(line) for line in err.read_text().splitlines()]  # each line parses
    assert records and all({"time", "level", "message", "org", "play", "run_id", "map"}
                           <= record.keys() for record in records)
    ended = [r for r in records if r["message"].startswith("map ended")]
    assert [(r["org"], r["play"], r["run_id"], r["map"]) for r in ended] == [
        ("local", "ops", run["run_id"], "things")]


async def _scrape(client: httpx.AsyncClient, url: str, bearer: str | None) -> httpx.Response:
    headers = {} if bearer is None else {"Authorization": f"Bearer {bearer}"}
    return await client.get(url + "/metrics", headers=headers)


async def test_the_gateway_counts_actions_and_opens_metrics_to_the_operator_only(
        tenant, monkeypatch):
    play = f"gm{uuid.uuid4().hex[:8]}"
    tenant_token = token_for(tenant)
    async with serving(tenant) as server, httpx.AsyncClient(timeout=10) as client:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        assert (await _scrape(client, server.url, METRICS_SECRET)).status_code == 404
        monkeypatch.setenv(TOKEN_ENV, METRICS_SECRET)
        before = samples((await _scrape(client, server.url, METRICS_SECRET)).text)
        async with open_gateway(server.url, tenant_token, retry=FAST_RETRY) as gateway:
            async with open_run(gateway, play) as run:
                result = await run.map("t", [{"name": f"r{i}"} for i in range(25)],
                                       _upper, contract=CONTRACT)
        made_up = await client.post(server.url + "/v1/actions/made.up", json={},
                                    headers={"Authorization": f"Bearer {tenant_token}"})
        for refused in (None, tenant_token, METRICS_SECRET + "x"):
            assert (await _scrape(client, server.url, refused)).status_code == 401
        after = samples((await _scrape(client, server.url, METRICS_SECRET)).text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert result.completed == 25
    assert rows_total(after, play, "t", "completed") == 25
    admits = delta("runplane_gateway_requests_total", action="sheets.admit", code="200")
    completes = delta("runplane_gateway_requests_total", action="sheets.complete", code="200")
    assert admits >= 1 and completes >= 1
    assert delta("runplane_gateway_request_seconds_count", action="sheets.complete") == completes
    assert delta("runplane_gateway_requests_total", action="other",
                 code=str(made_up.status_code)) == 1
    actions = {dict(labels)["action"] for (name, labels) in after
               if name == "runplane_gateway_requests_total"}
    assert "made.up" not in actions and "other" in actions
    statements = {dict(labels)["lane"] for (name, labels) in after
                  if name == "runplane_statement_seconds_count"}
    assert statements <= set(metrics.LANES) | {"other"} and "sheet" in statements


async def _upper(row):
    return {"upper": row["name"].upper()}


async def test_the_consoles_metrics_need_the_operators_secret(dsn, tenant, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, METRICS_SECRET)
    async with open_console(dsn=dsn, schema=tenant.schema, bind="127.0.0.1:0") as console, \
            httpx.AsyncClient(timeout=10) as client:
        assert (await _scrape(client, console.url, None)).status_code == 401
        answer = await _scrape(client, console.url, METRICS_SECRET)
        assert answer.status_code == 200
        assert ("runplane_console_streams", ()) in samples(answer.text)


async def test_a_run_in_process_counts_what_its_map_result_says(tenant):
    play = f"mp{uuid.uuid4().hex[:8]}"

    async def flaky(row):
        if row["name"].endswith("7"):
            raise ValueError("no sevens")
        return {"upper": row["name"].upper()}

    source = [{"name": f"r{i}"} for i in range(30)]
    async with open_run(tenant, play) as run:
        first = await run.map("t", source, flaky, contract=CONTRACT)
    async with open_run(tenant, play) as run:
        second = await run.map("t", source, flaky, contract=CONTRACT)
    found = samples(metrics.exposition().decode())
    assert rows_total(found, play, "t", "completed") == first.completed + second.completed == 27
    assert rows_total(found, play, "t", "failed") == first.failed + second.failed
    assert rows_total(found, play, "t", "cached") == first.cached + second.cached == 27


def test_labels_stay_bounded():
    """Past `PLAY_CAP` (play, table) pairs a process counts new ones under `other`."""
    tag = uuid.uuid4().hex[:6]
    meters = [metrics.RowMeters.of(f"{tag}-{i}", "t") for i in range(metrics.PLAY_CAP + 2)]
    meters[-1].add({metrics.RowOutcome.COMPLETED: 1})
    found = samples(metrics.exposition().decode())
    plays = {dict(labels)["play"] for (name, labels) in found if name == "runplane_rows_total"}
    assert len({play for play in plays if play.startswith(tag)}) == metrics.PLAY_CAP
    assert rows_total(found, "other", "other", "completed") >= 1
    assert metrics.statement_kind("  SELECT 1") == "select"
    assert metrics.statement_kind("VACUUM x") == "other"


@pytest.mark.parametrize("bind", ["nope", "127.0.0.1:99999", "host:"])
def test_a_bad_metrics_bind_is_a_usage_error(bind):
    done = run_cli("supervise", "--metrics-bind", bind)
    assert done.returncode == 2 and "--metrics-bind" in done.stderr


async def test_the_listener_serves_inside_the_trio_run():
    from runplane.engine.observability.exposition import serve_metrics

    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_metrics, "127.0.0.1:0")
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.get(url)
        nursery.cancel_scope.cancel()
    assert answer.status_code == 200 and "runplane_rows_running" in answer.text


def test_the_guide_lists_every_metric_and_the_dashboard_queries_only_them():
    """docs/guide/observability.md's table names exactly the metrics a process exposes, and
    every query of docs/dashboard.json uses only those."""
    import re

    guide = (ROOT / "docs" / "guide" / "observability.md").read_text()
    listed = set(re.findall(r"^\| `(runplane_[a-z_]+)", guide, re.M))
    exposed = {family.name for family in text_string_to_metric_families(
        metrics.exposition().decode()) if not family.name.endswith("_created")}
    exposed = {name + "_total" if f"{name}_total" in listed else name for name in exposed}
    assert listed == exposed
    dashboard = json.loads((ROOT / "docs" / "dashboard.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"runplane_[a-z_]+", target["expr"])}
    known = exposed | {f"{n}_{s}" for n in exposed for s in ("bucket", "count", "sum")}
    assert used <= known, used - known
