"""Rows in a call: what "running" means on every surface.

How it works
- A row is **running** while a live process has it inside a call of the map's function (not
  while it is admitted and waiting for a worker, nor while it waits out a retry's backoff).
  Only the process hosting the call knows, so every process hosting a map's rows (a run's own
  workers, each shared-map worker) writes its own count (`report`): one row of `row_calls` per
  (run, map, process), at least every `REPORT_S` seconds while the map runs, changed or not
  (`actors.row_calls.CallReporter`), and 0 once it stops calling (a clean end, Ctrl-C, SIGTERM).
- `running` sums the counts of processes seen in the last `FRESH_S` seconds, by run and table:
  the rows of a process that crashed stop counting within `FRESH_S` of its last report, those
  of one that ended cleanly at once.
- A report also deletes the play's rows older than `KEEP_S` (ended processes), by primary-key
  prefix, so the table stays as small as the play's live processes.
Who calls: `actors.row_calls` (reports); `runplane status`, the console and the command line's
progress (reads). Through a gateway these are the actions `row_calls.report` / `row_calls.running`.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from ..actions import action
from ..limits.bounds import is_int
from ..values.codecs import INT, NOTHING, PLAY_SCOPE, RUN_SCOPE, STR, TEXT, list_of, record
from ..errors import InvalidInputError
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..values.scopes import PlayScope, RunScope, check_scope

REPORT_S = 5.0   # a process hosting rows reports at least this often
FRESH_S = 15.0   # a report older than this no longer counts
KEEP_S = 3600.0  # a report older than this is deleted by the play's next report
MAX_TEXT = 200


@attrs.frozen
class RunningRows:
    """Rows in a call now, of one run's table (summed over its live processes)."""

    run_id: str
    table_namespace: str
    in_call: int


RUNNING_ROWS = record(RunningRows, run_id=STR, table_namespace=STR, in_call=INT)

_REPORT = """
WITH old AS (
    DELETE FROM {calls} WHERE org_id = $1 AND play = $2
       AND seen_at < now() - make_interval(secs => $8)
)
INSERT INTO {calls} AS c (org_id, play, run_id, map_key, process, table_namespace, in_call,
                          seen_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, now())
ON CONFLICT (org_id, play, run_id, map_key, process) DO UPDATE
    SET in_call = EXCLUDED.in_call, table_namespace = EXCLUDED.table_namespace, seen_at = now()
"""

_RUNNING = """
SELECT run_id, table_namespace, sum(in_call)::bigint AS in_call FROM {calls}
 WHERE org_id = $1 AND play = $2 AND seen_at > now() - make_interval(secs => $3)
   AND ($4::text[] IS NULL OR run_id = ANY($4::text[]))
 GROUP BY run_id, table_namespace
HAVING sum(in_call) > 0
 ORDER BY run_id, table_namespace
"""


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT or "\x00" in value:
        raise InvalidInputError(f"{name} must be a non-empty string without NUL of at most "
                                f"{MAX_TEXT} characters")
    return value


@action("row_calls.report", params={"scope": RUN_SCOPE, "map_key": TEXT, "process": TEXT,
                                    "table_namespace": TEXT, "in_call": INT}, result=NOTHING)
async def report(port: Port, scope: RunScope, map_key: str, process: str,
                 table_namespace: str, in_call: int) -> None:
    """Record that `process` has `in_call` rows of map `map_key` of run `scope` inside a call
    now (one upsert; see the module docstring)."""
    check_scope(port, scope)
    for name, value in (("map_key", map_key), ("process", process),
                        ("table_namespace", table_namespace)):
        _text(name, value)
    if not is_int(in_call, 0, 2**31 - 1):
        raise InvalidInputError(f"in_call must be an integer >= 0, got {in_call!r}")
    sql = _REPORT.format(calls=table(port, "row_calls"))
    await with_connection(port, RECEIPTS_LANE, lambda conn: conn.execute(
        sql, scope.org_id, scope.play, scope.run_id, map_key, process, table_namespace,
        in_call, KEEP_S))


@action("row_calls.running", params={"scope": PLAY_SCOPE}, result=list_of(RUNNING_ROWS),
        writes=False, context=("only_runs",))
async def running(port: Port, scope: PlayScope, *,
                  only_runs: Sequence[str] | None = None) -> list[RunningRows]:
    """The play's rows in a call now, by run and table (of `only_runs`, when given: the
    gateway fills it with a run-scoped token's runs)."""
    check_scope(port, scope)
    sql = _RUNNING.format(calls=table(port, "row_calls"))
    runs = None if only_runs is None else list(only_runs)
    rows = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetch(
        sql, scope.org_id, scope.play, FRESH_S, runs))
    return [RunningRows(r["run_id"], r["table_namespace"], r["in_call"]) for r in rows]


def in_call_sql(port: Port, source: str, run_id: str | None = None) -> str:
    """SQL: the rows in a call now of the table named by `source`'s org_id, play and
    table_namespace columns (`source` is a FROM alias, e.g. of `sheet_summary`), over every
    run, or of the run `run_id` (an SQL text expression) when given; for a reader that shows
    it beside a table's counters in the same statement."""
    run = "" if run_id is None else f" AND c.run_id = {run_id}"
    return (f"coalesce((SELECT sum(c.in_call) FROM {table(port, 'row_calls')} AS c"
            f" WHERE c.org_id = {source}.org_id AND c.play = {source}.play"
            f" AND c.table_namespace = {source}.table_namespace{run}"
            f" AND c.seen_at > now() - make_interval(secs => {float(FRESH_S)!r})), 0)::bigint")


def by_table(rows: Sequence[RunningRows]) -> dict[str, int]:
    """Rows in a call per table, over every run."""
    totals: dict[str, int] = {}
    for row in rows:
        totals[row.table_namespace] = totals.get(row.table_namespace, 0) + row.in_call
    return totals
