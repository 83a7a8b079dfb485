"""`run.map`: a pipeline of actors from a source to the sheet, in flat memory.

How it works

    source ─pages─▶ admission ─row batches─▶ workers ×N ─outcome batches─▶ completer ─▶ writer
                       │ cache hits,           ▲      │ retries
                       │ blocked rows          └─ releaser ◀─ delay queue (with a retry policy)
                       ▼ straight to the tally

- The input comes as admission units (`actors.list_source.SourcePage`), in groups. A list
  source is read in place by admission (`ListSource`): its leading rows are first probed as
  given (in chunks through a window of `PROBES_IN_FLIGHT`; see `probe_unencoded`) — a settled
  rerun ends there, never encoding the list; from the first rows not all settled, the list is
  encoded once (canonical texts, row keys, the array input's page cuts) and cut into units of
  whole array-input pages (up to `page_rows` rows), grouped up to `PROBE_GROUP_ROWS`; the
  rows are the encoded ones — byte-identical to the staged page facts, so running them is
  replaying the staged input. For an async iterable the **source actor** cuts pages as rows
  arrive (a group of one each), the first of `FIRST_PAGE_ROWS` rows (so work starts soon even
  on a slow source), each next one twice as large up to `page_rows` (large pages admit
  faster).
- The **admission actor** first probes each unit by its row keys (`sheets.probe`, one
  read-only statement): when every row is settled — a fresh cache hit under the cell policies,
  or blocked (newer run, another attempt's live lease, given up), exactly as admission would
  decide — the unit is counted and nothing is sent or written. Otherwise it admits the unit in
  one transaction (`engine.sheets.admit`, cache hits counted, not listed). A list source is
  staged first (lazily, at the first unit that needs admitting: the begin fact is written, the
  pages are put and sealed in the background; see `actors.list_source`); a one-page unit of a
  sealed input is admitted from its stored page fact, other units with their rows (and their
  canonical texts, from the list's encoding). Once a probe settled a unit, the rest of its
  group is probed in one statement; if that does not settle, its units go one by one. After a
  unit whose rows were all new the next one is admitted without a probe. Admission splits the
  pending rows into small batches so all workers get a share. Duplicates: the engine drops
  them within a unit; a later duplicate of a row still in flight in this map is dropped here
  (counted as skipped); one whose first occurrence is already written is a cache hit (or, if
  that failed, is re-admitted and runs again, as the engine re-admits failed rows).
- **Workers** call `await fn(row)`. An exception fails that row only (its message becomes the
  row's `_error`); a return value must be a dict of output fields (None means no fields) that
  `canonical.normalize` accepts, or the row fails with a message saying why. No permit is held
  while user code runs: permits are taken inside the engine calls, around database work only.
- Row policies (`actors.policies`): before a call the worker takes a token from the map's
  rate limit (`actors.pacing`); a call running past `row_timeout_s` is cancelled and fails
  with `timed out after N s`; a failed call the retry policy retries is deferred to the delay
  queue (`actors.backoff`) and the worker goes on with the next row — the **releaser** sends
  it back to the workers when its backoff is over. The outcome records the calls the row took.
- **Superseded**: once a completion comes back fenced as `stale_write_version` (a newer run of
  the play took the rows), workers call the function for no further row (the calls in
  progress finish — at most one per worker), admission stops reading pages, the delay queue
  drops its rows, and what was computed is still written; the rows left are the newer run's.
  A map whose first rows all failed for one cause from the function **stops early** the same
  way (`actors.row_functions`); the rows left stay pending for the next run.
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
- **Reuse**: the keys of every unit in which admission found cache hits are kept
  (`MapState.note_reuse`) and recorded as the run's when the map ends, in one statement
  (`engine.sheets.record_reuse`): `read_rows(run_id=...)` then lists the rows the run reused,
  which stay untouched (their run, write version and cells are those of the run that wrote them).
- On a wake (same run id, same epoch), admission counts finished rows as cache hits, so only
  unfinished rows run again; a list source already staged is checked against the staged input
  (`ConflictError` for a different list) and its pages are admitted from their facts.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any, AsyncIterable, Awaitable, Callable, Sequence

import attrs
import trio

from runplane.engine import array_input, canonical, runs, sheets
from runplane.engine.errors import EngineError, InvalidInputError, leaf_errors
from runplane.engine.sheets import Admission, AdmittedRow, OutcomeStatus, RowOutcome

from .list_source import ListSource, SourcePage
from .map_state import FIRST_PAGE_ROWS, MapPlan, MapState
from .phases import marked
from .policies import RowTimeoutError
from .progress import MapResult
from .retry import hurry_if_waiting, retry_transient

if TYPE_CHECKING:
    from .run import Run

log = logging.getLogger("runplane.actors")

MAX_WORK_BATCH = 64        # rows per worker batch: small enough to share a page among workers
HAND_ON_S = 0.5            # a slow worker batch hands its outcomes on after this long, and reports
PROBE_GROUP_ROWS = 10_000   # rows of an encoded list probed together once probes settle rows
# A list's leading rows, probed before encoding: chunks of FIRST_PROBE_ROWS (a first run into
# a sheet of other rows stops after it), then of LEADING_PROBE_ROWS (a unit's 5 full pages, so
# no unit is cut short), PROBES_IN_FLIGHT at once (one is keyed while the server answers another).
FIRST_PROBE_ROWS = 1_000
LEADING_PROBE_ROWS = 5_000
PROBES_IN_FLIGHT = 2


# -- the source actor ------------------------------------------------------------------------
async def stream_pages(source: AsyncIterable[Any], page_rows: int, pages_send,
                       *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with pages_send:
        offset, page = 0, []
        size = min(FIRST_PAGE_ROWS, page_rows)
        try:
            async for row in source:
                page.append(row)
                if len(page) >= size:
                    await pages_send.send([SourcePage(offset, page)])
                    offset, page = offset + len(page), []
                    size = min(page_rows, 2 * size)
            if page:
                await pages_send.send([SourcePage(offset, page)])
        except trio.BrokenResourceError:
            pass  # admission stopped reading: the map was superseded or stopped early


# -- the admission actor ---------------------------------------------------------------------
async def admit_page(plan: MapPlan, page: SourcePage, listed: ListSource | None,
                     probe: bool, background: trio.Nursery | None
                     ) -> tuple[Admission, bool, list[str] | None]:
    """One page's admission, whether a probe settled it, and the keys of its cache hits (a
    superset: all its keys when known) or None: settled from its keys by a read-only probe when
    every row is (a fresh cache hit or blocked, judged exactly as admission judges it), else
    admitted — from its staged page fact for a list source (staging the list first), with its
    rows otherwise."""
    if not plan.fast_admission:
        if listed is not None:
            await listed.ensure_staged()
        admission = await plan.admit(page.rows, page.offset, cache_hits="rows")
        return admission, False, [row.key for row in admission.completed]
    if probe:
        settled, keys = await plan.probe_keyed(page.rows, page.offset, keys=page.keys)
        if settled is not None:
            return settled, True, keys
    staged = await listed.staged_page(page, background) if listed is not None else None
    admission = await plan.admit(page.rows, page.offset, keys=page.keys, staged_page=staged,
                                 texts=page.texts if staged is None else None)
    return admission, False, page.keys


async def probe_group(plan: MapPlan, group: list[SourcePage]) -> Admission | None:
    """Settle consecutive pages with one probe, or None (then each page goes on its own).
    Pages with a key in common are never probed together: each page deduplicates its own rows,
    so the counts stay exactly those of page-by-page admission."""
    keys = [key for page in group for key in page.keys or ()]
    rows = [row for page in group for row in page.rows]
    if len(keys) != len(rows) or len(set(keys)) != sum(len(set(page.keys)) for page in group):
        return None
    return await plan.probe(rows, group[0].offset, keys=keys)


def probe_bounds(rows: int) -> list[tuple[int, int]]:
    """The chunks a list's leading rows are probed in before it is encoded: `FIRST_PROBE_ROWS`,
    then `LEADING_PROBE_ROWS` each. Admission units never span a chunk boundary, so a chunk a
    probe settled is exactly the units it covers (see `probe_unencoded`)."""
    bounds = [(0, min(rows, FIRST_PROBE_ROWS))]
    while bounds[-1][1] < rows:
        low = bounds[-1][1]
        bounds.append((low, min(rows, low + LEADING_PROBE_ROWS)))
    return bounds


async def probe_unencoded(plan: MapPlan, state: MapState, listed: ListSource,
                          hand_out: Callable[[int, Admission], Awaitable[None]]) -> int:
    """Settle a list's leading rows by probes before encoding it (a settled rerun never needs
    the encoding); returns the first row not settled (a chunk boundary).

    Nothing is probed when the sheet held no row as the map began (`ListSource.sheet_rows`: a
    first run). When it holds as many rows as the list (likely a rerun), every chunk goes
    through a window of `PROBES_IN_FLIGHT`, the first two as one; otherwise the first chunk is
    probed alone first (a first run into a sheet of other rows stops there). In the window a
    probe is started as soon as an earlier one is answered, so one chunk is keyed (CPU, in
    `sheets.probe`) while the server answers another. Answers are taken in order; at the
    first chunk not settled no further probe starts, and the ones already started are let
    finish and dropped (a probe writes nothing; not cancelling it keeps its connection). A
    chunk holding a duplicate is left to the units (they deduplicate unit by unit, and a chunk
    may hold several units); a duplicate of an earlier chunk's row is in another unit anyway,
    so it counts as that unit's cache hit either way."""
    bounds = probe_bounds(listed.source_rows)
    if listed.sheet_rows == 0:
        return 0  # the sheet was empty when the map began: nothing can be settled
    settled_up_to = 0
    if listed.sheet_rows is not None and listed.sheet_rows >= listed.source_rows:
        # Likely a rerun: every chunk goes through the window, the first two as one (a small
        # first chunk would only wait there while the next one is keyed).
        rest = [(0, bounds[1][1]), *bounds[2:]] if len(bounds) > 1 else bounds
    else:
        first, keys = await plan.probe_keyed(listed.rows_between(*bounds[0]), 0)
        if first is None or first.skipped:
            return 0
        if first.cached:
            state.note_reuse(keys)
        await hand_out(bounds[0][1], first)
        settled_up_to = bounds[0][1]
        rest = bounds[1:]
    answers: list[tuple[Admission | None, list[str]]] = [(None, [])] * len(rest)
    answered = [trio.Event() for _ in rest]
    window = trio.Semaphore(PROBES_IN_FLIGHT)
    stop = False

    async def probe(i: int) -> None:
        try:
            answers[i] = await plan.probe_keyed(listed.rows_between(*rest[i]), rest[i][0])
        finally:
            answered[i].set()

    async def launch(nursery: trio.Nursery) -> None:
        for i in range(len(rest)):
            await window.acquire()
            if stop:
                return
            nursery.start_soon(probe, i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(launch, nursery)
        for i, (low, high) in enumerate(rest):
            await answered[i].wait()
            admission, keys = answers[i]
            stop = state.stopping or admission is None or bool(admission.skipped)
            window.release()
            if stop:
                break
            assert admission is not None
            if admission.cached:
                state.note_reuse(keys)
            await hand_out(high - low, admission)
            settled_up_to = high
    return settled_up_to


@marked("admission")
async def admit_pages(plan: MapPlan, state: MapState, pages_recv, work_send,
                      listed: ListSource | None = None, background: trio.Nursery | None = None,
                      *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The admission actor: pages from `pages_recv` (a streamed source), or the units of
    `listed` (a list source, read in place; `pages_recv` is then None)."""
    task_status.started()

    async def hand_out(rows_in_page: int, admission: Admission) -> None:
        pending = state.take_admission(rows_in_page, admission)
        size = max(1, min(MAX_WORK_BATCH, math.ceil(len(pending) / plan.concurrency)))
        for start in range(0, len(pending), size):
            batch = pending[start:start + size]
            await state.hand_out(len(batch))
            await work_send.send(batch)

    probe = True     # probe a unit before admitting it
    settled = False  # the last probe settled its unit: probe the rest of the group whole

    async def admit_group(group: list[SourcePage]) -> None:
        nonlocal probe, settled
        position, grouping = 0, plan.fast_admission
        while position < len(group) and not state.stopping:
            rest = group[position:]
            if settled and grouping and len(rest) > 1:
                admission = await probe_group(plan, rest)
                if admission is not None:
                    if admission.cached:
                        state.note_reuse([key for page in rest for key in page.keys or ()])
                    await hand_out(sum(len(page.rows) for page in rest), admission)
                    return
                grouping = False  # some unit of the group needs admitting: go one by one
            page = group[position]
            position += 1
            admission, settled, keys = await admit_page(plan, page, listed, probe, background)
            if admission.cached:
                state.note_reuse(keys if keys is not None else plan.row_keys(page.rows))
            # A unit whose rows were all new says the next ones likely are too: admit it
            # without probing first (a probe only saves work when rows are settled).
            probe = admission.inserted < len(page.rows)
            await hand_out(len(page.rows), admission)

    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(work_send)
        try:
            if listed is None:
                await stack.enter_async_context(pages_recv)
                async for group in pages_recv:
                    if state.stopping:
                        break
                    await admit_group(group)
                return
            start = 0
            if plan.fast_admission and listed.encoded is None:
                start = await probe_unencoded(plan, state, listed, hand_out)
                probe = False  # the rows at `start` were just probed: some need admitting
            if start < listed.source_rows and not state.stopping:
                await listed.encode()
                cut_at = frozenset(low for low, _ in probe_bounds(listed.source_rows))
                for group in listed.page_groups(PROBE_GROUP_ROWS, plan.page_rows, start, cut_at):
                    if state.stopping:
                        break
                    await admit_group(group)
        finally:
            state.end_admission()


# -- workers -----------------------------------------------------------------------------------
def error_message(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


async def call_row(plan: MapPlan, admitted: AdmittedRow,
                   calls: int) -> tuple[RowOutcome, Exception | None]:
    """Call the user function once on a row: its outcome (the row's `calls`-th call), and the
    exception the call raised (a `RowTimeoutError` when it ran past the row timeout) or None."""
    key, index = admitted.key, admitted.input_index
    try:
        if plan.row_timeout_s is None:
            data = await plan.fn(admitted.row)
        else:
            with trio.move_on_after(plan.row_timeout_s) as scope:
                data = await plan.fn(admitted.row)
            if scope.cancelled_caught:
                raise RowTimeoutError(f"timed out after {plan.row_timeout_s:g} s")
    except Exception as exc:  # the row fails, the map goes on
        return RowOutcome(key, OutcomeStatus.FAILED, input_index=index, error=error_message(exc),
                          attempts=calls), exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return RowOutcome(
            key, OutcomeStatus.FAILED, input_index=index, attempts=calls,
            error=f"map function returned {type(data).__name__}, expected a dict of outputs",
        ), None
    try:
        data = canonical.normalize_fast(data, "output")  # as is, when already canonical
    except InvalidInputError as exc:
        return RowOutcome(key, OutcomeStatus.FAILED, input_index=index, error=error_message(exc),
                          attempts=calls), None
    return RowOutcome(key, OutcomeStatus.COMPLETED, data=data, input_index=index, attempts=calls), None


async def run_row(plan: MapPlan, state: MapState, admitted: AdmittedRow) -> RowOutcome | None:
    """One row under the map's policies: its outcome, or None when it is not finished here
    (deferred to the delay queue for a retry, or left to the newer run that superseded us)."""
    if state.stopping:
        return None
    calls = state.calls_so_far(admitted.key) + 1
    if state.pacer is not None:
        await state.pacer.take()
        if state.stopping:
            return None
    state.count_call(calls)
    outcome, error = await call_row(plan, admitted, calls)
    if error is None:
        outcome = state.storable(plan.contract, outcome)
        state.observe(outcome, None)
        return outcome
    if isinstance(error, RowTimeoutError):
        state.tally.timed_out += 1
    retry = plan.retry
    if retry is not None and retry.retries(error, calls) and not state.stopping:
        state.defer(admitted, calls, retry.delay_s(calls))
        return None
    state.observe(outcome, error)
    return outcome


async def work(plan: MapPlan, state: MapState, work_recv, outcome_send,
               *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with work_recv, outcome_send:
        async for batch in work_recv:
            ticket, outcomes = state.open_batch()
            opened = trio.current_time()
            for admitted in batch:
                outcome = await run_row(plan, state, admitted)
                if outcome is not None:
                    state.record(outcomes, outcome)
                state.resolve()
                if outcomes and trio.current_time() - opened >= HAND_ON_S:
                    # A slow function: what is done is written (and shown) now, not when the
                    # whole batch is.
                    state.report()
                    await outcome_send.send((ticket, outcomes))
                    ticket, outcomes = state.open_batch()
                    opened = trio.current_time()
            state.report()
            if outcomes:
                await outcome_send.send((ticket, outcomes))
            else:  # every row was deferred or left: nothing to write
                state.close_empty_batch(ticket)


async def release_retries(state: MapState, work_send,
                          *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Send rows whose backoff is over back to the workers; end when none can come back."""
    queue = state.retries
    assert queue is not None
    task_status.started()
    async with work_send:
        while not queue.finished:
            due = queue.take_due(trio.current_time())
            for start in range(0, len(due), MAX_WORK_BATCH):
                batch = due[start:start + MAX_WORK_BATCH]
                queue.hand_out(len(batch))
                await work_send.send(batch)
            if not due:
                with trio.move_on_at(queue.next_due):
                    await queue.wait_for_change()


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


@marked("completion")
async def write_outcomes(plan: MapPlan, state: MapState, flush_recv,
                         *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with flush_recv:
        async for tickets, outcomes in flush_recv:
            state.settle(tickets, outcomes, await plan.complete(outcomes))


@marked("flush")
async def flush_unsettled(plan: MapPlan, state: MapState) -> None:
    """Write what was computed but not confirmed, shielded, within `plan.flush_deadline_s`."""
    outcomes = state.take_unsettled()
    if not outcomes:
        return
    deadline_s = plan.flush_deadline_s
    with trio.CancelScope(shield=True, deadline=trio.current_time() + deadline_s) as scope, \
            hurry_if_waiting():  # during an outage: one short try, no waiting out the budget
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
    """Run the pipeline of `plan` over `source` and count it (a list is encoded first and
    staged before its first row is admitted)."""
    listed = isinstance(source, (list, tuple, array_input.PagedRows))
    if not listed and not hasattr(source, "__aiter__"):
        raise InvalidInputError(
            f"source must be a list of rows or an async iterable, got {type(source).__name__}"
        )
    state = MapState.for_plan(plan, on_progress)
    listed_source = None
    if listed:
        if map_invocation_id is None:
            map_invocation_id = run.next_map_invocation_id(plan.table_namespace)
        scope = run.scope.map(plan.table_namespace, map_invocation_id)
        listed_source = ListSource(plan.port, scope, source if isinstance(
            source, array_input.PagedRows) else list(source))  # a PagedRows is read in place

    async def ensure_sheet() -> None:
        await retry_transient(lambda: sheets.ensure_sheet(
            plan.port, run.scope.play_scope, plan.table_namespace, plan.contract))

    with unwrap_single_error():  # three independent reads and writes at once
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ensure_sheet)
            if listed_source is not None:
                nursery.start_soon(listed_source.open)
                if plan.fast_admission:
                    nursery.start_soon(listed_source.count_sheet_rows, run.scope.play_scope)
    try:
        with unwrap_single_error():
            async with trio.open_nursery() as nursery:
                # Capacities: one streamed page ahead of admission (a list is read in place);
                # about two batches per worker in each
                # direction; completion batches unbuffered (the batcher grows the next batch
                # while the writer writes).
                work_send, work_recv = trio.open_memory_channel(2 * plan.concurrency)
                outcome_send, outcome_recv = trio.open_memory_channel(2 * plan.concurrency)
                flush_send, flush_recv = trio.open_memory_channel(0)
                await nursery.start(write_outcomes, plan, state, flush_recv)
                await nursery.start(batch_outcomes, plan, outcome_recv, flush_send)
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
    await record_reuse(plan, state)
    state.report()
    result = state.result(map_invocation_id, await newer_run_id(plan, state))
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
