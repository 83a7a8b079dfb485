"""The workers of `run.map` and the releaser of rows whose retry backoff is over.

How it works
- **Workers** (`work`) call `await fn(row)` for each row of the batches admission hands out.
  An exception fails that row only (its message becomes the row's `_error`, and its cause,
  the message with the row's own input values masked, `_cause`); a return value
  must be a dict of output fields (None means no fields) that `canonical.normalize` accepts,
  or the row fails with a message saying why. A completed row's outputs are normalized and
  encoded once, here (`engine.sheets.outcome_inputs.completed_outcome`): completion writes that text. No permit is held while user code runs:
  permits are taken inside the engine calls, around database work only.
- Row policies (`actors.policies`): before a call the worker takes a token from the map's
  rate limit (`actors.pacing`); a call running past `row_timeout_s` is cancelled and fails
  with `timed out after N s`; a failed call the retry policy retries is deferred to the delay
  queue (`actors.backoff`) and the worker goes on with the next row — the **releaser**
  (`release_retries`) sends it back to the workers when its backoff is over. The outcome
  records the calls the row took.
- A sampled row call (tracing on, `RUNPLANE_TRACE_ROWS_RATIO` of them, default 1 %) runs
  inside a `runplane.row` span (`engine.observability.tracing`); tracing off, one check.
- Each computed outcome enters the map's ledger at once (`MapState.record`); a batch is handed
  to the completer when done, or after `HAND_ON_S` for a slow function.
Who calls: `actors.mapper.map_rows` starts these actors; `call_row` is also the shared
worker's (`actors.shared.worker`).
"""

from __future__ import annotations

import trio

from runplane.engine.canonical import normalize_fast
from runplane.engine.errors import InvalidInputError
from runplane.engine.observability import tracing
from runplane.engine.sheets import AdmittedRow, OutcomeStatus, RowOutcome
from runplane.engine.sheets.causes import cause_of
from runplane.engine.sheets.outcome_inputs import completed_outcome
from runplane.engine.sheets.previous_cells import PREVIOUS

from .admission import MAX_WORK_BATCH
from .map_state import MapPlan, MapState
from .policies import RowTimeoutError
from .row_functions import RowError

HAND_ON_S = 0.5            # a slow worker batch hands its outcomes on after this long, and reports


def error_message(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


def failed_outcome(admitted: AdmittedRow, calls: int, message: str,
                   outputs: dict | None = None) -> RowOutcome:
    """The failed outcome of a row, with its cause: the message with the row's own input values
    masked (the worker is where the inputs are known; `engine.sheets.causes`). `outputs`
    (normalized; a `RowError`'s) are written as completed cells; completion fails the rest."""
    meta = None
    if outputs:
        meta = {name: {"status": OutcomeStatus.COMPLETED.value} for name in outputs}
    return RowOutcome(admitted.key, OutcomeStatus.FAILED, data=outputs or None,
                      input_index=admitted.input_index, error=message, attempts=calls,
                      cause=cause_of(message, _inputs(admitted.row)), cell_meta=meta)


def _inputs(row: dict) -> dict:
    """A row as its inputs: without the previous cells admission may have added."""
    return {k: v for k, v in row.items() if k != PREVIOUS} if PREVIOUS in row else row


def _row_error_outcome(admitted: AdmittedRow, calls: int, exc: RowError) -> RowOutcome:
    """The outcome of a call that raised `RowError`: failed, with its outputs when they can be
    stored (else failed saying why)."""
    try:
        outputs = normalize_fast(exc.outputs, "RowError outputs")
    except InvalidInputError as problem:
        return failed_outcome(admitted, calls, f"{error_message(exc)} ({problem})")
    return failed_outcome(admitted, calls, error_message(exc), outputs)


async def call_row(plan: MapPlan, admitted: AdmittedRow,
                   calls: int) -> tuple[RowOutcome, Exception | None]:
    """Call the user function once on a row: its outcome (the row's `calls`-th call), and the
    exception the call raised (a `RowTimeoutError` when it ran past the row timeout) or None."""
    key, index = admitted.key, admitted.input_index
    gauge = plan.calls
    try:
        started = gauge.enter()  # "running": inside a call (`engine.runs.row_calls`)
        try:
            if plan.row_timeout_s is None:
                data = await plan.fn(admitted.row)
            else:
                with trio.move_on_after(plan.row_timeout_s) as scope:
                    data = await plan.fn(admitted.row)
                if scope.cancelled_caught:
                    raise RowTimeoutError(f"timed out after {plan.row_timeout_s:g} s")
        finally:
            gauge.leave(started)
    except RowError as exc:  # the row fails, keeping the outputs it names
        return _row_error_outcome(admitted, calls, exc), exc
    except Exception as exc:  # the row fails, the map goes on
        return failed_outcome(admitted, calls, error_message(exc)), exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return failed_outcome(
            admitted, calls,
            f"map function returned {type(data).__name__}, expected a dict of outputs"), None
    try:  # normalized and encoded once: completion takes the text as it is
        return completed_outcome(key, data, index, calls, "output"), None
    except InvalidInputError as exc:
        return failed_outcome(admitted, calls, error_message(exc)), None


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
    if tracing.ROWS and tracing.sampled():  # a sampled row call gets a span (off: one check)
        outcome, error = await tracing.row_call(call_row(plan, admitted, calls), admitted.key, calls)
    else:
        outcome, error = await call_row(plan, admitted, calls)
    if error is None:
        outcome = state.storable(plan.contract, outcome)
        state.observe(outcome, None)
        return outcome
    if isinstance(error, RowTimeoutError):
        state.tally.timed_out += 1
    outcome = state.storable(plan.contract, outcome)  # a RowError's outputs
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
        now = trio.lowlevel.current_clock().current_time  # `trio.current_time`, looked up once
        async for batch in work_recv:
            ticket, outcomes = state.open_batch()
            opened = now()
            for admitted in batch:
                outcome = await run_row(plan, state, admitted)
                if outcome is not None:
                    state.record(outcomes, outcome)
                state.resolve()
                if outcomes and now() - opened >= HAND_ON_S:
                    # A slow function: what is done is written (and shown) now, not when the
                    # whole batch is.
                    state.report()
                    await outcome_send.send((ticket, outcomes))
                    ticket, outcomes = state.open_batch()
                    opened = now()
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
