"""Bounded retirement of a run's array inputs: retire the guard, delete ≤128 facts per call.

How it works
- One statement locks the run guard `FOR UPDATE` (creating it already retired when the run never
  staged anything), marks it retired, and deletes up to `RETIRE_BATCH_ROWS` begin, page and seal
  facts of the run, found by the run's key-prefix range of each kind
  (`engine.values.keys.run_key_range`). The guard itself is kept forever, so every later writer and
  reader of the run refuses with `RetiredError` and nothing can re-grow.
- READ COMMITTED detail: a statement sees rows committed before it started. A writer holding the
  guard when we arrive (a page put, a begin, a final seal write) commits while we wait for the
  lock, so the call that *marks* the guard may not see that writer's fact. That call therefore
  reports `done` only after deleting once more with a fresh snapshot (taken after the lock, and
  after the mark under an execution role's transaction; after its commit otherwise) — no writer
  can commit after the mark. A call that finds the guard already retired in its own snapshot
  needs no second look. So a call is one or two statements, at most 128 facts, and `done` is
  true only when fewer than 128 were deleted and none can be left behind.
- Callers (the terminal outbox) repeat until `done`; a lost answer is safe to retry.
- `retire_entry(scope, owner)` is one batch that, when it is the last (`done`), also settles the
  run's outbox entry as done under `owner`'s lease (`engine.runs.outbox.mark_done`'s update, in
  the statement of the second look when there is one): a run's retirement ends in one request
  and one connection checkout, not two. Both are idempotent, so a retry of the pair is too.
  With `record_lease_s` it first records the terminal run as pending, leased to `owner`
  (`outbox.mark_pending`): a run's own close (`actors.retirement.guard_retirement`) is then one
  request for a run that staged at most a batch of facts, not two. An entry found done already
  answers done and settled, deleting nothing (someone else retired the run).
"""

from __future__ import annotations

import attrs

from ..actions import action
from ..runs import outbox
from ..values.codecs import FLOAT, RUN_SCOPE, TEXT, optional
from ..values.keys import run_key_range
from ..ports import RETIREMENT_LANE, Port, table, with_connection
from ..receipts import SQL_STATUSES
from ..pg import Connection
from ..runs.reissue import NotVisible, fetchrow_until_visible
from ..values.scopes import RunScope
from . import facts as F
from .values import DONE_ALREADY, RETIRE_BATCH_ROWS, RETIRE_RESULT, RetireResult

# Every statement here reaches `work_receipts` by key: a constant key, a key range, or the
# array of doomed keys (`k = ANY(ARRAY(...))`, an index lookup per key whatever the statistics
# say; a join `USING doomed` could be planned as a walk over the whole table).
def _candidates(t: str, run: str, ranges: list[str], limit: str) -> str:
    """Up to `limit` keys of the run's begin, page and seal facts, by key-prefix range."""
    parts = [
        f"(SELECT k FROM {t} WHERE k >= {low} AND k < {high} AND run_id = {run} "
        f"ORDER BY k LIMIT {limit})"
        for low, high in zip(ranges[::2], ranges[1::2])
    ]
    return "SELECT k FROM (" + " UNION ALL ".join(parts) + ") AS candidate"


# $1 guard key, $2 run id, $3 retired guard output, $4..$9 key ranges, $10 batch limit
_RETIRE = """
WITH created AS (
    INSERT INTO {t} (k, status, output, run_id) VALUES ($1, {COMPLETED}, $3::jsonb, $2)
    ON CONFLICT (k) DO NOTHING
    RETURNING k
), seen AS (
    SELECT output FROM {t} WHERE k = $1
), locked AS (
    SELECT k, status, run_id, output FROM {t} WHERE k = $1 FOR UPDATE
), valid AS (
    SELECT 1 FROM locked
     WHERE status = {COMPLETED} AND run_id = $2 AND output->>'kind' = 'array_input_guard'
       AND jsonb_typeof(output->'retired') = 'boolean'
), marked AS (
    UPDATE {t} AS g SET output = $3::jsonb, updated_at = now()
     WHERE g.k = $1 AND EXISTS (SELECT 1 FROM valid)
       AND (SELECT output->'retired' FROM locked) = 'false'::jsonb
    RETURNING g.k
), doomed AS (
    {candidates}
     WHERE EXISTS (SELECT 1 FROM valid)
     ORDER BY k LIMIT $10
), deleted AS (
    DELETE FROM {t} AS f WHERE f.k = ANY(ARRAY(SELECT k FROM doomed)) RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM created) AS created,
       (SELECT output->'retired' = 'true'::jsonb FROM seen) AS seen_retired,
       (SELECT status FROM locked) AS g_status, (SELECT run_id FROM locked) AS g_run,
       (SELECT output::text FROM locked) AS g_output,
       EXISTS (SELECT 1 FROM marked) AS marked,
       (SELECT count(*) FROM deleted) AS deleted
"""

# $1 run id, $2..$7 key ranges, $8 limit
_DELETE_UP_TO = """
WITH doomed AS (
    {candidates}
     ORDER BY k LIMIT $8
), deleted AS (
    DELETE FROM {t} AS f WHERE f.k = ANY(ARRAY(SELECT k FROM doomed)) RETURNING 1
)"""
_DELETE_MORE = _DELETE_UP_TO + """
SELECT count(*) FROM deleted
"""
# `_DELETE_MORE`, and when it leaves nothing behind (fewer than the limit deleted), the run's
# outbox entry settled as done under the owner's lease: $9 org, $10 play, $11 owner.
_DELETE_MORE_AND_SETTLE = _DELETE_UP_TO + """, settled AS (
    {settle}
       AND (SELECT count(*) FROM deleted) < $8
    RETURNING 1
)
SELECT (SELECT count(*) FROM deleted) AS deleted, EXISTS (SELECT 1 FROM settled) AS settled
"""


@attrs.frozen
class _Retirement:
    """One batch of a run's retirement, as a step on a connection (`run`); with `owner`, a
    batch that leaves nothing behind also settles the run's outbox entry as done under that
    owner's lease (`retire_entry`). Built, and its input checked, before any query."""

    scope: RunScope
    retire_sql: str
    more_sql: str
    ranges: list[str]
    owner: str | None = None
    settle_sql: str | None = None

    @classmethod
    def of(cls, port: Port, scope: RunScope, owner: str | None = None) -> _Retirement:
        scope = F.run_scope(port, scope)
        t = table(port, "work_receipts")
        ranges = [bound for kind in F.FACT_KINDS
                  for bound in run_key_range(scope.play_scope, kind, scope.run_id)]
        retire_sql = _RETIRE.format(
            t=t, candidates=_candidates(t, "$2", [f"${n}" for n in range(4, 10)], "$10"),
            **SQL_STATUSES)
        candidates = _candidates(t, "$1", [f"${n}" for n in range(2, 8)], "$8")
        if owner is None:  # `retire`: its batches never settle an entry
            return cls(scope, retire_sql, _DELETE_MORE.format(t=t, candidates=candidates),
                       ranges)
        outbox_t = table(port, "terminal_outbox")
        more_sql = _DELETE_MORE_AND_SETTLE.format(
            t=t, candidates=candidates,
            settle=outbox.settle_done_sql(outbox_t, "$9", "$10", "$1", "$11"))
        settle_sql = outbox.settle_done_sql(outbox_t, "$1", "$2", "$3", "$4")
        return cls(scope, retire_sql, more_sql, ranges, owner, settle_sql)

    def decide(self, row):
        if row["created"]:
            return row  # the run never staged: nothing to delete
        if row["g_status"] is None:
            raise NotVisible  # a peer created the guard after our snapshot
        F.guard_retired(row["g_status"], row["g_run"], row["g_output"], self.scope)  # corrupt → raise
        return row

    async def run(self, conn: Connection) -> RetireResult:
        # No BEGIN/COMMIT of ours: each statement is atomic on its own. Under an execution
        # role they run inside the checkout's transaction, which still holds the guard lock.
        scope = self.scope
        row = await fetchrow_until_visible(
            conn, self.retire_sql,
            (F.guard_key(scope), scope.run_id, F.GUARD_RETIRED_TEXT, *self.ranges,
             RETIRE_BATCH_ROWS),
            self.decide, what="the run guard",
        )
        deleted = row["deleted"]
        if row["created"] or row["seen_retired"] or deleted >= RETIRE_BATCH_ROWS:
            done = deleted < RETIRE_BATCH_ROWS
            if not done or self.owner is None:
                return RetireResult(done=done, deleted=deleted)
            settled = await conn.execute(self.settle_sql, scope.org_id, scope.play, scope.run_id,
                                         self.owner)
            return RetireResult(True, deleted, not settled.endswith(" 0"))
        # We saw the guard open: a writer may have committed while we waited for its lock.
        limit = RETIRE_BATCH_ROWS - deleted
        if self.owner is None:
            more = await conn.fetchval(self.more_sql, scope.run_id, *self.ranges, limit)
            return RetireResult(done=deleted + more < RETIRE_BATCH_ROWS, deleted=deleted + more)
        second = await conn.fetchrow(self.more_sql, scope.run_id, *self.ranges, limit,
                                     scope.org_id, scope.play, self.owner)
        total = deleted + second["deleted"]
        done = total < RETIRE_BATCH_ROWS
        return RetireResult(done, total, done and second["settled"])


@action("array_input.retire", params={"scope": RUN_SCOPE}, result=RETIRE_RESULT)
async def retire(port: Port, scope: RunScope) -> RetireResult:
    """Retire the run's array inputs and delete up to `RETIRE_BATCH_ROWS` of their facts."""
    return await with_connection(port, RETIREMENT_LANE, _Retirement.of(port, scope).run)


@action("array_input.retire_entry",
        params={"scope": RUN_SCOPE, "owner": TEXT, "record_lease_s": optional(FLOAT)},
        result=RETIRE_RESULT)
async def retire_entry(port: Port, scope: RunScope, owner: str, *,
                       record_lease_s: float | None = None) -> RetireResult:
    """`retire`, and once it is done, settle the run's outbox entry as done under `owner`'s
    lease (`settled`: False when the lease was lost), on one connection: the settling rides
    the batch's last statement. With `record_lease_s`, first record the entry pending under
    that lease (module docstring)."""
    retirement = _Retirement.of(port, scope, owner)
    pending = None if record_lease_s is None else outbox.pending_marker(
        port, scope, owner, record_lease_s)

    async def op(conn: Connection) -> RetireResult:
        if pending is not None and not await pending(conn):
            return DONE_ALREADY
        return await retirement.run(conn)

    return await with_connection(port, RETIREMENT_LANE, op)
