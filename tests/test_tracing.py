"""Traces (SPEC §31): OpenTelemetry's in-memory span exporter checks the span tree of real runs
(run → map → admission and completion batches and sampled row calls, no span leaking between
maps running at once) and one trace id across a gateway's client and server spans; processes
started without the `OTEL_*` variables import nothing of OpenTelemetry, and with
`OTEL_TRACES_EXPORTER=console` a run's spans come out of the SDK's console exporter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import trio

try:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode
except ImportError:  # the `otel` extra (in `test`): CI installs it
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("opentelemetry-sdk is not installed: pip install -e '.[otel]'",
                allow_module_level=True)

from runplane.actors import open_run
from runplane.engine import sheets
from runplane.engine.errors import InvalidInputError
from runplane.engine.gateway import open_gateway
from runplane.engine.observability import tracing

from .cli_helpers import ROOT
from .gateway_support import FAST_RETRY, serving, token_for

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))
BATCHES = {tracing.SpanName.ADMISSION.value, tracing.SpanName.COMPLETION.value}


async def upper(row: dict) -> dict:
    if row["name"].startswith("bad"):
        raise ValueError("a bad name")
    await trio.sleep(0)
    return {"upper": row["name"].upper()}


@pytest.fixture
def exported():
    """Spans into an in-memory exporter, every row call sampled; tracing off afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider, ratio=1.0)
    try:
        yield exporter
    finally:
        tracing.configure(None)


def named(spans, name: tracing.SpanName) -> list:
    return [s for s in spans if s.name == name.value]


async def test_a_runs_spans_make_a_tree_and_concurrent_maps_keep_their_own(tenant, exported):
    """One run span (org, play, run id) over two maps run at once; each map's admission and
    completion batches and its row calls (all sampled at ratio 1) are children of that map's
    span, never of the other's; a failed row's span is an error; one trace id throughout."""
    sizes = {"alpha": 20, "beta": 33}

    async with open_run(tenant, "traced") as run:
        async def one_map(table: str) -> None:
            rows = [{"name": f"{table}{i}"} for i in range(sizes[table])] + [{"name": "bad-x"}]
            result = await run.map(table, rows, upper, contract=CONTRACT, concurrency=4)
            assert (result.completed, result.failed) == (sizes[table], 1)

        async with trio.open_nursery() as nursery:
            for table in sizes:
                nursery.start_soon(one_map, table)
        run_id = run.run_id

    spans = exported.get_finished_spans()
    [run_span] = named(spans, tracing.SpanName.RUN)
    assert run_span.parent is None
    assert dict(run_span.attributes) == {"runplane.org": tenant.org_id,
                                         "runplane.play": "traced", "runplane.run_id": run_id}
    maps = {s.attributes["runplane.table"]: s for s in named(spans, tracing.SpanName.MAP)}
    assert set(maps) == set(sizes)
    assert all(m.parent.span_id == run_span.context.span_id for m in maps.values())
    assert {s.context.trace_id for s in spans} == {run_span.context.trace_id}
    for table, map_span in maps.items():
        children = [s for s in spans if s.parent and s.parent.span_id == map_span.context.span_id]
        rows = named(children, tracing.SpanName.ROW)
        assert len(rows) == sizes[table] + 1  # every row called once, each call sampled
        [failed] = [r for r in rows if r.status.status_code is StatusCode.ERROR]
        assert failed.events[0].name == "exception"
        admitted = named(children, tracing.SpanName.ADMISSION)
        completed = named(children, tracing.SpanName.COMPLETION)
        assert admitted and completed
        assert sum(s.attributes["runplane.rows"] for s in admitted) == sizes[table] + 1
        assert sum(s.attributes["runplane.rows"] for s in completed) == sizes[table] + 1
    batch_parents = {s.parent.span_id for s in spans if s.name in BATCHES}
    assert batch_parents == {m.context.span_id for m in maps.values()}


async def test_one_trace_id_spans_the_gateways_client_and_server(tenant, exported):
    """A run through a real gateway: every action the client sends is a CLIENT span carrying
    `traceparent`; the gateway answers each in a SERVER span whose parent is that client span
    (a remote parent: it came in the header), with the action and the status; one trace."""
    async with serving(tenant) as server, \
            open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
        async with open_run(gateway, "remote") as run:
            result = await run.map("things", [{"name": f"n{i}"} for i in range(12)], upper,
                                   contract=CONTRACT, concurrency=4)
    assert result.completed == 12

    spans = exported.get_finished_spans()
    [run_span] = named(spans, tracing.SpanName.RUN)
    clients = {s.context.span_id: s for s in named(spans, tracing.SpanName.CLIENT)}
    servers = named(spans, tracing.SpanName.SERVER)
    assert {s.kind for s in clients.values()} == {SpanKind.CLIENT}
    assert servers and {s.kind for s in servers} == {SpanKind.SERVER}
    for served in servers:
        assert served.parent.is_remote
        assert served.parent.span_id in clients
        client = clients[served.parent.span_id]
        assert served.attributes["runplane.action"] == client.attributes["runplane.action"]
        assert served.attributes["http.response.status_code"] == 200
    assert len(servers) >= len(clients)  # each operation answered at least once
    actions = {s.attributes["runplane.action"] for s in servers}
    assert {"runs.register", "sheets.admit", "sheets.complete"} <= actions
    assert {s.context.trace_id for s in spans} == {run_span.context.trace_id}
    admissions = {s.context.span_id for s in named(spans, tracing.SpanName.ADMISSION)}
    admits = [c for c in clients.values() if c.attributes["runplane.action"] == "sheets.admit"]
    assert admits and all(c.parent.span_id in admissions for c in admits)


def test_the_otel_variables_decide_and_a_bad_ratio_is_refused():
    """`OTEL_TRACES_EXPORTER` (not `none`) or an OTLP endpoint turn traces on unless
    `OTEL_SDK_DISABLED=true`; `RUNPLANE_TRACE_ROWS_RATIO` is a number from 0 to 1."""
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_SERVICE_NAME": "x"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"})
    assert tracing.row_ratio({}) == tracing.DEFAULT_ROW_RATIO
    assert tracing.row_ratio({tracing.RATIO_ENV: "0.25"}) == 0.25
    for bad in ("1.5", "-0.1", "often"):
        with pytest.raises(InvalidInputError, match=tracing.RATIO_ENV):
            tracing.row_ratio({tracing.RATIO_ENV: bad})


SCRIPT = """
import json, os, sys, uuid
import trio
from runplane.actors import open_run
from runplane.engine import open_tenant, sheets
from runplane.engine.observability import tracing

async def upper(row):
    return {"upper": row["name"].upper()}

async def main():
    schema = "t_" + uuid.uuid4().hex[:16]
    async with open_tenant("org-test", os.environ["TRACE_TEST_DSN"], schema=schema) as tenant:
        try:
            async with open_run(tenant, "traced") as run:
                result = await run.map("things", [{"name": f"n{i}"} for i in range(10)], upper,
                                       contract=sheets.SheetContract(("name",), ("upper",)))
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    print("RESULT " + json.dumps({"on": tracing.ON, "completed": result.completed,
        "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}), flush=True)

trio.run(main)
"""


def run_script(dsn: str, **env: str) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("OTEL_") and k != tracing.RATIO_ENV}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env={**clean, "TRACE_TEST_DSN": dsn, **env}, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), done.stdout


def json_objects(text: str) -> list[dict]:
    """The JSON objects the console exporter printed (indented, one after another)."""
    text = "\n".join(x for x in text.splitlines() if not x.startswith("RESULT "))
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at >= 0:
        value, end = decoder.raw_decode(text, at)
        found.append(value)
        at = text.find("{", end)
    return found


def test_off_a_run_imports_nothing_of_opentelemetry(dsn):
    """Without the `OTEL_*` variables a whole run (maps, batches, rows) leaves tracing off and
    never imports an `opentelemetry` module."""
    result, _ = run_script(dsn)
    assert result == {"on": False, "completed": 10, "otel": []}


def test_otel_traces_exporter_console_prints_the_runs_spans(dsn):
    """`OTEL_TRACES_EXPORTER=console` (the SDK's own exporter, through its entry point) with
    every row sampled: the run's, map's, batches' and rows' spans come out on stdout, under
    the service name `runplane`."""
    result, stdout = run_script(dsn, OTEL_TRACES_EXPORTER="console",
                                RUNPLANE_TRACE_ROWS_RATIO="1")
    assert result["on"] is True and result["completed"] == 10
    names = [span["name"] for span in json_objects(stdout)]
    for name in tracing.SpanName:
        if name not in (tracing.SpanName.CLIENT, tracing.SpanName.SERVER):
            assert name.value in names
    assert names.count(tracing.SpanName.ROW.value) == 10
    assert '"service.name": "runplane"' in stdout
