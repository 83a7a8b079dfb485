"""`run.map`: a pipeline of actors from a source to the sheet, in flat memory.

How it works

    source ─pages─▶ admission ─row batches─▶ workers ×N ─outcome batches─▶ completer ─▶ writer
                       │ cache hits,           ▲      │ retries
                       │ blocked rows          └─ releaser ◀─ delay queue (with a retry policy)
                       ▼ straight to the tally

- `map_rows` opens the sheet (and, for a list source, its array input) and starts the actors,
  each with `await nursery.start(...)`; every actor owns its inbox and closes what it sends:
    * the source and admission actors (`actors.admission`, whose probe-or-admit decisions are
      the state machine of `actors.admission_steps`);
    * the workers and the releaser of rows in retry backoff (`actors.workers`);
    * the completer and its writer (`actors.completer`).
- Every channel carries lists and is bounded, so memory is bounded by the capacities whatever
  the source size.
- Every actor reads the map's frozen `MapPlan` and changes only the map's `MapState` (both in
  `actors.map_state`), through the methods named for it; its signature says which it takes.
- **Superseded**: once a completion comes back fenced as `stale_write_version` (a newer run of
  the play took the rows), workers call the function for no further row (the calls in
  progress finish — at most one per worker), admission stops reading pages, the delay queue
  drops its rows, and what was computed is still written; the rows left are the newer run's.
  A map whose first rows all failed for one cause from the function **stops early** the same
  way (`actors.row_functions`); the rows left stay pending for the next run.
- The state's **ledger** holds every computed outcome until a write that contains it returns.
  When the map is cancelled or fails, the nursery is gone by the time the map's `finally` runs,
  so what the ledger still holds is exactly what was computed but not confirmed written; it is
  flushed in a shielded scope with a deadline (`actors.completer.flush_unsettled`).
- Store calls are retried through transient faults (`actors.retry`): each is idempotent, and a
  map that raised would end its run terminally.
- **Reuse**: the keys of every unit in which admission found cache hits are kept
  (`MapState.note_reuse`) and recorded as the run's when the map ends, in one statement
  (`engine.sheets.record_reuse`): `read_rows(run_id=...)` then lists the rows the run reused,
  which stay untouched (their run, write version and cells are those of the run that wrote them).
- **Unchanged reruns**: a list whose every row was a cache hit when a map of it ended is
  recorded (in the run's nursery, after the map returned: a statement that checks every key),
  and a later map of the same list into the unchanged sheet is answered whole by one statement
  (`actors.list_replay`, `engine.sheets.lists`).
- On a wake (same run id, same epoch), admission counts finished rows as cache hits, so only
  unfinished rows run again; a list source already staged is checked against the staged input
  (`ConflictError` for a different list) and its pages are admitted from their facts.
- The map needs nothing of the `Run` but its plan (whose run ref holds the run's scope) and,
  for a list source, its map invocation id: it does not import `actors.run`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterable, Callable, Sequence, Union

import attrs
import trio

from runplane.engine import array_input, runs, sheets
from runplane.engine.canonical import JsonObject
from runplane.engine.errors import EngineError, InvalidInputError, unwrap_single_error

from .admission import admit_pages, stream_pages
from .cancellation import RunStop
from .completer import COMPLETION_WRITERS, batch_outcomes, flush_unsettled, write_outcomes
from .list_replay import ListReplay
from .list_source import ListSource
from .map_state import MapPlan, MapState
from .progress import MapProgress, MapResult
from .retry import retry_transient
from .workers import call_row, release_retries, work

__all__ = ["map_rows", "call_row"]  # call_row: the shared worker's, imported from here

log = logging.getLogger("runplane.actors")

# What a map reads: a list of rows (a `PagedRows` is read in place), staged before its first
# row runs, or an async iterable of rows, admitted page by page.
MapSource = Union[Sequence[JsonObject], AsyncIterable[JsonObject]]


async def map_rows(source: MapSource, plan: MapPlan, *,
                   on_progress: Callable[[MapProgress], object] | None = None,
                   map_invocation_id: str | None = None,
                   background: trio.Nursery | None = None,
                   stop: RunStop | None = None) -> MapResult:
    """Run the pipeline of `plan` over `source` and count it (a list is encoded first and
    staged before its first row is admitted). A list source needs its `map_invocation_id`
    (the run gives each list map of a sheet its own, `Run.next_map_invocation_id`). Given
    `background` (the run's closing nursery: its exit waits for it while the run retires), a
    list is recorded for reruns there, after the map has returned; else before it returns.
    Given the run's `stop`, a cancellation of the run stops the pipeline and the map returns
    stopped early (`actors.cancellation`)."""
    listed = isinstance(source, (list, tuple, array_input.PagedRows))
    if not listed and not hasattr(source, "__aiter__"):
        raise InvalidInputError(
            f"source must be a list of rows or an async iterable, got {type(source).__name__}"
        )
    state = MapState.for_plan(plan, on_progress)
    listed_source = None
    replay = None
    if listed:
        if map_invocation_id is None:
            raise InvalidInputError("a list source needs its map_invocation_id")
        scope = plan.ref.scope.map(plan.table_namespace, map_invocation_id)
        if isinstance(source, (list, tuple)):
            replay = await ListReplay.for_map(plan, source)
            if replay is not None and await replay.answer(state, scope):
                return _finished(plan, state, map_invocation_id)
        listed_source = ListSource(plan.port, scope, source if isinstance(
            source, array_input.PagedRows) else list(source))  # a PagedRows is read in place
        state.source_rows = listed_source.source_rows

    await open_map(plan, state, listed_source)
    stopping = stop.scope() if stop is not None else contextlib.nullcontext()
    try:
        with stopping as stop_scope, unwrap_single_error(Exception):
            async with trio.open_nursery() as nursery:
                # Capacities: one streamed page ahead of admission (a list is read in place);
                # about two batches per worker in each direction; completion batches
                # unbuffered (the batcher grows the next batch while the writers write).
                work_send, work_recv = trio.open_memory_channel(2 * plan.concurrency)
                outcome_send, outcome_recv = trio.open_memory_channel(2 * plan.concurrency)
                flush_send, flush_recv = trio.open_memory_channel(0)
                async with flush_recv:
                    for _ in range(COMPLETION_WRITERS):
                        await nursery.start(write_outcomes, plan, state, flush_recv.clone())
                await nursery.start(batch_outcomes, plan, state, outcome_recv, flush_send)
                async with work_recv, outcome_send:
                    for _ in range(plan.concurrency):
                        await nursery.start(work, plan, state, work_recv.clone(),
                                            outcome_send.clone())
                if state.retries is not None:
                    await nursery.start(release_retries, state, work_send.clone())
                if listed_source is not None:  # read in place: no source actor
                    await nursery.start(admit_pages, plan, state, None, work_send,
                                        listed_source, nursery)
                else:
                    pages_send, pages_recv = trio.open_memory_channel(1)
                    await nursery.start(admit_pages, plan, state, pages_recv, work_send)
                    await nursery.start(stream_pages, source, plan.page_rows, pages_send)
    finally:
        await flush_unsettled(plan, state)
    if stop_scope is not None and stop_scope.cancelled_caught:  # not a map that just finished
        state.stop_early(stop.reason)
        replay = None  # the list was not gone through: nothing to record for reruns
    await record_reuse(plan, state)
    if replay is not None:
        if background is not None:
            background.start_soon(replay.record, state, name="record_list")
        else:
            await replay.record(state)
    state.report()
    return _finished(plan, state, map_invocation_id, await newer_run_id(plan, state))


async def open_map(plan: MapPlan, state: MapState, listed_source: ListSource | None) -> None:
    """Ensure the map's sheet and open its list source: three independent reads and writes at
    once, or one request through a gateway (`ListSource.open_with_sheet`). Ensuring the sheet
    is the map's first sheet write, before any row is probed or admitted (`state.writing`). A
    list going into an empty sheet is encoded as soon as the count shows it empty, while the
    sheet is still being ensured (every row of it is admitted: there is nothing to probe)."""
    if listed_source is not None and plan.port.settings.remote \
            and await listed_source.open_with_sheet(plan.contract, plan.fast_admission):
        return

    async def ensure_sheet() -> None:
        with state.writing():
            await retry_transient(lambda: sheets.ensure_sheet(
                plan.port, plan.ref.scope.play_scope, plan.table_namespace, plan.contract))

    async def count_rows(source: ListSource) -> None:
        await source.count_sheet_rows(plan.ref.scope.play_scope)
        if source.sheet_rows == 0:  # nothing to probe: every row is admitted, so encode now
            await source.encode()

    with unwrap_single_error(Exception):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ensure_sheet)
            if listed_source is not None:
                nursery.start_soon(listed_source.open)
                if plan.fast_admission:
                    nursery.start_soon(count_rows, listed_source)


def _finished(plan: MapPlan, state: MapState, map_invocation_id: str | None,
              superseded_by: str | None = None) -> MapResult:
    result = state.result(map_invocation_id, superseded_by)
    return attrs.evolve(result, dataset=sheets.dataset(
        plan.port, plan.ref.scope.play_scope, plan.table_namespace, run_id=plan.ref.scope.run_id))


async def record_reuse(plan: MapPlan, state: MapState) -> None:
    """Record the rows this map found as cache hits as its run's (one statement; see
    `engine.sheets.reuse`). A failure is logged: the map's rows and result stand without it."""
    if not state.reused_keys:
        return
    try:
        await retry_transient(lambda: sheets.record_reuse(
            plan.port, plan.ref, plan.table_namespace, state.reused_keys))
    except EngineError as exc:
        log.warning("map %s: the rows it reused could not be recorded for run %s: %s",
                    plan.table_namespace, plan.ref.run_id, exc)


async def newer_run_id(plan: MapPlan, state: MapState) -> str | None:
    """The id of the run that superseded the map, for its result (None if not superseded, or
    if the store cannot say: it is only reported)."""
    if state.superseded_by_epoch is None:
        return None
    try:
        newer = await retry_transient(lambda: runs.by_epoch(
            plan.port, plan.ref.scope.play_scope, state.superseded_by_epoch))
    except EngineError as exc:
        log.warning("map %s: superseded by the run of epoch %d, whose id could not be read: %s",
                    plan.table_namespace, state.superseded_by_epoch, exc)
        return None
    return None if newer is None else newer.run_id
