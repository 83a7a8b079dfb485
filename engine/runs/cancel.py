"""Cancelling a run: a request stored on the run, seen by every process of the run.

- `request_cancel(port, RunScope)` stamps `runs.cancel_requested_at` once (a second request
  keeps the first time) and answers what it found, in one statement that decides and writes:
  `REQUESTED` (the run may still be working: each of its processes stops within its poll period
  plus the flush of what it computed), `ALREADY` (asked before), `FINISHED` (the run ended
  terminally: its outbox entry is `pending` or `done`, nothing is stamped) or `UNKNOWN` (never
  registered). A crashed run's entry stays `open`, so it is stamped too: its next wake stops at
  once, cancelled (a cancel means "do not go on"; a new run reuses every finished row).
- `cancel_requested(port, RunScope)` is one primary-key read; every process hosting a run's
  rows polls it every `CANCEL_POLL_S` (`actors.cancel`).

The gateway serves both as actions; `runs.cancel` is also the token claim that allows it.
"""

from __future__ import annotations

from ..actions import action
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..sql import SqlLiteral
from ..values.codecs import BOOL, RUN_SCOPE, enum_of
from ..values.scopes import RunScope, check_scope
from .outbox import OutboxState

CANCEL_POLL_S = 2.0  # how often a process of a run looks for a cancellation (at most every 2 s)


class CancelAnswer(SqlLiteral):
    """What `request_cancel` found."""

    REQUESTED = "requested"  # stamped now: the run's processes stop
    ALREADY = "already"      # stamped before
    FINISHED = "finished"    # the run ended terminally: nothing to stop
    UNKNOWN = "unknown"      # no such run


_REQUEST = f"""
WITH target AS (
    SELECT r.cancel_requested_at, o.state
      FROM {{runs}} r
      LEFT JOIN {{outbox}} o
        ON o.org_id = r.org_id AND o.play = r.play AND o.run_id = r.run_id
     WHERE r.org_id = $1 AND r.play = $2 AND r.run_id = $3
), stamped AS (
    UPDATE {{runs}} r SET cancel_requested_at = now()
      FROM target t
     WHERE r.org_id = $1 AND r.play = $2 AND r.run_id = $3
       AND t.cancel_requested_at IS NULL
       AND (t.state IS NULL OR t.state = {OutboxState.OPEN.sql})
    RETURNING 1
)
SELECT CASE
         WHEN EXISTS (SELECT 1 FROM stamped) THEN {CancelAnswer.REQUESTED.sql}
         WHEN t.state IS NOT NULL AND t.state <> {OutboxState.OPEN.sql}
           THEN {CancelAnswer.FINISHED.sql}
         ELSE {CancelAnswer.ALREADY.sql}
       END
  FROM target t
"""

_REQUESTED = """
SELECT cancel_requested_at IS NOT NULL FROM {runs}
 WHERE org_id = $1 AND play = $2 AND run_id = $3
"""


@action("runs.cancel", params={"scope": RUN_SCOPE}, result=enum_of(CancelAnswer))
async def request_cancel(port: Port, scope: RunScope) -> CancelAnswer:
    """Ask every process of the run `scope` to stop its rows and end the run as cancelled."""
    check_scope(port, scope)
    sql = _REQUEST.format(runs=table(port, "runs"), outbox=table(port, "terminal_outbox"))
    answer = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetchval(
        sql, scope.org_id, scope.play, scope.run_id))
    return CancelAnswer.UNKNOWN if answer is None else CancelAnswer(answer)


@action("runs.cancel_requested", params={"scope": RUN_SCOPE}, result=BOOL, writes=False)
async def cancel_requested(port: Port, scope: RunScope) -> bool:
    """Whether the run `scope` was asked to stop (False for a run never registered)."""
    check_scope(port, scope)
    sql = _REQUESTED.format(runs=table(port, "runs"))
    found = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetchval(
        sql, scope.org_id, scope.play, scope.run_id))
    return bool(found)
