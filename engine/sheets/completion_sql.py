"""SQL of completion by exact key: the one statement per chunk that fences, applies and counts.

How it works
- `exact_statement` builds the statement of one chunk of outcomes whose rows are found by key,
  written into a `CompletionSheet` (`completion_parts`): it reads each row by its own key probe,
  decides its fence (`_fence`), applies the unfenced changes (status, data cells, cell meta,
  row policies), moves the counters, and reports the missing and fenced rows.
- On PostgreSQL >= 18 (`returning_old`) it is one fenced UPDATE returning the old status and
  cell meta (`RETURNING old.*`), the rows it did not update classified afterwards only when
  there are some; older servers read the rows first and update from that snapshot.
- The data patches of a chunk travel as one JSON array (expanded with `jsonb_array_elements`
  beside the other arrays in `ROWS FROM`): one jsonb value to send and parse instead of 10,000
  array elements.
Who calls: `engine.sheets.completion` only (the rows no key matched: `completion_repair_sql`).
This module does no I/O.
"""

from __future__ import annotations

import attrs

from .completion_parts import (
    PATCH, CompletionBinds, CompletionSheet, OutcomeChunk, base_meta, completion_binds,
    counter_ctes, field_binds, in_leased_unit, leased_units, row_version,
)
from .model import OutcomeStatus, RowStatus
from .statements import BindParams, Statement


@attrs.frozen
class _Exact:
    """One exact-key statement as it is written: the binds naming its arrays (`n`, and the
    chunk's errors, attempts and causes), whether its outcomes failed, and whether a failed
    outcome may replace an enriched row (`force_failed`)."""

    n: CompletionBinds
    errors: str
    attempts: str
    causes: str
    failed: bool
    force_failed: bool

    @property
    def target(self) -> RowStatus:
        """The status an applied outcome gives its row."""
        return RowStatus.FAILED if self.failed else RowStatus.ENRICHED


def _kept_by_failed(row: str, patch: str) -> str:
    """What of a failed outcome's patch `patch` applies to the stored row `row` (an alias):
    every cell the row has not completed (a failed outcome never takes back a completed cell).
    A completed outcome's patch applies whole."""
    return f"""(SELECT coalesce(jsonb_object_agg(k.key, k.value), '{{}}'::jsonb)
      FROM jsonb_each({patch}) AS k
     WHERE ({row}._cell_meta -> k.key ->> 'status') IS DISTINCT FROM {OutcomeStatus.COMPLETED.sql})"""


def _new_meta(target: RowStatus, row: str, patch: str, *, force_failed: bool = False) -> str:
    """New cell meta of the stored row `row` (an alias) for the outcome's patch expression
    `patch`. A row already in the `target` status may be a replay: its fields recorded
    identically but for `completed_at` keep the old entry. Other rows just take the patch (of a
    failed outcome, what `_kept_by_failed` keeps; all of it when `force_failed`: its completed
    cells become failed ones)."""
    if target == RowStatus.FAILED and not force_failed:
        patch = _kept_by_failed(row, patch)
    return f"""CASE WHEN {row}._status = {target.sql} THEN {row}._cell_meta || coalesce((
    SELECT jsonb_object_agg(e.key, CASE
               WHEN jsonb_typeof({row}._cell_meta -> e.key) = 'object'
                AND ({row}._cell_meta -> e.key) - 'completed_at' = e.value - 'completed_at'
               THEN {row}._cell_meta -> e.key ELSE e.value END)
      FROM jsonb_each({patch}) AS e), '{{}}'::jsonb)
    ELSE {row}._cell_meta || {patch} END"""



def _policy_sets(n: CompletionBinds, failed: bool) -> str:
    """The row-policy columns an applied outcome moves (`c` its input, `t` the row): the calls
    it took add to `_attempts`; a failed outcome counts its run once in `_failed_runs` (a wake
    of the same run, or a replay, counts nothing new), a completed one starts that count
    again."""
    if not failed:
        return ", _attempts = t._attempts + coalesce(c.attempts, 1), _failed_runs = 0"
    return (", _attempts = t._attempts + coalesce(c.attempts, 1),"
            " _failed_runs = t._failed_runs"
            f" + (t._failed_epoch IS DISTINCT FROM {n.version})::integer,"
            f" _failed_epoch = {n.version}")


def stored_input(n: CompletionBinds, row: str, source: str) -> str:
    """True when the outcome `source` (an alias with `data`) names a field that the stored row
    `row` holds as an input: a value without a cell-meta entry. Only a completion writes cell
    meta, for every field it writes; admission stores the input cells without any. So the row
    itself says which of its fields are inputs, whatever contract the request sent."""
    clashes = [f"({source}.data ? {name} AND {row}.{col} IS NOT NULL"
               f" AND NOT ({row}._cell_meta ? {name}))" for col, name in n.cols]
    return "(" + " OR ".join(clashes) + ")" if clashes else "false"


def _fence(n: CompletionBinds, already: str, source: str = "i") -> str:
    """Why a row was not applied (NULL when it may be): `s` is its stored state, `source` the
    outcome."""
    return f"""CASE WHEN s._write_version > {n.version} THEN 'stale_write_version'
                WHEN s._write_version < {n.version} THEN 'unadmitted'
                WHEN {n.attempt_id} IS NOT NULL AND s._attempt_id IS NOT NULL
                     AND s._attempt_id <> {n.attempt_id} THEN 'attempt_superseded'
                WHEN {in_leased_unit(n, "s._input_index")} THEN 'attempt_superseded'
                WHEN {stored_input(n, "s", source)} THEN 'input_field'
                {already}
           END"""


def _chunk_result(classified: str) -> str:
    """The statement's one result row; `classified` holds (ord, found, fence, prev_version)."""
    return f"""SELECT (SELECT count(*) FROM applied) AS updated,
       (SELECT count(*) FROM summary) + (SELECT count(*) FROM column_summary) AS counter_rows,
       (SELECT array_agg(ord ORDER BY ord) FROM {classified} WHERE NOT found) AS missing_ords,
       (SELECT array_agg(ord ORDER BY ord) FROM {classified} WHERE fence IS NOT NULL) AS fenced_ords,
       (SELECT array_agg(fence ORDER BY ord) FROM {classified} WHERE fence IS NOT NULL)
           AS fenced_reasons,
       (SELECT array_agg(prev_version ORDER BY ord) FROM {classified} WHERE fence IS NOT NULL)
           AS fenced_versions
"""


def exact_statement(sheet: CompletionSheet, chunk: OutcomeChunk, *, failed: bool,
                    force_failed: bool) -> Statement:
    """The exact-key statement of one chunk.

    Every output of `sheet.base_fields` is marked completed (failed where a failed outcome's
    row has not completed it); the cell counters of `chunk.counted` may move.
    With `force_failed` a failed outcome also applies to an enriched row, and every output it
    marks becomes a failed cell (completed ones included).
    With `sheet.units` (a write without an attempt) rows of shared-map units leased now are
    fenced `attempt_superseded` (`leased_units`).
    Rows are looked up one index probe per key (a LATERAL with LIMIT), so a chunk never scans
    the sheet whatever the planner believes about its size; the UPDATE's only condition on the
    sheet alone is the key (the version fence compares with `cur`, whose unfenced rows have
    `prev_version` = ours: see `_exact_returning_old` for why no bind may appear there).
    """
    binds = BindParams()
    n = completion_binds(binds, sheet, chunk)
    errors = binds.add(chunk.errors, "text[]")
    attempts = binds.add(chunk.attempts, "integer[]")
    causes = binds.add(chunk.causes, "text[]")
    exact = _Exact(field_binds(binds, n, sheet.columns, chunk), errors, attempts, causes,
                   failed, force_failed)
    build = _exact_returning_old if sheet.returning_old else _exact
    return binds.statement(build(sheet, exact))


def _sets(n: CompletionBinds, failed: bool) -> str:
    return _policy_sets(n, failed) + "".join(
        f", {col} = CASE WHEN c.data ? {name} THEN c.data -> {name} ELSE t.{col} END"
        for col, name in n.cols
    )


def _already(failed: bool, force_failed: bool) -> str:
    """The `already_completed` fence arm (failed outcomes only, unless forced)."""
    if failed and not force_failed:
        return f"WHEN s._status = {RowStatus.ENRICHED.sql} THEN 'already_completed'"
    return ""


def _exact(sheet: CompletionSheet, exact: _Exact) -> str:
    """The exact-key statement before PostgreSQL 18 (see `exact_statement`): the rows read
    first (`cur`), the UPDATE applied from that snapshot."""
    port, t, n, target = sheet.port, sheet.layout.qualified, exact.n, exact.target
    failed, force_failed = exact.failed, exact.force_failed
    data_changed = "".join(
        f" OR (i.data ? {name} AND s.{col} IS DISTINCT FROM i.data -> {name})"
        for col, name in n.cols
    )
    new_error = "i.error" if failed else "NULL::text"
    new_cause = "i.cause" if failed else "NULL::text"
    new_meta = _new_meta(target, row="s", patch="p.patch", force_failed=force_failed)
    return f"""
WITH input AS MATERIALIZED (
    SELECT u.key, u.data, u.meta, u.error, u.attempts, u.cause, u.ord
      FROM ROWS FROM ({n.keys}, jsonb_array_elements({n.data}), unnest({n.meta}),
                      unnest({exact.errors}), unnest({exact.attempts}), unnest({exact.causes}))
           WITH ORDINALITY AS u(key, data, meta, error, attempts, cause, ord)
),{leased_units(port, n) if n.units else ""}{base_meta(n, failed)},
cur AS MATERIALIZED (
    SELECT i.ord, i.key, i.data, i.error, i.attempts, i.cause, s._key IS NOT NULL AS found,
           s._status AS prev_status, s._write_version AS prev_version,
           s._cell_meta AS prev_meta, n.new_meta,
           {_fence(n, _already(failed, force_failed))} AS fence,
           (s._status IS DISTINCT FROM {target.sql} OR s._error IS DISTINCT FROM {new_error}
            OR s._cause IS DISTINCT FROM {new_cause}
            OR n.new_meta IS DISTINCT FROM s._cell_meta{data_changed}) AS changed
      FROM input i
      CROSS JOIN base b
      LEFT JOIN LATERAL (SELECT * FROM {t} AS s WHERE s._key = i.key LIMIT 1) AS s ON true
      CROSS JOIN LATERAL (SELECT {PATCH} AS patch) AS p
      CROSS JOIN LATERAL (SELECT {new_meta} AS new_meta) AS n
),
applied AS (
    UPDATE {t} AS t
       SET _status = {target.sql}, _error = c.error, _cause = c.cause, _run_id = {n.run_id},
           _cell_meta = c.new_meta,
           _attempt_expires_at = NULL, _version = {row_version(port)},
           _updated_at = now(){_sets(n, failed)}
      FROM cur c
     WHERE c.found AND c.fence IS NULL AND c.changed
       AND t._key = c.key AND t._write_version = c.prev_version
    RETURNING c.prev_status, c.prev_meta, c.new_meta
),{counter_ctes(port, n, "applied", target)}
{_chunk_result("cur")}"""


def _exact_returning_old(sheet: CompletionSheet, exact: _Exact) -> str:
    """The exact-key statement for PostgreSQL >= 18 (see `exact_statement`).

    The fenced UPDATE probes each row once and returns the old status and cell meta for the
    counters (`RETURNING old.*`). Its only condition on the sheet alone is the key: every fence
    compares the row with a column of `source` (`our_version`, `our_attempt`, `kept_status`),
    never with a bind. A condition such as `_write_version = <our version's bind>` would be estimated from the
    sheet's statistics (a version newer than the last `ANALYZE` matches "no row"), and the
    planner would scan the sheet for those few rows and join each to the whole chunk: a chunk
    of 10,000 rows then costs 10,000 times the rows of our version. As join conditions they
    are checked on the row each key probe found. Rows it did not update are classified afterwards from the
    statement's snapshot — and only when some row was not updated (a one-time filter), so the
    common all-applied chunk never probes the sheet twice.
    """
    port, t, n, target = sheet.port, sheet.layout.qualified, exact.n, exact.target
    failed, force_failed = exact.failed, exact.force_failed
    data_changed = "".join(
        f" OR (c.data ? {name} AND t.{col} IS DISTINCT FROM c.data -> {name})"
        for col, name in n.cols
    )
    not_enriched = "AND t._status <> c.kept_status" if failed and not force_failed else ""
    stored = "".join(f", {col}" for col, _ in n.cols)
    new_error = "c.error" if failed else "NULL::text"
    new_cause = "c.cause" if failed else "NULL::text"
    new_meta = _new_meta(target, row="t", patch="c.patch", force_failed=force_failed)
    return f"""
WITH {leased_units(port, n).strip() if n.units else ""}{base_meta(n, failed)},
source AS MATERIALIZED (
    SELECT i.key, i.data, i.error, i.attempts, i.cause, i.ord, {PATCH} AS patch,
           {n.version} AS our_version, {n.attempt_id} AS our_attempt,
           {RowStatus.ENRICHED.sql}::text AS kept_status
      FROM ROWS FROM ({n.keys}, jsonb_array_elements({n.data}), unnest({n.meta}),
                      unnest({exact.errors}), unnest({exact.attempts}), unnest({exact.causes}))
           WITH ORDINALITY AS i(key, data, meta, error, attempts, cause, ord)
      CROSS JOIN base b
),
applied AS (
    UPDATE {t} AS t
       SET _status = {target.sql}, _error = c.error, _cause = c.cause, _run_id = {n.run_id},
           _cell_meta = {new_meta},
           _attempt_expires_at = NULL, _version = {row_version(port)},
           _updated_at = now(){_sets(n, failed)}
      FROM source c
     WHERE t._key = c.key AND t._write_version = c.our_version
       AND (c.our_attempt IS NULL OR t._attempt_id IS NULL OR t._attempt_id = c.our_attempt)
       AND NOT {stored_input(n, "t", "c")} AND NOT {in_leased_unit(n, "t._input_index")}
       {not_enriched}
       AND (t._status IS DISTINCT FROM {target.sql} OR t._error IS DISTINCT FROM {new_error}{data_changed}
            OR t._cause IS DISTINCT FROM {new_cause} OR {new_meta} IS DISTINCT FROM t._cell_meta)
    RETURNING c.ord, old._status AS prev_status, old._cell_meta AS prev_meta,
              new._cell_meta AS new_meta
),{counter_ctes(port, n, "applied", target)},
rest AS MATERIALIZED (
    SELECT i.ord, s._key IS NOT NULL AS found, s._write_version AS prev_version,
           {_fence(n, _already(failed, force_failed))} AS fence
      FROM source i
      LEFT JOIN LATERAL (SELECT _key, _status, _write_version, _attempt_id, _input_index,
                                _cell_meta{stored}
                           FROM {t} AS s WHERE s._key = i.key LIMIT 1) AS s ON true
     WHERE (SELECT count(*) FROM applied) < (SELECT count(*) FROM source)
)
{_chunk_result("rest")}"""

