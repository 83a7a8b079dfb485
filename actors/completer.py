"""The completer of `run.map` and its writers: outcomes in batches to `engine.sheets.complete`.

How it works
- The **completer** (`batch_outcomes`) batches outcomes by rows, bytes and a short linger,
  and hands batches to the **writers** (`write_outcomes`, `COMPLETION_WRITERS` of them) over
  an unbuffered channel (the next batch grows while the writers are busy); each writes a
  batch with `engine.sheets.complete` and settles it in the map's state (`MapState.settle`:
  fenced rows recorded, a `stale_write_version` fence marks the map superseded).
- A map's tail is the exception to the linger: once admission is over and at most
  `TAIL_ROWS` rows are left to settle, the batch waits past its linger for the rest of them
  (up to `tail_hold_s` after its first outcome; the map's end flushes it at once). A small map
  then completes in one statement, not one a linger as its rows trickle out of a busy
  machine's workers (through a gateway each is a request).
- Two batches written at once never hold the same row: a row's key stays in the map's
  in-flight set until its batch settles, and a later duplicate is dropped at admission
  (`MapState.take_admission`), so their order changes nothing; settling is per ticket. Their
  transactions overlap on the server in the map's write group (`engine.sheets.write_group`),
  and one batch is encoded while the other's statement runs (`docs/guide/benchmarks.md`,
  the twenty-first pass).
- `flush_unsettled` runs in the map's `finally`: what the ledger still holds was computed but
  never confirmed written; it is written in a shielded scope with a deadline. A write that was
  interrupted but did commit is simply replayed (an identical completion is idempotent).
Who calls: `actors.mapper.map_rows`.
"""

from __future__ import annotations

import logging
import math

import trio

from runplane.engine import canonical
from runplane.engine.errors import EngineError
from runplane.engine.sheets import RowOutcome
from runplane.engine.sheets.outcome_inputs import encoded_data

from .map_options import TAIL_ROWS
from .map_state import MapPlan, MapState
from .phases import marked
from .retry import hurry_if_waiting

log = logging.getLogger("runplane.actors")

COMPLETION_WRITERS = 2  # batches written at once by one map


def outcome_bytes(outcome: RowOutcome) -> int:
    """A cheap estimate of an outcome's patch JSON size, for batching only (the engine chunks
    by exact bytes itself): the length of the patch text a worker encoded, else flat string
    and number fields summed, nested ones encoded."""
    size = 64 + len(outcome.error or "")
    encoded = encoded_data(outcome)
    if encoded is not None:
        return size + len(encoded[0])
    for field, value in (outcome.data or {}).items():
        if isinstance(value, str):
            size += len(field) + len(value) + 6
        elif isinstance(value, (dict, list)):
            size += len(field) + len(canonical.stable_dumps(value)) + 4
        else:
            size += len(field) + 24
    return size


async def batch_outcomes(plan: MapPlan, state: MapState, outcome_recv, flush_send,
                         *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Gather outcome batches into completion batches.

    A batch is handed to a writer when it reaches `batch_rows` or `batch_bytes` (waiting for
    one: backpressure), or when it has lingered `linger_s` and a writer is idle. The flush
    channel is unbuffered, so writers that are busy let the batch keep growing instead of
    queueing small ones: under load batches fill up, at a trickle they leave after the linger.
    The map's tail (`MapState.tail_fits` with `TAIL_ROWS`) lingers up to `tail_hold_s` instead.
    """
    task_status.started()
    tail_rows = min(plan.batch_rows, TAIL_ROWS)
    async with outcome_recv, flush_send:
        tickets: list[int] = []
        outcomes: list = []
        size = 0
        deadline = first_at = math.inf
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
                    first_at = trio.current_time()
                    deadline = first_at + plan.linger_s
                if len(outcomes) >= plan.batch_rows or size >= plan.batch_bytes:
                    await flush_send.send((tickets, outcomes))
                    tickets, outcomes, size, deadline = [], [], 0, math.inf
                    continue
            if outcomes and trio.current_time() >= deadline:
                if trio.current_time() < first_at + plan.tail_hold_s \
                        and state.tail_fits(tail_rows):
                    deadline = first_at + plan.tail_hold_s  # the rest of the map joins it
                    continue
                try:
                    flush_send.send_nowait((tickets, outcomes))
                except trio.WouldBlock:
                    deadline = trio.current_time() + plan.linger_s  # the writers are busy
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
            with state.writing():
                completion = await plan.complete(outcomes)
            state.settle(tickets, outcomes, completion)


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
                with state.writing():
                    completion = await plan.complete(chunk)
                state.count_flushed(chunk, completion)
        except EngineError as exc:
            log.warning("map %s: flushing %d computed outcomes failed: %s",
                        plan.table_namespace, len(outcomes), exc)
    if scope.cancelled_caught:
        log.warning("map %s: flush of %d computed outcomes ran past %.0fs",
                    plan.table_namespace, len(outcomes), deadline_s)
