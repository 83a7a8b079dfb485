"""`run.map`: a pipeline of actors from a source to the sheet, in flat memory.

How it works

    source ─pages─▶ admission ─row batches─▶ workers ×N ─outcome batches─▶ completer ─▶ writer
                       │ cache hits, blocked rows go straight to the tally

- The **source actor** turns the input into pages `(offset, rows)`: a list source is first
  staged as an array input by the sealer (so a wake replays byte-identical input) and read back
  one sealed page at a time; an async iterable is cut into pages as it arrives, the first of
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
- The **ledger** holds every computed outcome until a write that contains it returns. When the
  map is cancelled or fails, the nursery is gone by the time the map's `finally` runs, so what
  the ledger still holds is exactly what was computed but not confirmed written; it is flushed
  in a shielded scope with a deadline. A write that was interrupted but did commit is simply
  replayed (an identical completion is idempotent).
- Store calls are retried through transient faults (`actors.retry`): each is idempotent, and a
  map that raised would end its run terminally.
- On a wake (same run id, same epoch), admission returns finished rows as cache hits, so only
  unfinished rows run again.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, AsyncIterable, Awaitable, Callable, Sequence

import attrs
import trio

from runplane.engine import canonical, sheets
from runplane.engine.errors import EngineError, InvalidInputError, leaf_errors

from .progress import MapProgress, MapResult, MapTally
from .retry import retry_transient

log = logging.getLogger("runplane.actors")

PAGE_ROWS = 5000           # rows admitted per transaction for a streamed source, at most ...
FIRST_PAGE_ROWS = 100      # ... starting from this and doubling, so the first rows run soon
MAX_WORK_BATCH = 64        # rows per worker batch: small enough to share a page among workers
BATCH_ROWS = 5000          # completion batch: rows ...
BATCH_BYTES = 1 << 20      # ... or bytes of output JSON ...
LINGER_S = 0.05            # ... or this long after the first outcome arrived
FLUSH_DEADLINE_S = 15.0    # the shielded flush on cancellation gives up after this


@attrs.define(eq=False)
class OutcomeLedger:
    """Outcomes computed but not yet confirmed written, by ticket."""

    _open: dict[int, list] = attrs.field(factory=dict)
    _next: int = 0

    def open(self) -> tuple[int, list]:
        ticket, self._next = self._next, self._next + 1
        outcomes: list = []
        self._open[ticket] = outcomes
        return ticket, outcomes

    def settle(self, tickets: Sequence[int]) -> None:
        for ticket in tickets:
            self._open.pop(ticket, None)

    def unsettled(self) -> list:
        outcomes = [outcome for batch in self._open.values() for outcome in batch]
        self._open.clear()
        return outcomes


@attrs.frozen
class MapPlan:
    """Everything the actors of one map share (read-only)."""

    run: Any
    table_namespace: str
    contract: Any
    fn: Callable[[dict], Awaitable[Any]]
    concurrency: int
    cell_policies: Any
    linger_s: float
    batch_rows: int
    batch_bytes: int

    @property
    def port(self):
        return self.run.port

    @property
    def attempt(self):
        return self.run.attempt


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


def occurrence_data(occurrence: Any) -> dict:
    """The user row of a staged occurrence."""
    data = getattr(occurrence, "data", None)
    if data is None and isinstance(occurrence, dict):
        data = occurrence.get("data")
    if not isinstance(data, dict):
        raise InvalidInputError("staged occurrence has no data object")
    return data


# -- the admission actor ---------------------------------------------------------------------
async def admit_pages(plan: MapPlan, tally: MapTally, inflight: set[str], pages_recv, work_send,
                      *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with pages_recv, work_send:
        async for offset, rows in pages_recv:
            admission = await retry_transient(lambda: sheets.admit(
                plan.port, plan.run.ref, plan.table_namespace, plan.contract, rows,
                input_offset=offset, attempt=plan.attempt, cell_policies=plan.cell_policies,
            ))
            # A later duplicate of a row still in flight in this map is dropped (skipped): the
            # first occurrence's outcome completes the row.
            pending = [row for row in admission.pending if row.key not in inflight]
            inflight.update(row.key for row in pending)
            tally.on_admission(len(rows), admission, dropped=len(admission.pending) - len(pending))
            size = max(1, min(MAX_WORK_BATCH, math.ceil(len(pending) / plan.concurrency)))
            for start in range(0, len(pending), size):
                await work_send.send(pending[start:start + size])


# -- workers -----------------------------------------------------------------------------------
def error_message(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


async def execute_row(fn: Callable[[dict], Awaitable[Any]], admitted: Any) -> Any:
    """Run the user function on one row and turn what happens into a `RowOutcome`."""
    try:
        data = await fn(admitted.row)
    except Exception as exc:  # the row fails, the map goes on
        return sheets.RowOutcome(admitted.key, "failed", input_index=admitted.input_index,
                                 error=error_message(exc))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return sheets.RowOutcome(
            admitted.key, "failed", input_index=admitted.input_index,
            error=f"map function returned {type(data).__name__}, expected a dict of outputs",
        )
    try:
        data = canonical.normalize_fast(data, "output")  # as is, when already canonical
    except InvalidInputError as exc:
        return sheets.RowOutcome(admitted.key, "failed", input_index=admitted.input_index,
                                 error=error_message(exc))
    return sheets.RowOutcome(admitted.key, "completed", data=data,
                             input_index=admitted.input_index)


async def work(plan: MapPlan, tally: MapTally, ledger: OutcomeLedger, work_recv, outcome_send,
               *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with work_recv, outcome_send:
        async for batch in work_recv:
            ticket, outcomes = ledger.open()
            for admitted in batch:
                outcomes.append(await execute_row(plan.fn, admitted))
                tally.executed += 1
            tally.report()
            await outcome_send.send((ticket, outcomes))


# -- the completer and its writer --------------------------------------------------------------
def outcome_bytes(outcome: Any) -> int:
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


async def write_outcomes(plan: MapPlan, tally: MapTally, ledger: OutcomeLedger,
                         inflight: set[str], flush_recv,
                         *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with flush_recv:
        async for tickets, outcomes in flush_recv:
            completion = await retry_transient(lambda: sheets.complete(
                plan.port, plan.run.ref, plan.table_namespace, plan.contract, outcomes,
                attempt=plan.attempt,
            ))
            tally.on_completion(outcomes, completion)
            ledger.settle(tickets)
            inflight.difference_update(outcome.key for outcome in outcomes)


async def flush_unsettled(plan: MapPlan, tally: MapTally, ledger: OutcomeLedger,
                          deadline_s: float) -> None:
    """Write what was computed but not confirmed, shielded, within `deadline_s`."""
    outcomes = ledger.unsettled()
    if not outcomes:
        return
    with trio.CancelScope(shield=True, deadline=trio.current_time() + deadline_s) as scope:
        try:
            for start in range(0, len(outcomes), plan.batch_rows):
                chunk = outcomes[start:start + plan.batch_rows]
                completion = await retry_transient(lambda: sheets.complete(
                    plan.port, plan.run.ref, plan.table_namespace, plan.contract, chunk,
                    attempt=plan.attempt,
                ))
                tally.on_completion(chunk, completion)
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


def _check(table_namespace: str, source: Any, fn: Any, contract: Any, concurrency: Any,
           page_rows: Any) -> None:
    if not isinstance(contract, sheets.SheetContract):
        raise InvalidInputError(f"contract must be a SheetContract, got {type(contract).__name__}")
    if not callable(fn):
        raise InvalidInputError("fn must be an async function of one row")
    for name, value in (("concurrency", concurrency), ("page_rows", page_rows)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(source, (list, tuple)) and not hasattr(source, "__aiter__"):
        raise InvalidInputError(
            f"source must be a list of rows or an async iterable, got {type(source).__name__}"
        )
    if not isinstance(table_namespace, str):
        raise InvalidInputError("table_namespace must be a string")


async def map_rows(
    run: Any,
    table_namespace: str,
    source: Sequence[Any] | AsyncIterable[Any],
    fn: Callable[[dict], Awaitable[Any]],
    *,
    contract: Any,
    concurrency: int = 16,
    on_progress: Callable[[MapProgress], Any] | None = None,
    map_invocation_id: str | None = None,
    cell_policies: Any = None,
    page_rows: int = PAGE_ROWS,
    linger_s: float = LINGER_S,
    batch_rows: int = BATCH_ROWS,
    batch_bytes: int = BATCH_BYTES,
    flush_deadline_s: float = FLUSH_DEADLINE_S,
) -> MapResult:
    _check(table_namespace, source, fn, contract, concurrency, page_rows)
    plan = MapPlan(run, table_namespace, contract, fn, concurrency, cell_policies, linger_s,
                   batch_rows, batch_bytes)
    tally = MapTally(on_progress)
    ledger = OutcomeLedger()
    inflight: set[str] = set()  # keys admitted and not yet written: bounded by the pipeline
    staged = None
    if isinstance(source, (list, tuple)) and map_invocation_id is None:
        map_invocation_id = run.next_map_invocation_id(table_namespace)
    await retry_transient(lambda: sheets.ensure_sheet(
        run.port, run.scope.play_scope, table_namespace, contract))
    if isinstance(source, (list, tuple)):
        staged = await run.stage_array(table_namespace, map_invocation_id, list(source))
    try:
        with unwrap_single_error():
            async with trio.open_nursery() as nursery:
                # Capacities: one page ahead of admission; about two batches per worker in each
                # direction; completion batches unbuffered (the batcher grows the next batch
                # while the writer writes).
                pages_send, pages_recv = trio.open_memory_channel(1)
                work_send, work_recv = trio.open_memory_channel(2 * concurrency)
                outcome_send, outcome_recv = trio.open_memory_channel(2 * concurrency)
                flush_send, flush_recv = trio.open_memory_channel(0)
                await nursery.start(write_outcomes, plan, tally, ledger, inflight, flush_recv)
                await nursery.start(batch_outcomes, plan, outcome_recv, flush_send)
                async with work_recv, outcome_send:
                    for _ in range(concurrency):
                        await nursery.start(work, plan, tally, ledger, work_recv.clone(),
                                            outcome_send.clone())
                await nursery.start(admit_pages, plan, tally, inflight, pages_recv, work_send)
                if staged is not None:
                    await nursery.start(replay_pages, staged, pages_send)
                else:
                    await nursery.start(stream_pages, source, page_rows, pages_send)
    finally:
        await flush_unsettled(plan, tally, ledger, flush_deadline_s)
    tally.report()
    return tally.result(map_invocation_id)
