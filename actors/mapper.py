"""`run.map`: a pipeline of actors from a source to the sheet, in flat memory.

How it works

    source ─pages─▶ admission ─row batches─▶ workers ×N ─outcome batches─▶ completer ─▶ writer
                       │ cache hits, blocked rows go straight to the tally

- The **source actor** turns the input into pages `(offset, rows)`: a list source is first
  staged as an array input by the sealer (so a wake replays byte-identical input) and read back
  one sealed page at a time. Two cases admit the list directly instead, as a streamed source:
  a gateway without array actions (with one warning: a wake re-reads the caller's list), and a
  run already retired — a wake of a finished run, whose staged input is gone and which nothing
  will replay. An async iterable is cut into pages as it arrives, the first of
  `FIRST_PAGE_ROWS` rows (so work starts soon even on a slow source), each next one twice as
  large up to `page_rows` (large pages admit faster).
- The **admission actor** admits one page per transaction (`engine.sheets.admit` with the page's
  `input_offset`), counts cache hits and blocked rows, and splits the pending rows into small
  batches so all workers get a share. Duplicates: the engine drops them within a page; a
  later duplicate of a row still in flight in this map is dropped here (counted as skipped);
  one whose first occurrence is already written is a cache hit (or, if that failed, is
  re-admitted and runs again, as the engine re-admits failed rows).
- **Workers** call `await fn(row)`. An exception fails that row only (its message becomes the
  row's `_error`); a return value must be a dict of output fields (None means no fields) that
  `canonical.normalize` accepts, or the row fails with a message saying why. No permit is held
  while user code runs: permits are taken inside the engine calls, around database work only.
- The **completer** batches outcomes by rows, bytes and a short linger, and hands batches to
  the **writer** over an unbuffered channel (the next batch grows while one is written), which
  writes each with `engine.sheets.complete` and records fenced rows.
- Every channel carries lists and is bounded, so memory is bounded by the capacities whatever
  the source size. Every actor is started with `await nursery.start(...)`, owns its inbox and
  closes what it sends.
- Every actor reads the map's frozen `MapPlan` and changes only the map's `MapState` (both in
  `actors.map_state`), through the methods named for it; its signature says which it takes.
- The state's **ledger** holds every computed outcome until a write that contains it returns.
  When the map is cancelled or fails, the nursery is gone by the time the map's `finally` runs,
  so what the ledger still holds is exactly what was computed but not confirmed written; it is
  flushed in a shielded scope with a deadline. A write that was interrupted but did commit is
  simply replayed (an identical completion is idempotent).
- Store calls are retried through transient faults (`actors.retry`): each is idempotent, and a
  map that raised would end its run terminally.
- On a wake (same run id, same epoch), admission returns finished rows as cache hits, so only
  unfinished rows run again.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any, AsyncIterable, Awaitable, Callable, Sequence

import trio

from runplane.engine import canonical, sheets
from runplane.engine.array_input import Occurrence
from runplane.engine.errors import (
    ArrayInputUnavailableError, EngineError, InvalidInputError, RetiredError, leaf_errors,
)
from runplane.engine.sheets import AdmittedRow, RowOutcome

from .map_state import FIRST_PAGE_ROWS, MapPlan, MapState
from .progress import MapResult
from .retry import retry_transient

if TYPE_CHECKING:
    from .run import Run

log = logging.getLogger("runplane.actors")

MAX_WORK_BATCH = 64        # rows per worker batch: small enough to share a page among workers


# -- the source actor ------------------------------------------------------------------------
async def stream_pages(source: AsyncIterable[Any], page_rows: int, pages_send,
                       *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with pages_send:
        offset, page = 0, []
        size = min(FIRST_PAGE_ROWS, page_rows)
        async for row in source:
            page.append(row)
            if len(page) >= size:
                await pages_send.send((offset, page))
                offset, page = offset + len(page), []
                size = min(page_rows, 2 * size)
        if page:
            await pages_send.send((offset, page))


async def replay_pages(staged: Any, pages_send, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with pages_send:
        async for page in staged.pages():
            await pages_send.send((page.offset, [occurrence_data(row) for row in page.rows]))


async def iterate_rows(items: Sequence[Any]) -> AsyncIterable[dict]:
    """A list source as an async iterable of user rows (when it is admitted without staging)."""
    for item in items:
        yield item.data if isinstance(item, Occurrence) else item


def occurrence_data(occurrence: Any) -> dict:
    """The user row of a staged occurrence."""
    data = getattr(occurrence, "data", None)
    if data is None and isinstance(occurrence, dict):
        data = occurrence.get("data")
    if not isinstance(data, dict):
        raise InvalidInputError("staged occurrence has no data object")
    return data


# -- the admission actor ---------------------------------------------------------------------
async def admit_pages(plan: MapPlan, state: MapState, pages_recv, work_send,
                      *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with pages_recv, work_send:
        async for offset, rows in pages_recv:
            admission = await plan.admit(rows, offset)
            pending = state.take_admission(len(rows), admission)
            size = max(1, min(MAX_WORK_BATCH, math.ceil(len(pending) / plan.concurrency)))
            for start in range(0, len(pending), size):
                await work_send.send(pending[start:start + size])


# -- workers -----------------------------------------------------------------------------------
def error_message(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


async def execute_row(fn: Callable[[dict], Awaitable[Any]], admitted: AdmittedRow) -> RowOutcome:
    """Run the user function on one row and turn what happens into a `RowOutcome`."""
    try:
        data = await fn(admitted.row)
    except Exception as exc:  # the row fails, the map goes on
        return RowOutcome(admitted.key, "failed", input_index=admitted.input_index,
                          error=error_message(exc))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return RowOutcome(
            admitted.key, "failed", input_index=admitted.input_index,
            error=f"map function returned {type(data).__name__}, expected a dict of outputs",
        )
    try:
        data = canonical.normalize_fast(data, "output")  # as is, when already canonical
    except InvalidInputError as exc:
        return RowOutcome(admitted.key, "failed", input_index=admitted.input_index,
                          error=error_message(exc))
    return RowOutcome(admitted.key, "completed", data=data, input_index=admitted.input_index)


async def work(plan: MapPlan, state: MapState, work_recv, outcome_send,
               *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with work_recv, outcome_send:
        async for batch in work_recv:
            ticket, outcomes = state.open_batch()
            for admitted in batch:
                state.record(outcomes, await execute_row(plan.fn, admitted))
            state.report()
            await outcome_send.send((ticket, outcomes))


# -- the completer and its writer --------------------------------------------------------------
def outcome_bytes(outcome: RowOutcome) -> int:
    """A cheap estimate of an outcome's patch JSON size, for batching only (the engine chunks
    by exact bytes itself): flat string and number fields are summed, nested ones encoded."""
    size = 64 + len(outcome.error or "")
    for field, value in (outcome.data or {}).items():
        if isinstance(value, str):
            size += len(field) + len(value) + 6
        elif isinstance(value, (dict, list)):
            size += len(field) + len(canonical.stable_dumps(value)) + 4
        else:
            size += len(field) + 24
    return size


async def batch_outcomes(plan: MapPlan, outcome_recv, flush_send,
                         *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Gather outcome batches into completion batches.

    A batch is handed to the writer when it reaches `batch_rows` or `batch_bytes` (waiting for
    the writer: backpressure), or when it has lingered `linger_s` and the writer is idle. The
    flush channel is unbuffered, so a writer that is busy lets the batch keep growing instead of
    queueing small ones: under load batches fill up, at a trickle they leave after the linger.
    """
    task_status.started()
    async with outcome_recv, flush_send:
        tickets: list[int] = []
        outcomes: list = []
        size = 0
        deadline = math.inf
        while True:
            with trio.move_on_at(deadline):
                try:
                    ticket, batch = await outcome_recv.receive()
                except trio.EndOfChannel:
                    break
                tickets.append(ticket)
                outcomes.extend(batch)
                size += sum(outcome_bytes(outcome) for outcome in batch)
                if deadline == math.inf:
                    deadline = trio.current_time() + plan.linger_s
                if len(outcomes) >= plan.batch_rows or size >= plan.batch_bytes:
                    await flush_send.send((tickets, outcomes))
                    tickets, outcomes, size, deadline = [], [], 0, math.inf
                    continue
            if outcomes and trio.current_time() >= deadline:
                try:
                    flush_send.send_nowait((tickets, outcomes))
                except trio.WouldBlock:
                    deadline = trio.current_time() + plan.linger_s  # the writer is busy
                else:
                    tickets, outcomes, size, deadline = [], [], 0, math.inf
        if outcomes:
            await flush_send.send((tickets, outcomes))


async def write_outcomes(plan: MapPlan, state: MapState, flush_recv,
                         *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with flush_recv:
        async for tickets, outcomes in flush_recv:
            state.settle(tickets, outcomes, await plan.complete(outcomes))


async def flush_unsettled(plan: MapPlan, state: MapState) -> None:
    """Write what was computed but not confirmed, shielded, within `plan.flush_deadline_s`."""
    outcomes = state.take_unsettled()
    if not outcomes:
        return
    deadline_s = plan.flush_deadline_s
    with trio.CancelScope(shield=True, deadline=trio.current_time() + deadline_s) as scope:
        try:
            for start in range(0, len(outcomes), plan.batch_rows):
                chunk = outcomes[start:start + plan.batch_rows]
                state.count_flushed(chunk, await plan.complete(chunk))
        except EngineError as exc:
            log.warning("map %s: flushing %d computed outcomes failed: %s",
                        plan.table_namespace, len(outcomes), exc)
    if scope.cancelled_caught:
        log.warning("map %s: flush of %d computed outcomes ran past %.0fs",
                    plan.table_namespace, len(outcomes), deadline_s)


# -- the map -----------------------------------------------------------------------------------
@contextlib.contextmanager
def unwrap_single_error():
    """Let one actor's ordinary error (a store failure, a bad row) out as itself, not wrapped in
    the nursery's exception group, so callers can `except EngineError`."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = leaf_errors(group)
        if len(leaves) == 1 and isinstance(leaves[0], Exception):
            raise leaves[0]
        raise


async def map_rows(run: Run, source: Sequence[Any] | AsyncIterable[Any], plan: MapPlan, *,
                   on_progress: Callable[[Any], Any] | None = None,
                   map_invocation_id: str | None = None) -> MapResult:
    """Run the pipeline of `plan` over `source` (a list is staged first) and count it."""
    listed = isinstance(source, (list, tuple))
    if not listed and not hasattr(source, "__aiter__"):
        raise InvalidInputError(
            f"source must be a list of rows or an async iterable, got {type(source).__name__}"
        )
    state = MapState.observed_by(on_progress)
    staged = None
    if listed and map_invocation_id is None:
        map_invocation_id = run.next_map_invocation_id(plan.table_namespace)
    await retry_transient(lambda: sheets.ensure_sheet(
        plan.port, run.scope.play_scope, plan.table_namespace, plan.contract))
    if listed:
        try:
            staged = await run.stage_array(plan.table_namespace, map_invocation_id, list(source))
        except ArrayInputUnavailableError:
            log.warning("map %s: the gateway has no array-input actions; the list is admitted "
                        "directly, and a wake will re-read the caller's list instead of staged "
                        "pages", plan.table_namespace)
            source = iterate_rows(source)
        except RetiredError:
            # A wake of a run that already finished: its staged input is gone and nothing will
            # replay it, so the caller's list is admitted as is (its finished rows are cached).
            log.info("map %s: run %s is retired; admitting the list without staging",
                     plan.table_namespace, run.run_id)
            source = iterate_rows(source)
    try:
        with unwrap_single_error():
            async with trio.open_nursery() as nursery:
                # Capacities: one page ahead of admission; about two batches per worker in each
                # direction; completion batches unbuffered (the batcher grows the next batch
                # while the writer writes).
                pages_send, pages_recv = trio.open_memory_channel(1)
                work_send, work_recv = trio.open_memory_channel(2 * plan.concurrency)
                outcome_send, outcome_recv = trio.open_memory_channel(2 * plan.concurrency)
                flush_send, flush_recv = trio.open_memory_channel(0)
                await nursery.start(write_outcomes, plan, state, flush_recv)
                await nursery.start(batch_outcomes, plan, outcome_recv, flush_send)
                async with work_recv, outcome_send:
                    for _ in range(plan.concurrency):
                        await nursery.start(work, plan, state, work_recv.clone(),
                                            outcome_send.clone())
                await nursery.start(admit_pages, plan, state, pages_recv, work_send)
                if staged is not None:
                    await nursery.start(replay_pages, staged, pages_send)
                else:
                    await nursery.start(stream_pages, source, plan.page_rows, pages_send)
    finally:
        await flush_unsettled(plan, state)
    state.report()
    return state.result(map_invocation_id)
