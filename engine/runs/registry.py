"""Runs and their fencing epochs.

`register(port, RunScope)` allocates the run's epoch from the `run_epochs` sequence the first time
the run is seen and returns the same epoch on every later call (a wake). Sequences only grow, so
a later run always gets a larger epoch; every fenced write compares epochs, never run ids.
The same statement records the run's terminal-outbox entry as `open` when it has none
(`engine.runs.outbox`: "this run may still be woken"), so opening a run is one round trip.
One statement: insert-if-absent, else read the stored row.

`get(port, RunScope)`, `by_epoch(port, PlayScope, epoch)` and `list_runs(port, PlayScope)` read
the registry back (the command line's run existence check, the run a fence names, the
recent-runs listing); they are plain reads. The two that find runs by something else than their
id take `only_runs` (the gateway fills it with a run-scoped token's `runs` claim): another run
is then not found, nor listed.
`record_command(port, RunScope, command)` stores how to resume a run (the command line records
the command that started it, so `runplane runs` can print it for runs still open).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Sequence

import attrs

from ..limits.bounds import is_int
from ..actions import action
from ..values.codecs import (
    INT, NOTHING, PLAY_SCOPE, RUN_REF, RUN_SCOPE, STR, TEXT, TIMESTAMP, list_of, optional, record,
)
from ..errors import InvalidInputError
from ..ports import RECEIPTS_LANE, Port, sequence_literal, table, with_connection
from .outbox import OutboxState
from .reissue import fetchrow_until_visible
from ..values.scopes import PlayScope, RunRef, RunScope, check_scope


MAX_COMMAND_CHARS = 8192


@attrs.frozen
class RunInfo:
    """A registered run as stored: its scope, its epoch, when it was first registered and, if
    recorded, the command that resumes it."""

    scope: RunScope
    epoch: int
    created_at: datetime.datetime
    command: str | None = None

    @property
    def run_id(self) -> str:
        return self.scope.run_id

    @property
    def ref(self) -> RunRef:
        return RunRef(self.scope, self.epoch)

RUN_INFO = record(RunInfo, scope=RUN_SCOPE, epoch=INT, created_at=TIMESTAMP,
                  command=optional(STR))

_REGISTER = f"""
WITH inserted AS (
    INSERT INTO {{runs}} (org_id, play, run_id, epoch)
    VALUES ($1, $2, $3, nextval({{seq}}::regclass))
    ON CONFLICT (org_id, play, run_id) DO NOTHING
    RETURNING epoch
), opened AS (
    INSERT INTO {{outbox}} (org_id, play, run_id, state) VALUES ($1, $2, $3, {OutboxState.OPEN.sql})
    ON CONFLICT (org_id, play, run_id) DO NOTHING
)
SELECT epoch FROM inserted
UNION ALL
SELECT epoch FROM {{runs}}
 WHERE org_id = $1 AND play = $2 AND run_id = $3 AND NOT EXISTS (SELECT 1 FROM inserted)
"""

_GET = """
SELECT org_id, play, run_id, epoch, created_at, command FROM {runs}
 WHERE org_id = $1 AND play = $2 AND run_id = $3
"""

_BY_EPOCH = """
SELECT org_id, play, run_id, epoch, created_at, command FROM {runs}
 WHERE org_id = $1 AND play = $2 AND epoch = $3
   AND ($4::text[] IS NULL OR run_id = ANY($4::text[]))
"""

_LIST = """
SELECT org_id, play, run_id, epoch, created_at, command FROM {runs}
 WHERE org_id = $1 AND play = $2 AND ($4::text[] IS NULL OR run_id = ANY($4::text[]))
 ORDER BY epoch DESC LIMIT $3
"""


@action("runs.register", params={"scope": RUN_SCOPE}, result=RUN_REF)
async def register(port: Port, scope: RunScope) -> RunRef:
    check_scope(port, scope)
    sql = _REGISTER.format(runs=table(port, "runs"), seq=sequence_literal(port, "run_epochs"),
                           outbox=table(port, "terminal_outbox"))

    # No row only when a concurrent registration committed after our snapshot: issue it again.
    row = await with_connection(port, RECEIPTS_LANE, lambda conn: fetchrow_until_visible(
        conn, sql, (scope.org_id, scope.play, scope.run_id), what=f"run {scope.run_id!r}"))
    return RunRef(scope, row["epoch"])


def _info(row) -> RunInfo:
    return RunInfo(RunScope(row["org_id"], row["play"], row["run_id"]), row["epoch"],
                   row["created_at"], row["command"])


@action("runs.get", params={"scope": RUN_SCOPE}, result=optional(RUN_INFO), writes=False)
async def get(port: Port, scope: RunScope) -> RunInfo | None:
    """The registered run `scope`, or None when it was never registered."""
    check_scope(port, scope)
    sql = _GET.format(runs=table(port, "runs"))
    row = await with_connection(
        port, RECEIPTS_LANE, lambda conn: conn.fetchrow(sql, scope.org_id, scope.play, scope.run_id)
    )
    return None if row is None else _info(row)


@action("runs.by_epoch", params={"scope": PLAY_SCOPE, "epoch": INT}, result=optional(RUN_INFO),
        writes=False, context=("only_runs",))
async def by_epoch(port: Port, scope: PlayScope, epoch: int, *,
                   only_runs: Sequence[str] | None = None) -> RunInfo | None:
    """The play's run holding fencing epoch `epoch` (a fence reports epochs), or None (also
    when `only_runs` is given and does not list it)."""
    check_scope(port, scope)
    if not is_int(epoch):
        raise InvalidInputError(f"epoch must be an integer, got {epoch!r}")
    sql = _BY_EPOCH.format(runs=table(port, "runs"))
    runs = None if only_runs is None else list(only_runs)
    row = await with_connection(
        port, "receipts", lambda conn: conn.fetchrow(sql, scope.org_id, scope.play, epoch, runs)
    )
    return None if row is None else _info(row)


@action("runs.list_runs", params={"scope": PLAY_SCOPE, "limit": INT}, result=list_of(RUN_INFO),
        writes=False, context=("only_runs",))
async def list_runs(port: Port, scope: PlayScope, *, limit: int = 10,
                    only_runs: Sequence[str] | None = None) -> list[RunInfo]:
    """The play's most recent runs (of `only_runs`, when given), newest (largest epoch) first,
    at most `limit` of them."""
    check_scope(port, scope)
    if not is_int(limit, 0):
        raise InvalidInputError(f"limit must be an integer >= 0, got {limit!r}")
    sql = _LIST.format(runs=table(port, "runs"))
    runs = None if only_runs is None else list(only_runs)
    rows = await with_connection(
        port, RECEIPTS_LANE, lambda conn: conn.fetch(sql, scope.org_id, scope.play, limit, runs)
    )
    return [_info(row) for row in rows]


_RECORD_COMMAND = "UPDATE {runs} SET command = $4 WHERE org_id = $1 AND play = $2 AND run_id = $3"


@action("runs.record_command", params={"scope": RUN_SCOPE, "command": TEXT}, result=NOTHING)
async def record_command(port: Port, scope: RunScope, command: str) -> None:
    """Store how to resume the run (a no-op for a run that is not registered)."""
    check_scope(port, scope)
    if not isinstance(command, str) or not command.strip() or len(command) > MAX_COMMAND_CHARS:
        raise InvalidInputError(
            f"command must be a non-empty string of at most {MAX_COMMAND_CHARS} characters"
        )
    sql = _RECORD_COMMAND.format(runs=table(port, "runs"))
    await with_connection(
        port, RECEIPTS_LANE,
        lambda conn: conn.execute(sql, scope.org_id, scope.play, scope.run_id, command),
    )


def new_run_id() -> str:
    """A time-ordered run id: a UUIDv7 (48-bit millisecond clock, then randomness)."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis << 80) | (0x7 << 76) | ((rand >> 68) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
