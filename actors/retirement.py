"""Retirement: removing a finished run's array-input facts, batch by batch, on the retirement lane.

How it works
- `finish_entry` calls `engine.array_input.retire_entry` until it reports `done`. Each call is one
  transaction that marks the run guard retired (so any sealer or page writer of the run is fenced
  by the guard row from then on) and deletes at most `RETIRE_BATCH_ROWS` facts. The guard itself
  is retained forever.
- `engine.array_input.retire` checks out on the `retirement` lane: background retirement holds
  at most that lane's permits and never starves foreground sheet or receipt work.
- The holder's outbox lease (`owner`) is renewed after every batch; when the renewal finds
  the lease gone (it expired and another drainer took the entry), this holder stops and leaves
  the rest to the new holder.
- Each step is idempotent (or fenced by the lease) and retried through transient store faults.
- `finish_entry` is the whole job for one outbox entry: retire, and mark the entry done with the
  last batch (one request). Both the run's own guard (`guard_retirement`, at the exit of a
  run that ended terminally, `actors.run`) and the supervisor call it; the run's guard sends
  the first batch itself, recording the entry pending with it, so a run that staged at most a
  batch of facts closes in one request.
"""

from __future__ import annotations

import logging

import attrs
import trio

from runplane.engine import array_input
from runplane.engine.array_input.values import RetireResult
from runplane.engine.errors import EngineError
from runplane.engine.ports import Port
from runplane.engine.values.scopes import RunScope

from runplane.engine.runs import outbox
from .phases import marked
from .retry import retry_transient

log = logging.getLogger("runplane.actors")

DEFAULT_LEASE_S = 60.0  # a run's own outbox lease while it retires
RELEASE_DEADLINE_S = 2.0  # releasing that lease when retirement stopped short
RECORD_DEADLINE_S = 5.0  # the shielded first batch that records the entry pending



@attrs.frozen
class RetirementOutcome:
    """What one retirement pass did: facts deleted, whether it reached the end, and whether the
    outbox entry was settled as done by this holder (False when its lease was lost)."""

    deleted: int
    finished: bool
    settled: bool = False


@marked("retirement")
async def record_and_retire(port: Port, scope: RunScope, owner: str, *,
                            lease_s: float) -> RetireResult:
    """A run's own first batch: record its outbox entry pending, leased to `owner`, and retire
    a batch in the same request (`array_input.retire_entry` with `record_lease_s`); hand the
    answer to `finish_entry` as its `first`."""
    return await retry_transient(lambda: array_input.retire_entry(
        port, scope, owner, record_lease_s=lease_s))


@marked("retirement")
async def finish_entry(
    port: Port, scope: RunScope, owner: str, *, lease_s: float = 60.0,
    first: RetireResult | None = None,
) -> RetirementOutcome:
    """Retire the run under `owner`'s lease, batch by batch, and settle its outbox entry as
    done: the last batch settles it in the same request (`array_input.retire_entry`). `first`
    is a first batch the caller sent already (the run's own close, which recorded the entry
    with it)."""
    deleted = 0
    result = first
    while True:
        if result is None:
            result = await retry_transient(lambda: array_input.retire_entry(port, scope, owner))
        deleted += result.deleted
        if result.done:
            return RetirementOutcome(deleted, True, result.settled)
        if not await retry_transient(lambda: outbox.renew(port, scope, owner, lease_s)):
            return RetirementOutcome(deleted, False)
        result = None


async def guard_retirement(port: Port, scope: RunScope, *, lease_s: float = DEFAULT_LEASE_S) -> bool:
    """Record the terminal run as pending, retire its array inputs, mark it done.

    Returns True when the entry is done. Store failures are logged and leave the entry pending
    (or, if even that could not be recorded, open) for a supervisor.
    """
    owner = outbox.new_owner_id("run")
    settled = False
    try:
        # The first batch records the entry pending in the same request (`retire_entry`):
        # shielded, with a deadline, so that a cancellation arriving just after the body ended
        # cannot leave a finished run looking wakeable.
        with trio.CancelScope(shield=True,
                              deadline=trio.current_time() + RECORD_DEADLINE_S) as recording:
            first = await record_and_retire(port, scope, owner, lease_s=lease_s)
        if recording.cancelled_caught:
            log.warning("run %s: recording the terminal outbox entry ran past %.0fs",
                        scope.run_id, RECORD_DEADLINE_S)
            return False
        await trio.lowlevel.checkpoint()  # a pending cancellation lands here, after the record
        outcome = await finish_entry(port, scope, owner, lease_s=lease_s, first=first)
        settled = True
        return outcome.settled
    except EngineError as exc:
        log.warning("run %s: retirement left to the supervisor: %s", scope.run_id, exc)
        return False
    finally:
        if not settled:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + RELEASE_DEADLINE_S):
                try:
                    await outbox.release(port, scope, owner)
                except EngineError as exc:
                    log.warning("run %s: lease release failed (it will expire): %s",
                                scope.run_id, exc)
