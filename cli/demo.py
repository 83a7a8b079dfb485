"""`runplane demo`: the main job — stage synthetic companies, map a fake enrichment tool, retire.

How it works
- The input is `--rows` synthetic companies, generated deterministically from their index, so a
  second `runplane demo` admits byte-identical rows and finds them cached in the sheet.
- The map function stands in for a slow, flaky enrichment tool: it sleeps a random few
  milliseconds and fails about `--fail-rate` of its calls (randomly per call, so a rerun retries
  the failed rows and most of them now succeed).
- The run is hosted by an embedded supervisor (`sup.run`): when the body ends, the run's guard
  retires its staged input; anything it could not finish the supervisor drains.
- The run id and the command that resumes the run are printed before the progress bars start.
- `--crash-after N` cancels the run once N rows were executed: the outcomes already computed are
  flushed (shielded), and the command exits 1 with the resume command on stderr, as any run that
  ends unfinished does; `--resume RUN_ID` wakes that run
  (same epoch), replays its sealed input, and executes only the rows that did not finish.
- Rows the run left failed end the output with a table of the commonest errors.
- Row policies show at work: `--retries N` retries a failed tool call up to N times (a
  `RowRetry` with a short backoff, only for the tool's transient error), so the ~2% failures
  mostly turn into completions; `--rate PER_SECOND` bounds how fast tool calls start (a
  `RateLimit`). The `calls` bar counts tool calls and shows retries and the current call rate
  (calls in the last `RATE_WINDOW_S`).
- Two overlapping demos: the newer run takes the rows, the older one's completions come back
  fenced, and it stops early and says which run superseded it.
- Live progress uses rich progress bars (admitted, executed, completed, failed, cached, calls);
  the final summary is a rich table. While the run waits for the database (a store outage,
  ridden out for `RUNPLANE_OUTAGE_BUDGET_S`, see `actors.retry`), a line says "waiting for the
  database (N s)" (and again every `WAIT_REPORT_S`), and another when it is back; a longer
  outage ends the run with `StoreOutageError` and the resume command.
"""

from __future__ import annotations

import argparse
import collections
import random
import time
import attrs
import trio
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn,
                           TimeElapsedColumn)
from rich.table import Table
from rich.text import Text

from runplane.actors import (MapOptions, MapProgress, MapResult, RateLimit, RowRetry, Run,
                             open_supervisor)
from runplane.actors.retry import OutageWatch
from runplane.engine import RunScope, runs, sheets
from runplane.engine.errors import unwrap_single_error

from .connect import open_port
from .operators import RunCancelled, RunUnfinished, UsageError, print_failure_summary
from .progress import show_waiting_row, waiting_text
from .terminal import clean, say

PLAY = "demo"
TABLE = "companies"
CONTRACT = sheets.SheetContract(
    inputs=("name", "domain", "country", "employees"),
    outputs=("industry", "revenue_band", "score"),
)
INDUSTRIES = ("software", "logistics", "biotech", "retail", "energy", "finance", "media")
COUNTRIES = ("US", "DE", "FR", "GB", "JP", "BR", "IN", "CA")
SYLLABLES = ("ac", "me", "zo", "ra", "ly", "ten", "vo", "qua", "nix", "par", "do", "sy")
WAIT_POLL_S = 0.5     # how often the progress display looks at the run's outage watch
WAIT_REPORT_S = 5.0   # a new "waiting for the database" line this often while waiting
RATE_WINDOW_S = 1.0  # the calls bar's rate: calls started in about the last second


def company(index: int) -> dict:
    """The synthetic company number `index` (the same every time)."""
    rng = random.Random(index)
    name = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()
    return {
        "name": f"{name} {index}",
        "domain": f"{name.lower()}{index}.example",
        "country": rng.choice(COUNTRIES),
        "employees": rng.randrange(1, 50_000),
    }


def companies(rows: int) -> list[dict]:
    return [company(index) for index in range(rows)]


class EnrichmentUnavailable(Exception):
    """The fake tool's transient failure."""


@attrs.define(eq=False)
class FakeEnrichment:
    """A fake enrichment tool: random latency, random failures."""

    latency_s: float
    fail_rate: float
    rng: random.Random = attrs.field(factory=random.Random)
    calls: int = 0

    async def __call__(self, row: dict) -> dict:
        self.calls += 1
        await trio.sleep(self.rng.uniform(0, 2 * self.latency_s))
        if self.rng.random() < self.fail_rate:
            raise EnrichmentUnavailable("enrichment API timed out")
        digest = sum(map(ord, row["domain"]))
        employees = row["employees"]
        band = "<1M" if employees < 50 else "1M-50M" if employees < 2_000 else ">50M"
        return {"industry": INDUSTRIES[digest % len(INDUSTRIES)], "revenue_band": band,
                "score": round((digest % 1000) / 10, 1)}


@attrs.define(eq=False)
class LiveBars:
    """rich progress bars fed by the map's progress snapshots."""

    progress: Progress
    total: int
    tasks: dict[str, TaskID] = attrs.field(factory=dict)
    last: MapProgress | None = None
    waiting_task: TaskID | None = None
    recent: collections.deque = attrs.field(factory=collections.deque)  # (time, calls)

    @classmethod
    def create(cls, console: Console, total: int) -> "LiveBars":
        progress = Progress(
            TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=console,
            transient=False,
        )
        bars = cls(progress, total)
        for name in ("admitted", "executed", "completed", "failed", "cached", "calls"):
            bars.tasks[name] = progress.add_task(name, total=total, note="")
        return bars

    def call_rate(self, calls: int) -> float:
        """Calls a second over about the last `RATE_WINDOW_S`."""
        now = time.monotonic()
        self.recent.append((now, calls))
        while len(self.recent) > 2 and now - self.recent[1][0] >= RATE_WINDOW_S:
            self.recent.popleft()
        then, before = self.recent[0]
        return (calls - before) / (now - then) if now > then else 0.0

    def update(self, snapshot: MapProgress) -> None:
        self.last = snapshot
        for name, task in self.tasks.items():
            if name != "calls":
                self.progress.update(task, completed=getattr(snapshot, name))
        running = max(0, snapshot.pending - snapshot.executed)  # rows in flight
        self.progress.update(self.tasks["admitted"], note=f"{running:,} running")
        note = f"{snapshot.retried} retries, {self.call_rate(snapshot.calls):,.0f} calls/s"
        if snapshot.superseded:
            note += ", superseded: stopping"
        self.progress.update(self.tasks["calls"], completed=snapshot.calls,
                             total=max(self.total, snapshot.calls), note=note)


    def _line(self, text: str) -> None:
        self.progress.console.print(Text(text))

    async def follow_outages(self, watch: OutageWatch) -> None:
        """Show "waiting for the database (N s)" while the run waits for it (until cancelled)."""
        reported: float | None = None  # the wait length last printed
        longest = 0.0
        while True:
            waited = watch.waiting_s()
            if waited is not None:
                longest = waited
                self.waiting_task = show_waiting_row(self.progress, self.waiting_task, waited)
                if reported is None or waited - reported >= WAIT_REPORT_S:
                    reported = waited
                    self._line(f"demo: {waiting_text(waited, watch.budget_s)}")
            elif reported is not None:
                self._line(f"demo: the database is back after {longest:.0f} s; resuming")
                self.waiting_task = show_waiting_row(self.progress, self.waiting_task, None)
                reported = None
            await trio.sleep(WAIT_POLL_S)


def row_policies(args: argparse.Namespace) -> MapOptions:
    """`run.map`'s row policies from `--retries`, `--rate` and `--force`."""
    retries = getattr(args, "retries", 0)
    retry = RowRetry(max_attempts=retries + 1, initial_s=0.05, max_interval_s=1.0,
                     retry_on=(EnrichmentUnavailable,)) if retries else None
    rate = getattr(args, "rate", None)
    return MapOptions(retry=retry, rate_limit=None if rate is None else RateLimit(rate),
                      force=True if getattr(args, "force", False) else None)


def summary_table(title: str, rows: list[tuple[str, object]]) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, Text(clean(value)))  # plain text: no markup, no control characters
    return table


async def run_demo(args: argparse.Namespace, console: Console) -> int:
    """Run the demo; return how many rows this run left failed."""
    rows = companies(args.rows)
    tool = FakeEnrichment(latency_s=args.latency_ms / 1000, fail_rate=args.fail_rate)
    crash = trio.CancelScope()
    bars = LiveBars.create(console, len(rows))

    def on_progress(snapshot: MapProgress) -> None:
        bars.update(snapshot)
        if args.crash_after is not None and snapshot.executed >= args.crash_after:
            crash.cancel()

    result: MapResult | None = None
    run_ref: dict[str, Run] = {}

    async def body(run: Run) -> MapResult:
        run_ref["run"] = run
        with unwrap_single_error():  # the map's own error, not a group of one
            async with trio.open_nursery() as nursery:
                # From the body's first store call: an outage while the start notice is
                # recorded shows as one too (the notice's line is printed before it waits).
                nursery.start_soon(bars.follow_outages, run.outage)
                try:
                    await args.notice.started(run)  # a plain line before the bars take the terminal
                    with bars.progress:
                        return await run.map(TABLE, rows, tool, contract=CONTRACT,
                                             options=row_policies(args),
                                             concurrency=args.concurrency, on_progress=on_progress,
                                             fail_fast=False)  # its failures are random by design
                finally:
                    nursery.cancel_scope.cancel()

    started = time.perf_counter()
    async with open_port(args) as tenant:  # a tenant, or a gateway with --gateway
        if args.resume is not None and await runs.get(
                tenant, RunScope(tenant.org_id, PLAY, args.resume)) is None:
            raise UsageError(f"no run {args.resume!r} of play {PLAY!r} to resume")
        async with open_supervisor(tenant) as sup:
            # A simulated crash cancels the run from outside, as a killed process would: the
            # run ends non-terminally and keeps its staged input for `--resume`.
            with crash:
                result = await sup.run(PLAY, body, run_id=args.resume)
        elapsed = time.perf_counter() - started
        run = run_ref["run"]
        if result is None:
            executed = bars.last.executed if bars.last else 0
            say(f"demo: crashed after {executed} executed rows (simulated); run id {run.run_id}")
            raise RunUnfinished(f"run {run.run_id} stopped after {executed} executed rows "
                                "(--crash-after: a simulated crash)")
        summary = await sheets.summary(tenant, run.scope.play_scope, TABLE)
        console.print(_summary(run, len(rows), result, bars, elapsed, summary))
        say(f"demo: run {run.run_id} admitted {result.admitted} cached {result.cached} "
            f"executed {result.executed} completed {result.completed} failed {result.failed}")
        if result.retried:
            say(f"demo: {result.retried} retried tool calls")
        if run.cancelled:
            raise RunCancelled(run.run_id)
        if result.superseded:
            say(f"demo: run {run.run_id} was superseded by run "
                f"{result.superseded_by or '(id unknown)'}: it stopped early and left the "
                "remaining rows to that run")
        failed = await print_failure_summary(tenant, run.scope.play_scope, run.run_id)
    say("run retired; run `runplane demo` again to see the cache")
    return failed



def _summary(run: Run, source_rows: int, result: MapResult, bars: LiveBars, elapsed: float,
             summary: sheets.Summary):
    """The demo's closing table: what the run did, how fast, and the sheet after it."""
    return summary_table("runplane demo", [
        ("run id", run.run_id),
        ("epoch", run.epoch),
        ("source rows", source_rows),
        ("admitted", result.admitted),
        ("cached", result.cached),
        ("executed", result.executed),
        ("completed", result.completed),
        ("failed", result.failed),
        ("blocked", result.blocked),
        ("fenced", result.fenced),
        ("tool calls", bars.last.calls if bars.last else 0),
        ("retried", result.retried),
        *([("superseded by", result.superseded_by or "a newer run")]
          if result.superseded else []),
        ("elapsed s", f"{elapsed:.2f}"),
        ("rows/s", f"{source_rows / elapsed:,.0f}" if elapsed > 0 else "-"),
        ("sheet total", summary.total),
        ("sheet enriched", summary.completed),
        ("sheet failed", summary.failed),
    ])
