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
  last batch (one request). Both the run's own guard (`actors.run`) and the supervisor call it;
  the run's guard sends the first batch itself, recording the entry pending with it, so a run
  that staged at most a batch of facts closes in one request.
"""

from __future__ import annotations

import attrs

from runplane.engine import array_input
from runplane.engine.array_input.values import RetireResult
from runplane.engine.ports import Port
from runplane.engine.values.scopes import RunScope

from runplane.engine.runs import outbox
from .phases import marked
from .retry import retry_transient



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
