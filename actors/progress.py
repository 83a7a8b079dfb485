"""Map progress and results: a mutable tally owned by one map, frozen snapshots handed out.

How it works
- `MapTally` is written only by the actors of one map (all in one trio thread, so plain
  attribute updates are atomic between checkpoints). It counts what admission decided (admitted,
  cached, blocked, skipped duplicates), what the workers ran (`executed` rows that got an
  outcome; `calls` of the function, of which `retried` were retries and `timed_out` ran past
  the row timeout) and what the completer made durable (completed, failed, fenced), and whether
  a newer run took the map's rows (`superseded`).
- `CallGauge` counts the rows inside a call of the function right now (`in_call`, what
  "running" means everywhere: `engine.runs.row_calls`); the plan owns one, every call passes
  through it (`actors.workers.call_row`).
- `MapProgress` is a frozen snapshot for progress reporting (with `waiting_for_store_s`, how
  long the run has been waiting for the database, from the run's `actors.retry.OutageWatch`);
  `MapResult` is the final answer of `run.map`. Both are values: holding one never pins the
  map's state.
- Counting rules: `admitted` counts every source row admission settled (pending + cached +
  blocked); `completed`/`failed` count outcomes a completion batch applied (not fenced);
  `fenced` counts outcomes the sheet refused. Row lists carried in the result (fenced and
  blocked rows) are capped at `MAX_CARRIED_ROWS` each so a pathological map still runs in flat
  memory; the counts are always exact.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import attrs

from runplane.engine.observability import context as where, metrics
from runplane.engine.sheets import (Admission, BlockedRow, Completion, CompletionDiagnostics,
                                    Dataset, FencedRow, OutcomeStatus, RowOutcome)

from .backoff import RetryQueue

from .retry import current_watch

log = logging.getLogger("runplane.actors")

MAX_CARRIED_ROWS = 10_000


@attrs.define(eq=False)
class CallGauge:
    """Rows inside a call of one map's function in this process, now. `on_change` (the map's
    progress report) is called as a call starts or ends, at most every `REPORT_EVERY_S`, so a
    slow function's progress shows its calls before any of them returns, and always when the
    last call ends while the last snapshot still counted calls (a cancelled map's last
    snapshot says nothing is running). `reported` is the count the last snapshot carried: a
    fast function's calls, each over before the next starts, report once a second, not once a
    call."""

    in_call: int = 0
    on_change: Callable[[], object] | None = None
    reported: int = 0
    _reported_at: float = -1e18

    REPORT_EVERY_S = 1.0

    def __attrs_post_init__(self) -> None:
        metrics.track_calls(self)  # `runplane_rows_running` sums the live gauges

    def enter(self) -> float:
        """A call starts; answers its start time, for `leave` (a pair, not a context manager:
        this runs twice a row, and a generator-based one costs a few microseconds each)."""
        self.in_call += 1
        now = time.perf_counter()  # one clock read serves the report's rate limit too
        self._changed(now)
        return now

    def leave(self, started: float) -> None:
        """The call that `enter` answered `started` for has ended (whatever it raised)."""
        now = time.perf_counter()
        metrics.call_seconds(now - started)  # `runplane_row_seconds`
        self.in_call -= 1
        self._changed(now)

    def catch_up(self) -> None:
        """Report now when the last snapshot's count is not the count now: calls that started
        (or ended) together within `REPORT_EVERY_S` and, held back by the rate limit, were not
        reported, with no call starting or ending since (the row-calls reporter looks every
        second: `actors.row_calls`)."""
        if self.on_change is not None and self.in_call != self.reported:
            self._reported_at = time.perf_counter()
            self.on_change()

    def _changed(self, now: float) -> None:
        if self.on_change is None:
            return
        if (self.in_call == 0 and self.reported != 0) \
                or now - self._reported_at >= self.REPORT_EVERY_S:
            self._reported_at = now
            self.on_change()


@attrs.frozen
class MapProgress:
    """A snapshot of a running map."""

    source_rows: int
    admitted: int
    pending: int
    cached: int
    blocked: int
    skipped: int
    executed: int
    completed: int
    failed: int
    fenced: int
    calls: int = 0
    retried: int = 0
    timed_out: int = 0
    superseded: bool = False
    waiting_for_store_s: float | None = None  # None: not waiting for the database
    waiting: int = 0  # rows waiting out a retry's backoff
    stopped_early: bool = False
    in_call: int = 0  # rows inside a call of the function now ("running")


@attrs.frozen
class MapResult:
    """What `run.map` did. `fenced_rows`/`blocked_rows` carry (up to a cap) the rows concerned;
    `diagnostics` holds each completion batch's diagnostics in order. `retried` counts the
    extra calls retries made, `timed_out` the calls cancelled by the row timeout. `superseded`
    is true when a newer run of the play took the map's rows (the map stopped early and left
    them to it); `superseded_by` is that run's id when it could be read. `stopped_early` is true
    when the map's first rows all failed for one cause from the function (see
    `actors.row_functions.FailFast`); `stop_reason` then says which, once."""

    admitted: int
    cached: int
    completed: int
    failed: int
    blocked: int
    fenced: int
    diagnostics: tuple[CompletionDiagnostics, ...] = ()
    fenced_rows: tuple[FencedRow, ...] = ()
    blocked_rows: tuple[BlockedRow, ...] = ()
    skipped: int = 0
    executed: int = 0
    map_invocation_id: str | None = None
    retried: int = 0
    timed_out: int = 0
    superseded: bool = False
    superseded_by: str | None = None
    # The rows of the map's table that this run wrote (`engine.sheets.Dataset`).
    dataset: Dataset | None = attrs.field(default=None, eq=False, repr=False)
    stopped_early: bool = False
    stop_reason: str | None = None


def waiting_for_store_s() -> float | None:
    """How long the current run has been waiting for the database, or None."""
    watch = current_watch()
    return None if watch is None else watch.waiting_s()


@attrs.define(eq=False)
class MapTally:
    on_progress: Callable[[MapProgress], object] | None = None
    source_rows: int = 0
    admitted: int = 0
    pending: int = 0
    cached: int = 0
    blocked: int = 0
    skipped: int = 0
    executed: int = 0
    completed: int = 0
    failed: int = 0
    fenced: int = 0
    calls: int = 0
    retried: int = 0
    timed_out: int = 0
    superseded: bool = False
    stopped_early: bool = False
    stop_reason: str | None = None
    retries: RetryQueue | None = None  # the map's delay queue, if any
    gauge: CallGauge = attrs.field(factory=CallGauge)  # the plan's (`MapPlan.calls`)
    diagnostics: list[CompletionDiagnostics] = attrs.field(factory=list)
    fenced_rows: list[FencedRow] = attrs.field(factory=list)
    blocked_rows: list[BlockedRow] = attrs.field(factory=list)
    # `runplane_rows_total` of the map's play and table (`engine.observability.context`)
    meters: metrics.RowMeters = attrs.field(
        factory=lambda: metrics.RowMeters.of(where.current().play, where.current().map))

    def __attrs_post_init__(self) -> None:
        self.gauge.on_change = self.report

    def on_admission(self, rows_in_page: int, admission: Admission, dropped: int = 0) -> None:
        """Count one admitted page; `dropped` pending rows were duplicates of rows in flight."""
        pending = len(admission.pending) - dropped
        self.source_rows += rows_in_page
        self.pending += pending
        cached = admission.cached or len(admission.completed)  # counted, or listed
        self.cached += cached
        self.blocked += len(admission.blocked)
        self.skipped += admission.skipped + dropped
        self.admitted += pending + cached + len(admission.blocked)
        room = MAX_CARRIED_ROWS - len(self.blocked_rows)
        if room > 0:
            self.blocked_rows.extend(admission.blocked[:room])
        self.report()

    def on_replayed(self, rows: int) -> None:
        """Count a list of `rows` rows answered whole as cache hits (`actors.list_replay`)."""
        self.source_rows += rows
        self.admitted += rows
        self.cached += rows
        self.report()

    def on_completion(self, outcomes: list[RowOutcome], completion: Completion) -> None:
        if not completion.fenced and len(completion.committed_keys) == len(outcomes):
            # the common case: every outcome a key of its own, and written
            completed = [outcome.status for outcome in outcomes].count(OutcomeStatus.COMPLETED)
            self.completed += completed
            self.failed += len(outcomes) - completed
        else:
            self._count_written(outcomes, completion)
        self.fenced += len(completion.fenced)
        room = MAX_CARRIED_ROWS - len(self.fenced_rows)
        if room > 0:
            self.fenced_rows.extend(completion.fenced[:room])
        if completion.diagnostics is not None:
            self.diagnostics.append(completion.diagnostics)
        self.report()

    def _count_written(self, outcomes: list[RowOutcome], completion: Completion) -> None:
        fenced_keys = {row.key for row in completion.fenced}
        last: dict[str, str] = {}
        for outcome in outcomes:  # duplicates: the last outcome of a key wins
            last[outcome.key] = outcome.status
        for key, status in last.items():
            if key in fenced_keys:
                continue
            if status == OutcomeStatus.COMPLETED:
                self.completed += 1
            else:
                self.failed += 1

    def snapshot(self) -> MapProgress:
        self.gauge.reported = self.gauge.in_call
        return MapProgress(
            source_rows=self.source_rows, admitted=self.admitted, pending=self.pending,
            cached=self.cached, blocked=self.blocked, skipped=self.skipped,
            executed=self.executed, completed=self.completed, failed=self.failed,
            fenced=self.fenced, calls=self.calls, retried=self.retried,
            timed_out=self.timed_out, superseded=self.superseded,
            waiting_for_store_s=waiting_for_store_s(),
            waiting=self.retries.waiting if self.retries is not None else 0,
            stopped_early=self.stopped_early, in_call=self.gauge.in_call,
        )

    def publish(self) -> None:
        """Bring `runplane_rows_total` up to the tally (deltas: a few additions)."""
        o = metrics.RowOutcome
        self.meters.push({o.COMPLETED: self.completed, o.FAILED: self.failed, o.CACHED: self.cached,
                          o.RETRIED: self.retried, o.FENCED: self.fenced, o.SKIPPED: self.skipped})

    def report(self) -> None:
        """Hand a snapshot to the observer; what it raises is logged, never propagated."""
        self.publish()
        if self.on_progress is None:
            return
        try:
            self.on_progress(self.snapshot())
        except Exception:  # observational only
            log.exception("map progress callback failed")

    def result(self, map_invocation_id: str | None, superseded_by: str | None = None) -> MapResult:
        self.publish()
        return MapResult(
            admitted=self.admitted, cached=self.cached, completed=self.completed,
            failed=self.failed, blocked=self.blocked, fenced=self.fenced,
            diagnostics=tuple(self.diagnostics), fenced_rows=tuple(self.fenced_rows),
            blocked_rows=tuple(self.blocked_rows), skipped=self.skipped, executed=self.executed,
            map_invocation_id=map_invocation_id, retried=self.retried,
            timed_out=self.timed_out, superseded=self.superseded, superseded_by=superseded_by,
            stopped_early=self.stopped_early, stop_reason=self.stop_reason,
        )
