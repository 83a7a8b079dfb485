"""The terminal outbox: durable, leased to-do entries for retiring finished runs.

How it works
- One row of `terminal_outbox` per run (org, play, run id). Its `state` is a small machine:

      open ──(run body ends terminally)──▶ pending ──(array inputs retired)──▶ done

  Registering a run (`engine.runs.registry.register`, as `open_run` does before the body
  starts) records the entry as `open` in the same statement; `record_open` does it alone. `open` means "this run may
  still be woken": a run that was cancelled or whose process crashed stays `open`, so nothing
  retires the input a wake must replay. The retirement guard flips the entry to `pending` when
  the body ends terminally (returns, or raises anything but cancellation); that is the only
  moment the run's facts become garbage. Supervisors drain `pending` entries only (and, when
  configured with `abandon_after_s`, `open` entries untouched for that long: runs nobody will
  wake).
- Whoever works on an entry holds a lease: `lease_owner` and `lease_expires_at`. Claims pick due
  entries with `FOR UPDATE SKIP LOCKED` and set the lease in the same statement, so two drainers
  never take one entry at once and a crashed holder's entry becomes claimable again when its
  lease expires. Settling (done, or a retry time after a failure) applies only while the caller
  still holds the lease, so a holder that lost its lease cannot undo a newer holder's work.
  Retiring twice is harmless anyway: `engine.array_input.retire` is idempotent.
- Lease lengths and retry delays are bounded (`receipts.MAX_LEASE_S`, a week): a lease until
  the year 33715 would keep an entry from every supervisor (`InvalidInputError` past it).
- `claim_due(..., only_runs=R)` leases entries of the runs `R` only: the gateway passes a
  run-scoped token's `runs` claim, so such a token never leases another run's entry.
- Recording a run as it opens is foreground work (the `receipts` lane); everything else here is
  background work on the `retirement` lane.
- The run's own guard takes the lease when it marks the entry pending, retires at once, and
  releases the lease (shielded, best effort) if it is cancelled, so a supervisor picks the
  entry up without waiting for the lease to run out.
"""

from __future__ import annotations

import os
from typing import Awaitable, Callable, Iterable, Sequence

import attrs

from ..limits.bounds import is_int, is_number
from ..actions import action
from ..values.codecs import (
    BOOL, FLOAT, INT, PLAY_SCOPE, RUN_SCOPE, STR, TEXT, NOTHING, dict_of, enum_of, list_of,
    optional, record,
)
from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import RECEIPTS_LANE, RETIREMENT_LANE, Port, table, with_connection
from ..receipts import MAX_LEASE_S
from ..sql import SqlLiteral
from ..values.scopes import PlayScope, RunScope, check_scope



class OutboxState(SqlLiteral):
    """A `terminal_outbox` entry's `state` (the machine in the module docstring); SQL text
    writes `OutboxState.X.sql`."""

    OPEN = "open"        # the run may still be woken: nothing retires its input
    PENDING = "pending"  # the body ended terminally: its facts are garbage, to retire
    DONE = "done"        # retired

    @property
    def word(self) -> str:
        """The word people read for the state (the console, `runplane runs`): a pending entry's
        run is `retiring`."""
        return "retiring" if self is OutboxState.PENDING else self.value


@attrs.frozen
class OutboxEntry:
    """A claimed (or inspected) outbox entry."""

    scope: RunScope
    state: OutboxState = attrs.field(converter=OutboxState)
    attempts: int
    last_error: str | None = None


OUTBOX_ENTRY = record(OutboxEntry, scope=RUN_SCOPE, state=enum_of(OutboxState), attempts=INT,
                      last_error=optional(STR))


def new_owner_id(kind: str) -> str:
    """A lease owner id unique to this holder (process and random part)."""
    return f"{kind}:{os.getpid()}:{os.urandom(6).hex()}"


_S = OutboxState
_RECORD_OPEN = f"""
INSERT INTO {{t}} (org_id, play, run_id, state) VALUES ($1, $2, $3, {_S.OPEN.sql})
ON CONFLICT (org_id, play, run_id) DO NOTHING
"""

# Flip to pending and take the lease for the run's own guard, in one statement. A `done` entry
# stays done (its facts are already gone; retiring again would only re-check the guard).
_MARK_PENDING = f"""
INSERT INTO {{t}} AS o (org_id, play, run_id, state, lease_owner, lease_expires_at)
VALUES ($1, $2, $3, {_S.PENDING.sql}, $4, now() + make_interval(secs => $5))
ON CONFLICT (org_id, play, run_id) DO UPDATE
   SET state = {_S.PENDING.sql}, lease_owner = EXCLUDED.lease_owner,
       lease_expires_at = EXCLUDED.lease_expires_at, next_attempt_at = now(), updated_at = now()
 WHERE o.state <> {_S.DONE.sql}
RETURNING state
"""

_CLAIM_DUE = f"""
WITH due AS (
    SELECT org_id, play, run_id FROM {{t}}
     WHERE org_id = $1 AND ($6::text[] IS NULL OR play = ANY($6::text[]))
       AND ($7::text[] IS NULL OR run_id = ANY($7::text[]))
       AND (state = {_S.PENDING.sql}
            OR (state = {_S.OPEN.sql} AND $4::float8 IS NOT NULL
                AND updated_at < now() - make_interval(secs => $4::float8)))
       AND next_attempt_at <= now()
       AND (lease_expires_at IS NULL OR lease_expires_at < now())
     ORDER BY next_attempt_at, created_at
     LIMIT $3
       FOR UPDATE SKIP LOCKED
)
UPDATE {{t}} AS o
   SET state = {_S.PENDING.sql}, lease_owner = $2,
       lease_expires_at = now() + make_interval(secs => $5),
       attempts = o.attempts + 1, updated_at = now()
  FROM due
 WHERE o.org_id = due.org_id AND o.play = due.play AND o.run_id = due.run_id
RETURNING o.org_id, o.play, o.run_id, o.state, o.attempts, o.last_error
"""

_RENEW = f"""
UPDATE {{t}} SET lease_expires_at = now() + make_interval(secs => $5), updated_at = now()
 WHERE org_id = $1 AND play = $2 AND run_id = $3 AND lease_owner = $4 AND state = {_S.PENDING.sql}
"""


def settle_done_sql(t: str, org: str, play: str, run: str, owner: str) -> str:
    """The update that settles a run's entry as `done` while `owner` holds its lease, on table
    `t`, its org, play, run id and owner given as parameter references (`$1`…): the statement of
    `mark_done`, and part of `array_input.retire_entry`'s last batch."""
    return f"""
UPDATE {t} SET state = {_S.DONE.sql}, lease_owner = NULL, lease_expires_at = NULL,
       last_error = NULL, updated_at = now()
 WHERE org_id = {org} AND play = {play} AND run_id = {run} AND lease_owner = {owner}
   AND state = {_S.PENDING.sql}
"""


_MARK_DONE = settle_done_sql("{t}", "$1", "$2", "$3", "$4")

_RETRY_LATER = f"""
UPDATE {{t}} SET lease_owner = NULL, lease_expires_at = NULL, last_error = $5,
       next_attempt_at = now() + make_interval(secs => $6), updated_at = now()
 WHERE org_id = $1 AND play = $2 AND run_id = $3 AND lease_owner = $4 AND state = {_S.PENDING.sql}
"""

_RELEASE = """
UPDATE {t} SET lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
 WHERE org_id = $1 AND play = $2 AND run_id = $3 AND lease_owner = $4
"""

_GET = """
SELECT org_id, play, run_id, state, attempts, last_error FROM {t}
 WHERE org_id = $1 AND play = $2 AND run_id = $3
"""

_GET_MANY = """
SELECT org_id, play, run_id, state, attempts, last_error FROM {t}
 WHERE org_id = $1 AND play = $2 AND run_id = ANY($3::text[])
"""


def _seconds(value: object, name: str) -> float:
    """A lease length or a delay: a number of seconds from 0 (an expired lease, a retry now)
    to `MAX_LEASE_S`; `InvalidInputError` naming `name` otherwise, before any query."""
    if not is_number(value, 0, MAX_LEASE_S):
        raise InvalidInputError(f"{name} must be a number of seconds from 0 to {MAX_LEASE_S:g}, "
                                f"got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _key(scope: RunScope) -> tuple[str, str, str]:
    return scope.org_id, scope.play, scope.run_id


def _entry(row) -> OutboxEntry:
    return OutboxEntry(
        scope=RunScope(row["org_id"], row["play"], row["run_id"]),
        state=row["state"],
        attempts=row["attempts"],
        last_error=row["last_error"],
    )


async def _execute(port: Port, template: str, *args, lane: str = RETIREMENT_LANE) -> str:
    sql = template.format(t=table(port, "terminal_outbox"))
    return await with_connection(port, lane, lambda conn: conn.execute(sql, *args))


def _changed(status: str) -> bool:
    return not status.endswith(" 0")


@action("outbox.record_open", params={"scope": RUN_SCOPE}, result=NOTHING)
async def record_open(port: Port, scope: RunScope) -> None:
    """Record the run as `open` (a no-op when an entry exists in any state)."""
    check_scope(port, scope)
    await _execute(port, _RECORD_OPEN, *_key(scope), lane=RECEIPTS_LANE)


@action("outbox.mark_pending", params={"scope": RUN_SCOPE, "owner": TEXT, "lease_s": FLOAT},
        result=BOOL)
async def mark_pending(port: Port, scope: RunScope, owner: str, lease_s: float) -> bool:
    """Flip the entry to `pending` leased to `owner`; False when it was already `done`."""
    pending = pending_marker(port, scope, owner, lease_s)
    return await with_connection(port, RETIREMENT_LANE, pending)


def pending_marker(port: Port, scope: RunScope, owner: str, lease_s: float
                   ) -> Callable[[Connection], Awaitable[bool]]:
    """`mark_pending` as a step on a connection the caller holds (`array_input.retire_entry`
    marks and retires on one checkout); its input is checked here, before any query."""
    check_scope(port, scope)
    lease = _seconds(lease_s, "lease_s")
    sql = _MARK_PENDING.format(t=table(port, "terminal_outbox"))

    async def mark(conn: Connection) -> bool:
        return await conn.fetchval(sql, *_key(scope), owner, lease) == OutboxState.PENDING

    return mark


@action("outbox.claim_due", params={"owner": TEXT, "limit": INT, "lease_s": FLOAT,
        "abandon_after_s": optional(FLOAT), "plays": optional(list_of(STR))},
        result=list_of(OUTBOX_ENTRY), context=("only_runs",))
async def claim_due(
    port: Port, owner: str, *, limit: int, lease_s: float, abandon_after_s: float | None = None,
    plays: list[str] | None = None, only_runs: Sequence[str] | None = None,
) -> list[OutboxEntry]:
    """Lease up to `limit` due entries of the port's org to `owner` (skipping locked ones);
    with `plays`, only entries of those plays (a gateway token for some plays drains those);
    with `only_runs`, only entries of those runs (a run-scoped token's: the gateway fills it)."""
    if plays is not None and (not isinstance(plays, (list, tuple)) or not plays
                              or not all(isinstance(p, str) for p in plays)):
        raise InvalidInputError("plays must be a non-empty list of play names, or None")
    if not is_int(limit, 0):
        raise InvalidInputError(f"limit must be an integer >= 0, got {limit!r}")
    lease = _seconds(lease_s, "lease_s")
    sql = _CLAIM_DUE.format(t=table(port, "terminal_outbox"))
    abandon = None if abandon_after_s is None else float(abandon_after_s)
    wanted = None if plays is None else list(plays)
    runs = None if only_runs is None else list(only_runs)
    rows = await with_connection(
        port, RETIREMENT_LANE,
        lambda conn: conn.fetch(sql, port.org_id, owner, int(limit), abandon, lease, wanted, runs),
    )
    return [_entry(row) for row in rows]


@action("outbox.renew", params={"scope": RUN_SCOPE, "owner": TEXT, "lease_s": FLOAT}, result=BOOL)
async def renew(port: Port, scope: RunScope, owner: str, lease_s: float) -> bool:
    """Extend our lease; False when we no longer hold it."""
    check_scope(port, scope)
    lease = _seconds(lease_s, "lease_s")
    return _changed(await _execute(port, _RENEW, *_key(scope), owner, lease))


@action("outbox.mark_done", params={"scope": RUN_SCOPE, "owner": TEXT}, result=BOOL)
async def mark_done(port: Port, scope: RunScope, owner: str) -> bool:
    """Settle the entry as `done`; False when we no longer held its lease."""
    check_scope(port, scope)
    return _changed(await _execute(port, _MARK_DONE, *_key(scope), owner))


@action("outbox.retry_later", params={"scope": RUN_SCOPE, "owner": TEXT, "error": TEXT,
        "delay_s": FLOAT}, result=BOOL)
async def retry_later(port: Port, scope: RunScope, owner: str, error: str, delay_s: float) -> bool:
    """Release the lease, record the error and make the entry due again after `delay_s`."""
    check_scope(port, scope)
    delay = _seconds(delay_s, "delay_s")
    return _changed(
        await _execute(port, _RETRY_LATER, *_key(scope), owner, error[:2000], delay)
    )


@action("outbox.release", params={"scope": RUN_SCOPE, "owner": TEXT}, result=NOTHING)
async def release(port: Port, scope: RunScope, owner: str) -> None:
    """Give the lease up so another drainer may claim the entry at once."""
    check_scope(port, scope)
    await _execute(port, _RELEASE, *_key(scope), owner)


@action("outbox.get", params={"scope": RUN_SCOPE}, result=optional(OUTBOX_ENTRY), writes=False)
async def get(port: Port, scope: RunScope) -> OutboxEntry | None:
    """The run's outbox entry, or None when it has none."""
    check_scope(port, scope)
    sql = _GET.format(t=table(port, "terminal_outbox"))
    row = await with_connection(port, RETIREMENT_LANE, lambda conn: conn.fetchrow(sql, *_key(scope)))
    return None if row is None else _entry(row)


@action("outbox.get_many", params={"scope": PLAY_SCOPE, "run_ids": list_of(TEXT)},
        result=dict_of(OUTBOX_ENTRY), writes=False)
async def get_many(port: Port, scope: PlayScope, run_ids: Iterable[str]) -> dict[str, OutboxEntry]:
    """The outbox entries of the play's runs `run_ids`, by run id, in one query.

    A run with no entry (registered, but never opened through `open_run`) is absent from the
    result.
    """
    check_scope(port, scope)
    ids = list(dict.fromkeys(run_ids))
    if not ids:
        return {}
    sql = _GET_MANY.format(t=table(port, "terminal_outbox"))
    rows = await with_connection(
        port, RETIREMENT_LANE, lambda conn: conn.fetch(sql, scope.org_id, scope.play, ids)
    )
    entries = {row["run_id"]: _entry(row) for row in rows}
    return {run_id: entries[run_id] for run_id in ids if run_id in entries}
