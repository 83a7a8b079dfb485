"""A sheet's counters: where writers add their deltas, and what readers sum.

How it works
- Ordinary writers serialize on the sheet's `sheet_summary` row (`sheet_txn`) and add their
  deltas to it and to `sheet_column_summary` (`summary_update`, `column_update`).
- The writers of one shared map write at once (`sheet_txn`, concurrent mode), and so do a plain
  map's own writes while its write group's token holds (`write_group`): each holds the
  summary row `FOR SHARE` and adds its deltas to its own rows of `sheet_counter_deltas` and
  `sheet_column_deltas`, keyed by its backend's pid (`pg_backend_pid()`: two backends alive at
  once never share one, so these writers never wait on each other's counter rows).
- Readers read `SUMMARY_SOURCE` and `COLUMN_SOURCE` instead of the tables: the stored counters
  plus every delta not folded yet. An ordinary writer whose lock statement finds deltas
  (`HAS_DELTAS`) folds them into the summary rows with its next statement (`FOLD`), so they do
  not pile up.
- A database session folds too, but by zeroing its delta rows (`ZERO_FOLD`), not deleting
  them: it holds no DELETE on shared tables, which would let it LOCK them. A zeroed row stays
  (one for each backend that wrote through a session; that backend's next write adds to it)
  until the next ordinary writer of an owner's login deletes it with the rest. For a session the
  lock statement asks for deltas that are not all zero (`has_deltas`), so a zeroed row does not
  make every later writer fold again; for everyone else any delta row counts, zero or not: it
  is also the evidence that a concurrent writer changed rows (`lists`, `write_ledger`), and a
  shared map's writer may leave a row of zeros (it rewrote completed rows).
"""

from __future__ import annotations

from typing import Mapping

from ..ports import Port, table
from .model import RowStatus

# The sheet summary rows as readers see them: stored counters plus unfolded deltas. Use it
# where a table name goes, with an alias: `FROM {summary} AS s`.
SUMMARY_SOURCE = """(
SELECT s.org_id, s.play, s.table_namespace, s.table_name, s.updated_at,
       s.total + coalesce(d.total, 0) AS total, s.queued + coalesce(d.queued, 0) AS queued,
       s.running + coalesce(d.running, 0) AS running,
       s.completed + coalesce(d.completed, 0) AS completed,
       s.failed + coalesce(d.failed, 0) AS failed
  FROM {summary} AS s
  LEFT JOIN LATERAL (
      SELECT sum(x.total)::bigint AS total, sum(x.queued)::bigint AS queued,
             sum(x.running)::bigint AS running, sum(x.completed)::bigint AS completed,
             sum(x.failed)::bigint AS failed
        FROM {deltas} AS x
       WHERE x.org_id = s.org_id AND x.play = s.play AND x.table_namespace = s.table_namespace
  ) AS d ON true)"""

# The column counter rows as readers see them (a field may have deltas only).
COLUMN_SOURCE = """(
SELECT u.org_id, u.play, u.table_namespace, u.field,
       sum(u.completed)::bigint AS completed, sum(u.failed)::bigint AS failed
  FROM (SELECT org_id, play, table_namespace, field, completed, failed FROM {column_summary}
        UNION ALL
        SELECT org_id, play, table_namespace, field, completed, failed FROM {column_deltas}
       ) AS u
 GROUP BY u.org_id, u.play, u.table_namespace, u.field)"""


def summary_source(port: Port) -> str:
    return SUMMARY_SOURCE.format(summary=table(port, "sheet_summary"),
                                 deltas=table(port, "sheet_counter_deltas"))


def column_source(port: Port) -> str:
    return COLUMN_SOURCE.format(column_summary=table(port, "sheet_column_summary"),
                                column_deltas=table(port, "sheet_column_deltas"))


def summary_update(port: Port, *, concurrent: bool, org: str, play: str, namespace: str,
                   deltas: Mapping[str, str], source: str, condition: str) -> str:
    """The body of a CTE adding `deltas` (counter -> SQL expression over `source`, a FROM item
    such as `delta AS d`) to the sheet's counters when `condition` holds; RETURNING 1."""
    if not concurrent:
        sets = ",\n           ".join(f"{name} = s.{name} + ({expr})"
                                     for name, expr in deltas.items())
        return f"""
    UPDATE {table(port, "sheet_summary")} AS s
       SET {sets},
           updated_at = now()
      FROM {source}
     WHERE s.org_id = {org} AND s.play = {play} AND s.table_namespace = {namespace}
       AND {condition}
    RETURNING 1"""
    names = ", ".join(deltas)
    values = ", ".join(f"({expr})" for expr in deltas.values())
    sets = ", ".join(f"{name} = s.{name} + EXCLUDED.{name}" for name in deltas)
    return f"""
    INSERT INTO {table(port, "sheet_counter_deltas")} AS s
           (org_id, play, table_namespace, slot, {names})
    SELECT {org}, {play}, {namespace}, pg_backend_pid(), {values}
      FROM {source}
     WHERE {condition}
    ON CONFLICT (org_id, play, table_namespace, slot) DO UPDATE SET {sets}
    RETURNING 1"""


def previous_statuses() -> str:
    """The select list counting, of the moved rows (a `prev_status` column each), how many were
    of each row status before: `was_pending`, `was_running`, … (one per `RowStatus`)."""
    return ",\n           ".join(
        f"count(*) FILTER (WHERE prev_status = {status.sql}) AS was_{status.value}"
        for status in RowStatus)


def status_deltas(total: str, gained: Mapping[RowStatus, str]) -> dict[str, str]:
    """`summary_update`'s deltas for rows that moved between statuses (`previous_statuses`
    counted as `d`): `total` adds to the total, each status's counter (`RowStatus.counter`)
    loses the rows that were of it and gains `gained[status]`."""
    deltas = {"total": total}
    for status in RowStatus:
        more = gained.get(status)
        deltas[status.counter] = f"- d.was_{status.value}" + (f" + {more}" if more else "")
    return deltas


def column_update(port: Port, *, concurrent: bool, org: str, play: str, namespace: str,
                  source: str, condition: str) -> str:
    """The body of a CTE adding per-field deltas (`v.field`, `v.completed`, `v.failed` of
    `source`) to the column counters when `condition` holds; RETURNING 1."""
    if not concurrent:
        target, slot, key = table(port, "sheet_column_summary"), "", ""
    else:
        target, slot, key = table(port, "sheet_column_deltas"), " pg_backend_pid(),", ", slot"
    columns = "slot, " if concurrent else ""
    return f"""
    INSERT INTO {target} AS c (org_id, play, table_namespace, field, {columns}completed, failed)
    SELECT {org}, {play}, {namespace}, v.field,{slot} v.completed, v.failed
      FROM {source}
     WHERE {condition}
    ON CONFLICT (org_id, play, table_namespace, field{key}) DO UPDATE
       SET completed = c.completed + EXCLUDED.completed, failed = c.failed + EXCLUDED.failed
    RETURNING 1"""


# The fold: the sheet's counter deltas moved into its summary rows ($1 org, $2 play, $3 namespace).
# Run by an ordinary writer right after its lock statement, which found deltas: it holds the
# summary row, so no concurrent writer is inside a transaction and this statement's snapshot
# sees every delta committed. What it takes (`taken`, `taken_columns`) is added to the summary
# rows by the same tail (`_INTO_SUMMARIES`) either way.
_INTO_SUMMARIES = """, summary AS (
    UPDATE {summary} AS s
       SET total = s.total + f.total, queued = s.queued + f.queued,
           running = s.running + f.running, completed = s.completed + f.completed,
           failed = s.failed + f.failed
      FROM (SELECT coalesce(sum(total), 0)::bigint AS total,
                   coalesce(sum(queued), 0)::bigint AS queued,
                   coalesce(sum(running), 0)::bigint AS running,
                   coalesce(sum(completed), 0)::bigint AS completed,
                   coalesce(sum(failed), 0)::bigint AS failed FROM taken) AS f
     WHERE s.org_id = $1 AND s.play = $2 AND s.table_namespace = $3
)
INSERT INTO {column_summary} AS c (org_id, play, table_namespace, field, completed, failed)
SELECT $1, $2, $3, f.field, sum(f.completed)::bigint, sum(f.failed)::bigint
  FROM taken_columns AS f GROUP BY f.field
ON CONFLICT (org_id, play, table_namespace, field) DO UPDATE
   SET completed = c.completed + EXCLUDED.completed, failed = c.failed + EXCLUDED.failed
"""

FOLD = """
WITH taken AS (
    DELETE FROM {deltas} AS x
     WHERE x.org_id = $1 AND x.play = $2 AND x.table_namespace = $3
    RETURNING x.total, x.queued, x.running, x.completed, x.failed
), taken_columns AS (
    DELETE FROM {column_deltas} AS x
     WHERE x.org_id = $1 AND x.play = $2 AND x.table_namespace = $3
    RETURNING x.field, x.completed, x.failed
)""" + _INTO_SUMMARIES

# The fold of a database session (module docstring): its delta rows zeroed in place instead of
# deleted. The rows are read `FOR UPDATE` first (a session holds UPDATE on them), so the sums
# moved are what is zeroed; rows already all zeros are left alone.
ZERO_FOLD = """
WITH taken AS MATERIALIZED (
    SELECT x.slot, x.total, x.queued, x.running, x.completed, x.failed FROM {deltas} AS x
     WHERE x.org_id = $1 AND x.play = $2 AND x.table_namespace = $3
       AND (x.total <> 0 OR x.queued <> 0 OR x.running <> 0 OR x.completed <> 0
            OR x.failed <> 0) FOR UPDATE
), zeroed AS (
    UPDATE {deltas} AS x SET total = 0, queued = 0, running = 0, completed = 0, failed = 0
      FROM taken AS h
     WHERE x.org_id = $1 AND x.play = $2 AND x.table_namespace = $3 AND x.slot = h.slot
), taken_columns AS MATERIALIZED (
    SELECT x.field, x.slot, x.completed, x.failed FROM {column_deltas} AS x
     WHERE x.org_id = $1 AND x.play = $2 AND x.table_namespace = $3
       AND (x.completed <> 0 OR x.failed <> 0) FOR UPDATE
), zeroed_columns AS (
    UPDATE {column_deltas} AS x SET completed = 0, failed = 0
      FROM taken_columns AS h
     WHERE x.org_id = $1 AND x.play = $2 AND x.table_namespace = $3
       AND x.field = h.field AND x.slot = h.slot
)""" + _INTO_SUMMARIES

# Whether the sheet has deltas to fold (binds: org, play, namespace as text); `{live}` is empty,
# or the condition that a row is not all zeros (a database session's, module docstring).
HAS_DELTAS = """(EXISTS (SELECT 1 FROM {deltas} AS x
                  WHERE x.org_id = {org} AND x.play = {play} AND x.table_namespace = {ns}{live})
         OR EXISTS (SELECT 1 FROM {column_deltas} AS x
                     WHERE x.org_id = {org} AND x.play = {play} AND x.table_namespace = {ns}
                           {live_columns}))"""
_LIVE = """
                    AND (x.total <> 0 OR x.queued <> 0 OR x.running <> 0 OR x.completed <> 0
                         OR x.failed <> 0)"""
_LIVE_COLUMNS = " AND (x.completed <> 0 OR x.failed <> 0)"


def folds_by_zeroing(port: Port) -> bool:
    """Whether writers on `port` fold deltas by zeroing them (`ZERO_FOLD`): a database session
    (whose sheet lock keys are given outright, `PortSettings.sheet_lock_keys`), which holds no
    DELETE on shared tables."""
    return bool(port.settings.sheet_lock_keys)


def fold_statement(port: Port) -> str:
    return (ZERO_FOLD if folds_by_zeroing(port) else FOLD).format(
        deltas=table(port, "sheet_counter_deltas"),
        column_deltas=table(port, "sheet_column_deltas"),
        summary=table(port, "sheet_summary"),
        column_summary=table(port, "sheet_column_summary"))


def has_deltas(port: Port, org: str, play: str, namespace: str) -> str:
    zeroing = folds_by_zeroing(port)
    return HAS_DELTAS.format(deltas=table(port, "sheet_counter_deltas"),
                             column_deltas=table(port, "sheet_column_deltas"),
                             org=org, play=play, ns=namespace,
                             live=_LIVE if zeroing else "",
                             live_columns=_LIVE_COLUMNS if zeroing else "")
