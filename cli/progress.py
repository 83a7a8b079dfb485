"""Progress of `runplane run` and `runplane status --watch`.

How it works
- `RunProgress` follows every map of a run (`run.observe_progress`). When stderr is a terminal
  it shows live rich bars on stderr, one per map: rows settled of the rows to do, rate, time
  left, and the counts (admitted, running — rows inside a call of the function now —
  completed, failed, cached, retries). Otherwise (a log, CI) it writes one plain line per map
  every `interval_s` seconds (10 by default), and a last one when the run ends if it printed
  any (a run shorter than that prints none). The total is the input's length when the play
  was handed one (a list, an input file), else the rows the map's source yielded so far.
- While the run waits for the database (`run.outage`: a store outage it rides out within its
  budget), the progress says so, as `runplane demo` does: a bar "waiting for the database
  (N s)" on a terminal, checked every `SAMPLE_S`; in a log, a line "progress: waiting for the
  database (N s); the outage budget is B s" with each block of progress lines. (The log's
  warning still marks the wait's start and end at once.)
- `Rates` turns successive counts into rows a second: completions (rows given an outcome,
  completed or failed) over the last `WINDOW_S` seconds (over the time sampled, while that is
  shorter), never negative, 0 when none; the time left comes from it (none while it is 0).
  `RunProgress` samples each map's count every `SAMPLE_S`, whatever it prints when, so its
  first log line already shows the rate of the seconds before it.
- `watch_status` is `runplane status PLAY --watch`: every second it reads the play's sheet
  counters and its rows in a call (`engine.runs.row_calls`) from the database, and shows each table with its rate and time left (a redrawn screen on a terminal,
  a block of lines a refresh otherwise), until interrupted.
- stdout stays the command's: progress never writes there.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import TYPE_CHECKING, Awaitable, Callable, TextIO, TypeVar

import attrs
import trio

from runplane.actors import MapProgress, Run
from runplane.actors.retry import OutageWatch

from runplane.engine.observability import logs

from .terminal import clean, write

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

T = TypeVar("T")

WINDOW_S = 60.0  # rows/s: completions over the last minute (§27)
SAMPLE_S = 1.0  # a run's progress samples each map's completions this often


def settled(snapshot: MapProgress) -> int:
    return snapshot.completed + snapshot.failed + snapshot.cached + snapshot.blocked


def completions(snapshot: MapProgress) -> int:
    """Rows given an outcome (what rows/s counts)."""
    return snapshot.completed + snapshot.failed


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f} s"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def waiting_text(waited_s: float, budget_s: float) -> str:
    """What a command shows while its run waits for the database (`run.outage`)."""
    return f"waiting for the database ({waited_s:.0f} s); the outage budget is {budget_s:g} s"


def show_waiting_row(progress: "Progress", task: "TaskID | None", waited_s: float | None,
                     note: str = "") -> "TaskID | None":
    """Show the bars' row "waiting for the database (N s)" while `waited_s` is a number, hide
    it when None; returns the row's task (added at the first wait) to pass the next time."""
    if waited_s is None:
        if task is not None:
            progress.update(task, visible=False)
        return task
    label = f"waiting for the database ({waited_s:.0f} s)"
    if task is None:
        task = progress.add_task(label, total=None, note=note)
    progress.update(task, description=label, visible=True, note=note)
    return task


@attrs.define(eq=False)
class Rates:
    """Rows a second of a growing count, over the last `WINDOW_S` seconds of samples."""

    clock: Callable[[], float] = time.monotonic
    samples: collections.deque = attrs.field(factory=collections.deque)

    def add(self, count: int) -> float:
        """Sample `count` now; the rate with it."""
        now = self.clock()
        self.samples.append((now, count))
        while len(self.samples) > 2 and now - self.samples[1][0] >= WINDOW_S:
            self.samples.popleft()  # the oldest kept sample is the one at the window's edge
        return self.rate()

    def rate(self) -> float:
        """Rows a second between the oldest kept sample and the latest (0 with one sample)."""
        if len(self.samples) < 2:
            return 0.0
        (then, before), (now, count) = self.samples[0], self.samples[-1]
        return max(0.0, (count - before) / (now - then)) if now > then else 0.0

    @staticmethod
    def eta(left: int, rate: float) -> float | None:
        if left <= 0:
            return 0.0
        return left / rate if rate > 0 else None


def progress_line(table: str, snapshot: MapProgress, total: int, rate: float) -> str:
    done = settled(snapshot)
    return (f"progress {table}: {done:,}/{total:,} rows (admitted {snapshot.admitted:,}, "
            f"running {snapshot.in_call:,}, completed {snapshot.completed:,}, "
            f"failed {snapshot.failed:,}, cached {snapshot.cached:,}, "
            f"retries {snapshot.retried:,}); {rate:,.0f} rows/s, "
            f"ETA {duration(Rates.eta(total - done, rate))}")


@attrs.define(eq=False)
class RunProgress:
    """Live bars (a terminal) or a line every `interval_s` (otherwise) for a run's maps."""

    stream: TextIO = attrs.field(factory=lambda: sys.stderr)
    interval_s: float = 10.0
    input_rows: int | None = None  # the rows given to the play, when known
    live: bool = attrs.field(default=None)
    outage: OutageWatch | None = None  # the run's: whether it waits for the database
    latest: dict[str, MapProgress] = attrs.field(factory=dict)
    rates: dict[str, Rates] = attrs.field(factory=dict)
    _progress: Progress | None = None
    _tasks: dict[str, TaskID] = attrs.field(factory=dict)
    _waiting_task: TaskID | None = None
    _lines_printed: bool = False

    def __attrs_post_init__(self) -> None:
        if self.live is None:
            tty = bool(getattr(self.stream, "isatty", lambda: False)())
            self.live = tty and not logs.json_lines()  # JSON log lines: plain lines

    def total(self, snapshot: MapProgress) -> int:
        if self.input_rows is not None and snapshot.source_rows <= self.input_rows:
            return self.input_rows
        return max(snapshot.source_rows, settled(snapshot))

    def update(self, table: str, snapshot: MapProgress) -> None:
        if table not in self.rates:  # the map's first snapshot starts its rate
            self.rates[table] = Rates()
            self.rates[table].add(completions(snapshot))
        self.latest[table] = snapshot
        if self._progress is None:
            return
        rate = self.rates[table].rate()
        total = self.total(snapshot)
        note = (f"admitted {snapshot.admitted:,} · running {snapshot.in_call:,} · "
                f"completed {snapshot.completed:,} · failed {snapshot.failed:,} · "
                f"cached {snapshot.cached:,} · retries {snapshot.retried:,} · {rate:,.0f} rows/s")
        if table not in self._tasks:
            self._tasks[table] = self._progress.add_task(clean(table), total=total, note="")
        self._progress.update(self._tasks[table], completed=settled(snapshot), total=total,
                              note=note)

    def __enter__(self) -> "RunProgress":
        if self.live:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._progress = Progress(
                TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                TextColumn("{task.fields[note]}"),
                console=Console(file=self.stream), transient=False)
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif self._lines_printed:  # a log that showed progress ends with where it got
            self.print_lines()

    def sample(self) -> None:
        """Add each map's completions now to its rate."""
        for table, snapshot in self.latest.items():
            self.rates[table].add(completions(snapshot))

    def waited_s(self) -> float | None:
        """Seconds the run has been waiting for the database, or None."""
        return None if self.outage is None else self.outage.waiting_s()

    def show_waiting(self) -> None:
        """The bars' "waiting for the database" row: shown while the run waits, else hidden."""
        if self._progress is not None and self.outage is not None:
            self._waiting_task = show_waiting_row(
                self._progress, self._waiting_task, self.waited_s(),
                note=f"the outage budget is {self.outage.budget_s:g} s")

    def print_lines(self) -> None:
        self.sample()
        for table, snapshot in self.latest.items():
            rate = self.rates[table].rate()
            write(clean(progress_line(table, snapshot, self.total(snapshot), rate)) + "\n",
                  self.stream)
        waited = self.waited_s()
        if waited is not None:
            write(f"progress: {waiting_text(waited, self.outage.budget_s)}\n", self.stream)

    async def report_periodically(self) -> None:
        """Sample the rates every `SAMPLE_S` and, without a terminal, print the progress lines
        every `interval_s`, until cancelled."""
        next_line = trio.current_time() + self.interval_s
        while True:
            await trio.sleep(min(SAMPLE_S, max(0.0, next_line - trio.current_time())))
            if self.live or trio.current_time() < next_line:
                self.sample()
                self.show_waiting()
                continue
            self.print_lines()
            self._lines_printed = bool(self.latest)
            next_line = trio.current_time() + self.interval_s


async def with_progress(run: Run, progress: RunProgress, body: Callable[[], Awaitable[T]]) -> T:
    """`await body()` with `progress` following the run's maps (its periodic lines ticking in
    the run's nursery, stopped when the body ends)."""
    run.observe_progress(progress.update)
    progress.outage = run.outage
    ticker = trio.CancelScope()

    async def tick() -> None:
        with ticker:
            await progress.report_periodically()

    with progress:
        run.start_soon(tick)
        try:
            return await body()
        finally:
            ticker.cancel()
            run.observe_progress(None)
