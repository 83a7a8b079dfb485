"""Every surface tells the same truth about a run (§27, §35 "running"; issue 35): one play, three
runs over one table, read through every surface after each run and compared.

- Run 1: 40 rows; 5 fail for good (their message names the row's own input value), 4 raise a
  retried error once and then succeed.
- Run 2 (same play and table, no force): the same 40 rows plus 60 new ones: run 1's completed
  rows are cache hits, its failed rows re-run (each raises once, is retried, succeeds); 3 new
  rows fail, 4 new rows raise once and are retried. 20 new rows are held inside a call, and the
  run is then interrupted the way `runplane run` handles Ctrl-C (`cli.commands.run_trio`
  cancels the scope around the tenant and the run), in this process.
- Run 3: a new run (no force) to completion: run 1's and run 2's completed rows are cache hits.

Surfaces read for each run: `MapResult` (runs 1 and 3), the progress log line (`cli.progress`,
from the snapshots the bars show), the run history (`engine.history.list_maps`), `runplane runs
--json` and `runplane runs PLAY RUN_ID --json`, `runplane failures --run RUN --json`, the
console's runs list (`/ui/api/runs`), a run's API (`/ui/api/runs/<play>/<run>`) and its live
stream (`/ui/live/runs/<play>/<run>`); for the table: `cli.status.read_counts`, `runplane status
--json`, the console's sheet counters, against `COUNT(*)` by `_status` of the sheet.

Must hold: the same admitted/cached/completed/failed/retried for a run on every surface (and equal
to what the function itself saw); retried counts only that run's retries; an interrupted run's
history `completed` is what the next run finds cached from it; sheet counters equal `COUNT(*)`;
"running" is 0 everywhere once no process runs; rows/s never negative.
"""

from __future__ import annotations

import collections
import io
import json
import re
from typing import Any

import attrs
import pytest
import trio

from runplane.actors import RowRetry, open_run
from runplane.cli import main
from runplane.cli.progress import RunProgress, progress_line, with_progress
from runplane.cli.status import read_counts
from runplane.engine import open_tenant
from runplane.engine.runs import history
from runplane.engine.gateway import mint_token
from runplane.engine.values.scopes import PlayScope
from runplane.engine.sheets import SheetContract
from runplane.engine.sheets.layout import layout_for

from .cli_helpers import schema  # noqa: F401 - fixture
from .console_support import client, login_token
from .gateway_support import SECRET, serving

ORG = "local"  # the command line's default org
PLAY = "agree"
TABLE = "things"
CONTRACT = SheetContract(inputs=("name",), outputs=("upper",))
RETRY = RowRetry(max_attempts=3, initial_s=0.0, jitter=False, retry_on=(ConnectionError,))
FIGURES = ("admitted", "cached", "completed", "failed", "retried")
IN_CALL = 20  # run 2's rows held inside a call when it is interrupted


def names(prefix: str, numbers) -> list[str]:
    return [f"{prefix}{i:03d}" for i in numbers]


RUN1_ROWS = names("r", range(40))
RUN2_ROWS = RUN1_ROWS + names("n", range(60))
RUN1_FAIL = set(names("r", (3, 11, 19, 27, 35)))
RUN1_FLAKY = set(names("r", (6, 16, 26, 36)))
RUN2_FAIL = set(names("n", (7, 22, 37, 52)))
RUN2_FLAKY = RUN1_FAIL | set(names("n", (4, 14, 24, 34, 44, 54)))
RUN2_HELD = set(names("n", range(40, 60)))
RUN3_FAIL = set(names("n", (22, 37, 52)))  # n007 is fixed by run 3 (after one retry)
RUN3_FLAKY = set(names("n", (7, 44, 54)))


@attrs.define(eq=False)
class Behaviour:
    """The map function of one run, and what it saw: the truth the surfaces are checked against."""

    fail: set[str]
    flaky: set[str]
    held: set[str] = attrs.field(factory=set)
    calls: collections.Counter = attrs.field(factory=collections.Counter)
    raised_once: set[str] = attrs.field(factory=set)
    returned: set[str] = attrs.field(factory=set)
    failed: set[str] = attrs.field(factory=set)
    holding: int = 0
    changed: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, row: dict) -> dict:
        name = row["name"]
        self.calls[name] += 1
        try:
            if name in self.held:
                self.holding += 1
                self._changed()
                try:
                    await trio.sleep_forever()
                finally:
                    self.holding -= 1
            await trio.sleep(0.002)
            if name in self.fail:
                self.failed.add(name)
                raise ValueError(f"no data for {name}")
            if name in self.flaky and name not in self.raised_once:
                self.raised_once.add(name)
                raise ConnectionError(f"connection reset while fetching {name}")
            self.returned.add(name)
            return {"upper": name.upper()}
        finally:
            self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def settled(self, expected_outcomes: int) -> bool:
        return (len(self.returned) + len(self.failed) == expected_outcomes
                and self.holding == len(self.held))

    def truth(self, cached: int, admitted: int) -> dict[str, int]:
        retried = sum(1 for name in self.raised_once if self.calls[name] >= 2)
        return {"admitted": admitted, "cached": cached, "completed": len(self.returned),
                "failed": len(self.failed), "retried": retried}


# -- reading the surfaces ---------------------------------------------------------------------
LINE = re.compile(r"progress things: ([\d,]+)/([\d,]+) rows \(admitted ([\d,]+), running "
                  r"(-?[\d,]+), completed ([\d,]+), failed ([\d,]+), cached ([\d,]+), retries "
                  r"([\d,]+)\); (-?[\d,]+) rows/s, ETA (.+)")


def parse_line(line: str) -> dict[str, int]:
    match = LINE.fullmatch(line)
    assert match, line
    n = [int(g.replace(",", "")) for g in match.groups()[:9]]
    return {"admitted": n[2], "running": n[3], "completed": n[4], "failed": n[5],
            "cached": n[6], "retried": n[7], "rate": n[8]}


def log_lines(progress: RunProgress, log: io.StringIO) -> list[dict[str, int]]:
    """The progress lines the run printed (the last one once it ended); a run too short to
    print one is given the line its bars' last snapshot makes (the same function prints both)."""
    lines = [line for line in log.getvalue().splitlines() if line.startswith("progress ")]
    if not lines:
        snapshot = progress.latest[TABLE]
        lines = [progress_line(TABLE, snapshot, progress.total(snapshot),
                               progress.rates[TABLE].rate())]
    return [parse_line(line) for line in lines]


def pick(mapping: Any, fields=FIGURES) -> dict[str, int]:
    get = mapping.get if isinstance(mapping, dict) else lambda n: getattr(mapping, n)
    return {name: get(name) for name in fields}


def summed(entries: list[dict]) -> dict[str, int]:
    return {name: sum(e[name] for e in entries) for name in FIGURES}


async def sheet_counts(tenant, run_ids: list[str]) -> dict[str, Any]:
    """COUNT(*) of the sheet by `_status` (and by the run that last wrote each row)."""
    layout = layout_for(tenant, PlayScope(ORG, PLAY), TABLE)
    async with tenant.connection("sheet") as conn:
        records = await conn.fetch(
            f"SELECT _status, _run_id, count(*) AS n FROM {layout.qualified} "
            "GROUP BY _status, _run_id")
    by_status: dict[str, int] = collections.Counter()
    by_run: dict[str, dict[str, int]] = {rid: collections.Counter() for rid in run_ids}
    for r in records:
        by_status[r["_status"]] += r["n"]
        if r["_run_id"] in by_run:
            by_run[r["_run_id"]][r["_status"]] += r["n"]
    return {"total": sum(by_status.values()), "queued": by_status["pending"],
            "leased": by_status["running"], "completed": by_status["enriched"],
            "failed": by_status["failed"], "by_run": {k: dict(v) for k, v in by_run.items()}}


async def logged_in(http) -> None:
    assert (await login_token(http, mint_token(SECRET, ORG))).status_code == 303


async def live_event(http, run_id: str) -> dict:
    """The first `progress` event of a run's live stream."""
    with trio.fail_after(20):
        async with http.stream("GET", f"/ui/live/runs/{PLAY}/{run_id}") as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                if line.startswith("data:"):
                    return json.loads(line[5:])
    raise AssertionError("the live stream ended without an event")


async def read_async_surfaces(tenant, http, run_ids: list[str]) -> dict[str, Any]:
    scope = PlayScope(ORG, PLAY)
    entries = await history.list_maps(tenant, scope, run_ids)
    counts = (await read_counts(tenant, scope, TABLE))[TABLE]
    listed = (await http.get("/ui/api/runs")).json()["runs"]
    pages, events = {}, {}
    for rid in run_ids:
        got = await http.get(f"/ui/api/runs/{PLAY}/{rid}")
        assert got.status_code == 200, got.text
        pages[rid] = got.json()
        events[rid] = await live_event(http, rid)
    failures = await http.get(f"/ui/api/failures/{PLAY}/{TABLE}")
    assert failures.status_code == 200, failures.text
    return {"history": {rid: [attrs.asdict(e.record) for e in entries if e.run_id == rid]
                        for rid in run_ids},
            "console_failures": failures.json(),
            "read_counts": attrs.asdict(counts), "sheet": await sheet_counts(tenant, run_ids),
            "console_list": {r["run_id"]: r for r in listed if r["play"] == PLAY},
            "console_run": pages, "console_live": events}


def cli_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def read_surfaces(dsn: str, schema: str, capsys, run_ids: list[str]) -> dict[str, Any]:
    """Every surface, read with no process running the play."""
    async def inner() -> dict[str, Any]:
        with trio.fail_after(60):
            async with open_tenant(ORG, dsn, schema=schema) as tenant, \
                    serving(tenant) as server, client(server.url) as http:
                await logged_in(http)
                return await read_async_surfaces(tenant, http, run_ids)

    got = trio.run(inner)
    got["cli_runs"] = {r["run_id"]: r for r in cli_json(capsys, "runs", PLAY,
                                                         "--schema", schema)["runs"]}
    got["cli_run"] = {rid: cli_json(capsys, "runs", PLAY, rid, "--schema", schema)
                      for rid in run_ids}
    got["cli_status"] = cli_json(capsys, "status", PLAY, "--schema", schema)
    got["cli_failures"] = {rid: cli_json(capsys, "failures", PLAY, TABLE, "--run", rid,
                                         "--schema", schema) for rid in run_ids}
    got["cli_failures_table"] = cli_json(capsys, "failures", PLAY, TABLE, "--schema", schema)
    return got


def run_figures(got: dict[str, Any], rid: str) -> dict[str, dict[str, int]]:
    """One run's figures on each surface that shows them."""
    live = got["console_live"][rid]["tables"]
    return {
        "history": summed(got["history"][rid]),
        "runs --json": pick(got["cli_runs"][rid]),
        "runs RUN --json": summed(got["cli_run"][rid]["maps"]),
        "console /ui/api/runs": pick(got["console_list"][rid]["figures"]),
        "console /ui/api/runs/<run>": summed(got["console_run"][rid]["maps"]),
        "console live": summed(live),
    }


def sheet_figures(got: dict[str, Any]) -> dict[str, dict[str, int]]:
    keys = ("total", "queued", "leased", "completed", "failed")
    status = got["cli_status"]["tables"][TABLE]
    found = {"COUNT(*)": pick(got["sheet"], keys), "read_counts": pick(got["read_counts"], keys),
             "status --json": pick(status, keys)}
    for rid, page in got["console_run"].items():
        for m in page["maps"]:
            if m["sheet"] is not None:
                found[f"console run {rid[-4:]} sheet"] = pick(m["sheet"], keys)
    for rid, event in got["console_live"].items():
        for t in event["tables"]:
            if t["sheet"] is not None:
                found[f"console live {rid[-4:]} sheet"] = pick(t["sheet"], keys)
    return found


def running_figures(got: dict[str, Any]) -> dict[str, int]:
    """'running' (rows inside a call now) wherever it is shown."""
    found = {"read_counts": got["read_counts"]["running"],
             "status --json": got["cli_status"]["tables"][TABLE]["running"]}
    for rid in got["console_run"]:
        tail = rid[-4:]
        found[f"history {tail}"] = sum(e["running"] for e in got["history"][rid])
        found[f"console list {tail} in_flight"] = got["console_list"][rid]["figures"]["in_flight"]
        for m in got["console_run"][rid]["maps"]:
            found[f"console run {tail} in_flight"] = m["in_flight"]
            if m["sheet"] is not None:
                found[f"console run {tail} sheet"] = m["sheet"]["running"]
        for t in got["console_live"][rid]["tables"]:
            found[f"console live {tail} in_flight"] = t["in_flight"]
            if t["running"] is not None:
                found[f"console live {tail}"] = t["running"]
    return found


# -- the runs -----------------------------------------------------------------------------------
@attrs.define
class Ran:
    run_id: str
    behaviour: Behaviour
    log: dict[str, int]  # its last progress line
    lines: list[dict[str, int]]  # every progress line it printed
    result: Any = None  # MapResult, None for the interrupted run
    mid_run: dict[str, Any] | None = None  # run 2: 'running' on each surface while rows wait
    live: list[dict] = attrs.Factory(list)  # run 2: its live stream's events, start to end
    live_after_end: list[dict] = attrs.Factory(list)  # ... the ones read once it was stopped


async def mapped(run, rows: list[str], behaviour: Behaviour, holder: dict[str, Any]) -> None:
    """`run.map` the rows under the command line's progress (log lines, not bars); `holder`
    gets the `result` and the last progress `log` line (also when the map is cancelled)."""
    log = io.StringIO()
    progress = RunProgress(stream=log, interval_s=0.2, input_rows=len(rows), live=False)
    try:
        holder["result"] = await with_progress(run, progress, lambda: run.map(
            TABLE, [{"name": n} for n in rows], behaviour, contract=CONTRACT, retry=RETRY,
            concurrency=len(rows)))  # every row its own worker: held rows hold only themselves
    finally:
        holder["lines"] = log_lines(progress, log)
        holder["log"] = holder["lines"][-1]


def complete_run(dsn: str, schema: str, rows: list[str], behaviour: Behaviour) -> Ran:
    async def inner() -> Ran:
        with trio.fail_after(60):
            async with open_tenant(ORG, dsn, schema=schema) as tenant:
                async with open_run(tenant, PLAY) as run:
                    got: dict[str, Any] = {}
                    await mapped(run, rows, behaviour, got)
        return Ran(run.run_id, behaviour, got["log"], got["lines"], got["result"])

    return trio.run(inner)


def interrupted_run(dsn: str, schema: str, rows: list[str], behaviour: Behaviour,
                    outcomes: int) -> Ran:
    """Run 2: once the function has given `outcomes` rows an outcome and holds its held rows,
    read 'running' on the live surfaces, then cancel the scope around the tenant and the run
    (what `runplane run` does on Ctrl-C)."""
    async def inner() -> Ran:
        ran: dict[str, Any] = {}
        started = trio.Event()
        with trio.fail_after(60):
            async with open_tenant(ORG, dsn, schema=schema) as reader, \
                    serving(reader) as server, client(server.url) as http:
                await logged_in(http)
                work = trio.CancelScope()

                async def body() -> None:
                    with work:
                        async with open_tenant(ORG, dsn, schema=schema) as tenant:
                            async with open_run(tenant, PLAY) as run:
                                ran["run_id"] = run.run_id
                                started.set()
                                await mapped(run, rows, behaviour, ran)
                    ran["cancelled"] = work.cancelled_caught

                events: list[dict] = []
                ran["live"] = events
                ended = trio.Event()
                after_end = trio.Event()

                async def watch() -> None:  # the run's live stream, from start to past its end
                    seen_after_end = 0
                    async with http.stream("GET", f"/ui/live/runs/{PLAY}/{ran['run_id']}") as st:
                        assert st.status_code == 200
                        async for line in st.aiter_lines():
                            if line.startswith("data:"):
                                events.append(json.loads(line[5:]))
                                seen_after_end += ended.is_set()
                                if seen_after_end == 2:
                                    after_end.set()
                                    return

                async with trio.open_nursery() as nursery:
                    async with trio.open_nursery() as running:
                        running.start_soon(body)
                        await started.wait()
                        nursery.start_soon(watch)
                        while not behaviour.settled(outcomes):
                            await behaviour.changed.wait()
                        ran["mid_run"] = await running_mid_run(reader, http, ran["run_id"])
                        work.cancel()
                    ended.set()
                    ran["live_after_end"] = len(events)
                    await after_end.wait()
        return ran

    ran = trio.run(inner)
    assert ran["cancelled"], "the run ended before it was interrupted"
    return Ran(ran["run_id"], behaviour, ran["log"], ran["lines"], None, ran["mid_run"],
               ran["live"], ran["live"][ran["live_after_end"]:])


async def running_mid_run(tenant, http, run_id: str) -> dict[str, Any]:
    """'running' while `IN_CALL` rows are inside a call: polled (each surface is written at
    least every few seconds) until every surface reads `IN_CALL`, or 10 s pass; the last
    reading either way."""
    scope = PlayScope(ORG, PLAY)
    seen: dict[str, int] = {}
    with trio.move_on_after(10):
        while True:
            counts = (await read_counts(tenant, scope, TABLE))[TABLE]
            entries = await history.list_maps(tenant, scope, [run_id])
            page = (await http.get(f"/ui/api/runs/{PLAY}/{run_id}")).json()
            listed = {r["run_id"]: r for r in (await http.get("/ui/api/runs")).json()["runs"]}
            seen = {"read_counts": counts.running,
                    "history": sum(e.record.running for e in entries),
                    "console list in_flight": listed[run_id]["figures"]["in_flight"],
                    "console run in_flight": sum(m["in_flight"] for m in page["maps"]),
                    "console run sheet": sum(m["sheet"]["running"] for m in page["maps"]
                                             if m["sheet"] is not None)}
            if all(v == IN_CALL for v in seen.values()):
                break
            await trio.sleep(0.25)
    return seen


# -- the test -----------------------------------------------------------------------------------
def test_every_surface_agrees_through_failures_retries_cache_hits_and_an_interruption(
        dsn, schema, capsys):  # noqa: F811 - fixture
    report: list[str] = []

    def agree(what: str, found: dict[str, dict[str, int]], want: dict[str, int] | None = None):
        """Every surface in `found` shows the same figures (and `want`, when given)."""
        report.append(f"{what}:")
        for surface, figures in found.items():
            report.append(f"  {surface:<34} {figures}")
        values = list(found.values()) + ([want] if want is not None else [])
        assert all(v == values[0] for v in values), (what, found, want)

    # Run 1: failures (messages naming the row's input) and retries, to completion.
    first = complete_run(dsn, schema, RUN1_ROWS,
                         Behaviour(fail=set(RUN1_FAIL), flaky=set(RUN1_FLAKY)))
    truth1 = first.behaviour.truth(cached=0, admitted=len(RUN1_ROWS))
    assert truth1 == {"admitted": 40, "cached": 0, "completed": 35, "failed": 5, "retried": 4}
    after1 = read_surfaces(dsn, schema, capsys, [first.run_id])
    agree("run 1", {"MapResult": pick(first.result), "log line": pick(first.log),
                    **run_figures(after1, first.run_id)}, truth1)

    # Run 2: cache hits, re-run failures, retries, and an interruption with rows in a call.
    behaviour2 = Behaviour(fail=set(RUN2_FAIL), flaky=set(RUN2_FLAKY), held=set(RUN2_HELD))
    to_call = [n for n in RUN2_ROWS if n not in first.behaviour.returned]
    second = interrupted_run(dsn, schema, RUN2_ROWS, behaviour2,
                             outcomes=len([n for n in to_call if n not in RUN2_HELD]))
    truth2 = behaviour2.truth(cached=len(first.behaviour.returned), admitted=len(RUN2_ROWS))
    assert truth2 == {"admitted": 100, "cached": 35, "completed": 42, "failed": 3, "retried": 9}
    report.append(f"run 2 mid-run 'running' ({IN_CALL} rows in a call): {second.mid_run}")
    after2 = read_surfaces(dsn, schema, capsys, [first.run_id, second.run_id])
    agree("run 2 (interrupted)", {"log line (last)": pick(second.log),
                                  **run_figures(after2, second.run_id)}, truth2)
    agree("run 1, after run 2", run_figures(after2, first.run_id), truth1)

    # Run 3: a new run to completion; what run 2 completed is cached.
    done_before = first.behaviour.returned | behaviour2.returned
    third = complete_run(dsn, schema, RUN2_ROWS,
                         Behaviour(fail=set(RUN3_FAIL), flaky=set(RUN3_FLAKY)))
    truth3 = third.behaviour.truth(cached=len(done_before), admitted=len(RUN2_ROWS))
    assert truth3 == {"admitted": 100, "cached": 77, "completed": 20, "failed": 3, "retried": 3}
    ids = [first.run_id, second.run_id, third.run_id]
    after3 = read_surfaces(dsn, schema, capsys, ids)
    agree("run 3", {"MapResult": pick(third.result), "log line": pick(third.log),
                    **run_figures(after3, third.run_id)}, truth3)
    agree("run 2, after run 3", run_figures(after3, second.run_id), truth2)
    agree("run 1, after run 3", run_figures(after3, first.run_id), truth1)

    # The interrupted run's completed rows are what the next run finds cached from it: run 3's
    # cache hits are run 1's completed rows (all re-cached by run 2) and run 2's completions.
    run2_completed = summed(after3["history"][second.run_id])["completed"]
    run2_cached = summed(after3["history"][second.run_id])["cached"]
    assert third.result.cached == run2_cached + run2_completed, (third.result, run2_completed)
    assert after3["sheet"]["by_run"][second.run_id].get("enriched", 0) == run2_completed, \
        after3["sheet"]["by_run"]

    # The table's counters equal COUNT(*) by status on every surface, after every run.
    for label, got in (("after run 1", after1), ("after run 2", after2),
                       ("after run 3", after3)):
        agree(f"sheet counters {label}", sheet_figures(got))
    assert pick(after3["sheet"], ("total", "queued", "leased", "completed", "failed")) == {
        "total": 100, "queued": 0, "leased": 0, "completed": 97, "failed": 3}
    # What each run still holds unfinished (`runs --json`) is its rows with no outcome.
    for got in (after1, after2, after3):
        for rid, held in got["sheet"]["by_run"].items():
            unfinished = held.get("pending", 0) + held.get("running", 0)
            report.append(f"unfinished {rid[-4:]}: runs --json {got['cli_runs'][rid]['unfinished']}"
                          f", COUNT(*) {unfinished}")
            assert got["cli_runs"][rid]["unfinished"] == unfinished, (rid, held)

    # `failures --run R` right after R: its failed rows, grouped into one cause though each
    # message names its own input value.
    for got, rid, failed in ((after1, first.run_id, 5), (after2, second.run_id, 3),
                             (after3, third.run_id, 3)):
        listing = got["cli_failures"][rid]
        report.append(f"failures --run {rid[-4:]}: failed {listing['failed']}, errors "
                      f"{[(e['count'], e['pattern']) for e in listing['errors']]}")
        assert listing["failed"] == failed, listing
        assert [e["count"] for e in listing["errors"]] == [failed], listing["errors"]
    # The table's failed rows and their causes: `failures --json` and the console's failures
    # API group them alike, and count what the sheet holds.
    for label, got in (("after run 1", after1), ("after run 2", after2),
                       ("after run 3", after3)):
        cli, console = got["cli_failures_table"], got["console_failures"]
        found = {"COUNT(*)": [("*", got["sheet"]["failed"])],
                 "failures --json": [(e["pattern"], e["count"]) for e in cli["errors"]],
                 "console /ui/api/failures": [(c["pattern"], c["count"])
                                              for c in console["causes"]]}
        report.append(f"failed rows by cause {label}: {found}; failures --json failed "
                      f"{cli['failed']}, console failures page rows {len(console['rows'])}")
        assert found["failures --json"] == found["console /ui/api/failures"], found
        assert len(found["console /ui/api/failures"]) == 1, found
        assert (cli["failed"] == len(console["rows"]) == got["sheet"]["failed"]
                == found["failures --json"][0][1]), (label, found)

    # "running" is 0 everywhere once no process runs the play; rows/s is never negative.
    for label, got in (("after run 1", after1), ("after run 2", after2),
                       ("after run 3", after3)):
        running = running_figures(got)
        report.append(f"running {label}: {running}")
        assert set(running.values()) == {0}, (label, running)
        rates = {rid[-4:]: [t["rate"] for t in e["tables"]]
                 for rid, e in got["console_live"].items()}
        report.append(f"console live rows/s {label}: {rates}")
        assert all(r >= 0 for rs in rates.values() for r in rs), rates
    for ran in (first, second, third):
        assert all(line["rate"] >= 0 and line["running"] >= 0 for line in ran.lines), ran.lines
    report.append(f"run 2 log lines (rows/s, running): "
                  f"{[(line['rate'], line['running']) for line in second.lines]}")
    live_rates = [t["rate"] for e in second.live for t in e["tables"]]
    report.append(f"run 2 live stream rows/s over {len(second.live)} events: {live_rates}")
    assert live_rates and min(live_rates) >= 0, live_rates
    # The stream read once the interrupted run's process had stopped: its own figures, and
    # nothing running.
    last = second.live_after_end[-1]["tables"]
    report.append(f"run 2 live stream once stopped: {last}")
    assert summed(last) == truth2, last
    assert [(t["in_flight"], t["running"]) for t in last] == [(0, 0)], last
    for ran in (first, third):
        assert ran.log["running"] == 0, ran.log
    # The progress line `runplane run` prints once a Ctrl-C'd map has stopped (and the bars'
    # last note) shows nothing running: the last call to end reports at once (`CallGauge`).
    assert second.log["running"] == 0, second.log
    # While rows were inside a call, every surface showed them as running.
    assert set(second.mid_run.values()) == {IN_CALL}, second.mid_run

    states = {rid[-4:]: {"runs RUN --json": [m["state"] for m in after3["cli_run"][rid]["maps"]],
                         "console run": [m["state"] for m in after3["console_run"][rid]["maps"]],
                         "console list": after3["console_list"][rid]["state"],
                         "runs --json": after3["cli_runs"][rid]["state"]}
              for rid in ids}
    report.append(f"states after run 3: {states}")
    with capsys.disabled():
        print("\n" + "\n".join(report))
