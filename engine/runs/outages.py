"""Outages a run rode out, kept for its timeline: when each began and how long the run waited.

- A run's processes count the outages they ride out (`actors.retry.OutageWatch`) and write the
  ones that ended with the next heartbeat of a map's history (`actors.history`):
  `record_outages(port, scope, outages)` inserts them in one statement, keyed by the run and
  the outage's start, so a batch sent again changes nothing.
- The console's timeline reads them by the run's primary-key range (`engine.console.timeline`).
- An outage that exhausted the run's budget ends the run instead; it is not recorded here (the
  run's end says why).
"""

from __future__ import annotations

import datetime
from typing import Sequence

import attrs

from ..actions import action
from ..errors import InvalidInputError
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..values.codecs import FLOAT, NOTHING, RUN_SCOPE, TIMESTAMP, list_of, record
from ..values.scopes import RunScope, check_scope

MAX_OUTAGES = 100  # outages written in one call


@attrs.frozen
class Outage:
    """An outage a run rode out: when its wait began, and for how many seconds."""

    began_at: datetime.datetime
    seconds: float


OUTAGE = record(Outage, began_at=TIMESTAMP, seconds=FLOAT)

_RECORD = """
INSERT INTO {outages} (org_id, play, run_id, began_at, seconds)
SELECT $1, $2, $3, u.began_at, u.seconds
  FROM unnest($4::timestamptz[], $5::float8[]) AS u(began_at, seconds)
ON CONFLICT DO NOTHING
"""


@action("history.record_outages", params={"scope": RUN_SCOPE, "outages": list_of(OUTAGE)},
        result=NOTHING)
async def record_outages(port: Port, scope: RunScope, outages: Sequence[Outage]) -> None:
    """Record outages the run `scope` rode out (at most `MAX_OUTAGES` a call)."""
    check_scope(port, scope)
    if not 1 <= len(outages) <= MAX_OUTAGES or not all(
            isinstance(o, Outage) and o.seconds >= 0 for o in outages):
        raise InvalidInputError(f"outages must be 1 to {MAX_OUTAGES} Outage values with "
                                "seconds >= 0")
    sql = _RECORD.format(outages=table(port, "run_outages"))
    await with_connection(port, RECEIPTS_LANE, lambda conn: conn.execute(
        sql, scope.org_id, scope.play, scope.run_id, [o.began_at for o in outages],
        [float(o.seconds) for o in outages]))
