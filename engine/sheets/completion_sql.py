"""SQL of completion: the exact-key statements, the insertion of missing rows, the repair.

How it works
- `exact_statement` builds the one statement per chunk that fences, applies and counts (with
  `RETURNING old.*` on PostgreSQL >= 18, a second probe of the rows otherwise);
  `insert_statement` the one that inserts completed rows no key or input index matched;
  `repair_targets_statement` the lookup of missing keys' rows by input index. Each allocates
  its binds as it writes the text and returns both (`statements.Statement`); field names always
  travel as binds.
- The data patches of a chunk travel as one JSON array (expanded with `jsonb_array_elements`
  beside the other arrays in `ROWS FROM`): one jsonb value to send and parse instead of 10,000
  array elements.
- Counter deltas (`_counter_ctes`) come from the rows the statement changed: status
  transitions for `sheet_summary`, cell-meta status transitions of the counted fields for
  `sheet_column_summary`, both in one pass over the changed rows.
Who calls: `engine.sheets.completion` only.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from ..ports import Port, sequence_literal, table

from .counters import column_update, summary_update
from .layout import SheetColumns, SheetLayout
from .model import OutcomeStatus, RowStatus
from .sheet_write import SheetWrite
from .statements import BindParams, Statement


@attrs.frozen
class OutcomeChunk:
    """One chunk of outcomes as the statement's arrays (None: a NULL array, which a
    multi-argument unnest pads with NULLs), the data fields they patch and the fields whose
    cell counters may move."""

    keys: list[str]
    data_json: str
    metas: list[Any] | None
    errors: list[str | None] | None
    attempts: list[int | None] | None
    fields: Sequence[str]
    counted: Sequence[str]
    indexes: list[int | None] | None = None  # inserted rows' input indexes (insert only)
    causes: list[str | None] | None = None   # failed rows' causes (`sheets.causes`)


@attrs.frozen
class _Names:
    """The binds of a completion statement, as the text that names them."""

    keys: str
    data: str
    meta: str
    version: str
    run_id: str
    attempt_id: str
    base: str
    org: str
    play: str
    namespace: str
    cols: list[tuple[str, str]]   # (physical column, bind naming its field) per data field
    counted: list[str]            # binds naming the fields whose cell counters may move
    concurrent: bool = False      # counter deltas to this backend's delta rows (`counters`)
    units: bool = False           # fence rows of shared-map units leased now (`leased_units`)


def _names(binds: BindParams, layout: SheetLayout, write: SheetWrite, chunk: OutcomeChunk,
           base_fields: Sequence[str]) -> _Names:
    """Allocate the binds every completion statement has (the field names come last, once the
    statement's own arrays are allocated: `_field_binds`)."""
    return _Names(
        keys=binds.add(chunk.keys, "text[]"),
        data=binds.add(chunk.data_json, "jsonb"),
        meta=binds.add(chunk.metas, "jsonb[]"),
        version=binds.add(write.run.epoch, "bigint"),
        run_id=binds.add(write.run.run_id, "text"),
        attempt_id=binds.add(write.attempt.attempt_id if write.attempt else None, "text"),
        base=binds.add(list(base_fields), "text[]"),
        org=binds.add(layout.org_id, "text"),
        play=binds.add(layout.play, "text"),
        namespace=binds.add(layout.namespace, "text"),
        cols=[],
        counted=[],
    )


def _field_binds(binds: BindParams, names: _Names, column: SheetColumns,
                 chunk: OutcomeChunk) -> _Names:
    return attrs.evolve(
        names,
        cols=[(column(f), binds.add(f, "text")) for f in chunk.fields],
        counted=[binds.add(f, "text") for f in chunk.counted],
    )


# The cell-meta entry every output gets: completed outcomes mark it completed (with the
# time); failed ones mark it failed, so column counters count a failed row's cells as failed.
def _base_meta(n: _Names, failed: bool) -> str:
    if failed:
        entry = f"jsonb_build_object('status', {OutcomeStatus.FAILED.sql}, 'run_id', {n.run_id})"
    else:
        entry = f"""jsonb_build_object(
               'status', {OutcomeStatus.COMPLETED.sql}, 'run_id', {n.run_id},
               'completed_at', extract(epoch FROM now())::float8)"""
    return f"""
base AS MATERIALIZED (
    SELECT coalesce(jsonb_object_agg(f, {entry}), '{{}}'::jsonb) AS meta
      FROM unnest({n.base}) AS f
)"""


# The cell-meta patch of one outcome: the base, each field merged with the outcome's own meta
# for it.
_PATCH = """CASE WHEN i.meta IS NULL THEN b.meta ELSE b.meta || (
    SELECT jsonb_object_agg(e.key, coalesce(b.meta -> e.key, '{}'::jsonb) || e.value)
      FROM jsonb_each(i.meta) AS e) END"""

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


def _counter_ctes(port: Port, n: _Names, moved: str, target: RowStatus) -> str:
    """CTEs applying the status and cell-meta deltas of the rows in `moved` (prev_status,
    prev_meta, new_meta); `target` is the status they moved to; the fields whose cell-meta
    status may have moved are `n.counted` (one pass over `moved` for all of them). Where the
    deltas go: `counters.summary_update` / `column_update`."""
    completed_plus = "d.n" if target == RowStatus.ENRICHED else "0"
    failed_plus = "d.n" if target == RowStatus.FAILED else "0"
    completed, failed = OutcomeStatus.COMPLETED.sql, OutcomeStatus.FAILED.sql
    sums = ", ".join(
        f"sum(((m.new_meta -> {name} ->> 'status') IS NOT DISTINCT FROM {completed})::int"
        f" - ((m.prev_meta -> {name} ->> 'status') IS NOT DISTINCT FROM {completed})::int)"
        f" AS c{j}, "
        f"sum(((m.new_meta -> {name} ->> 'status') IS NOT DISTINCT FROM {failed})::int"
        f" - ((m.prev_meta -> {name} ->> 'status') IS NOT DISTINCT FROM {failed})::int) AS f{j}"
        for j, name in enumerate(n.counted)
    )
    rows = ", ".join(f"({name}, d.c{j}, d.f{j})" for j, name in enumerate(n.counted))
    where = dict(concurrent=n.concurrent, org=n.org, play=n.play, namespace=n.namespace)
    if n.counted:
        cells = f"""
cell_delta AS (
    SELECT {sums} FROM {moved} AS m
),
column_summary AS ({column_update(
            port, **where, condition="v.completed <> 0 OR v.failed <> 0",
            source=f"cell_delta d CROSS JOIN LATERAL (VALUES {rows}) AS v(field, completed, failed)")}
)"""
    else:
        cells = """
column_summary AS (SELECT 1 WHERE false)"""
    summary = summary_update(port, **where, source="status_delta AS d", condition="d.n > 0",
                             deltas={"total": "d.was_absent", "queued": "- d.was_pending",
                                     "running": "- d.was_running",
                                     "completed": f"- d.was_enriched + {completed_plus}",
                                     "failed": f"- d.was_failed + {failed_plus}"})
    return f"""
status_delta AS (
    SELECT count(*) AS n,
           count(*) FILTER (WHERE prev_status = {RowStatus.PENDING.sql}) AS was_pending,
           count(*) FILTER (WHERE prev_status = {RowStatus.RUNNING.sql}) AS was_running,
           count(*) FILTER (WHERE prev_status = {RowStatus.ENRICHED.sql}) AS was_enriched,
           count(*) FILTER (WHERE prev_status = {RowStatus.FAILED.sql}) AS was_failed,
           count(*) FILTER (WHERE prev_status IS NULL) AS was_absent
      FROM {moved}
),
summary AS ({summary}
),{cells}"""


def _policy_sets(n: _Names, failed: bool) -> str:
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


def stored_input(n: _Names, row: str, source: str) -> str:
    """True when the outcome `source` (an alias with `data`) names a field that the stored row
    `row` holds as an input: a value without a cell-meta entry. Only a completion writes cell
    meta, for every field it writes; admission stores the input cells without any. So the row
    itself says which of its fields are inputs, whatever contract the request sent."""
    clashes = [f"({source}.data ? {name} AND {row}.{col} IS NOT NULL"
               f" AND NOT ({row}._cell_meta ? {name}))" for col, name in n.cols]
    return "(" + " OR ".join(clashes) + ")" if clashes else "false"


def leased_units(port: Port, n: _Names) -> str:
    """The CTE `leased`: the input-index ranges [low, high) of our run's shared-map units that
    are leased now (not done, lease not expired, map open) in this sheet. A write without an
    attempt is fenced on their rows (`in_leased_unit`): only the unit's holder, whose
    admission gave the rows its attempt, may write them. One probe of `shared_units` by its
    key prefix (org, play, run) per statement, nothing per row when the run shares no map."""
    return f"""
leased AS MATERIALIZED (
    SELECT u.low, u.low + u.row_count AS high
      FROM {table(port, "shared_units")} AS u
      JOIN {table(port, "shared_maps")} AS m
        ON m.org_id = u.org_id AND m.play = u.play AND m.run_id = u.run_id
       AND m.map_invocation_id = u.map_invocation_id
     WHERE u.org_id = {n.org} AND u.play = {n.play} AND u.run_id = {n.run_id}
       AND NOT u.done AND u.expires_at > now()
       AND m.state = 'open' AND m.table_namespace = {n.namespace}
),"""


def in_leased_unit(n: _Names, index: str) -> str:
    """True when input index `index` is a row of a unit in `leased` (false without that CTE)."""
    if not n.units:
        return "false"
    return f"EXISTS (SELECT 1 FROM leased AS l WHERE {index} >= l.low AND {index} < l.high)"


def _fence(n: _Names, already: str, source: str = "i") -> str:
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


def exact_statement(
    port: Port, layout: SheetLayout, write: SheetWrite, column: SheetColumns,
    chunk: OutcomeChunk, base_fields: Sequence[str], *, failed: bool, force_failed: bool,
    returning_old: bool, concurrent: bool = False, units: bool = False,
) -> Statement:
    """The exact-key statement of one chunk.

    Every output of `base_fields` is marked completed (failed where a failed outcome's row has
    not completed it); the cell counters of `chunk.counted` may move.
    With `force_failed` a failed outcome also applies to an enriched row, and every output it
    marks becomes a failed cell (completed ones included).
    With `units` (a write without an attempt) rows of shared-map units leased now are fenced
    `attempt_superseded` (`leased_units`).
    Rows are looked up one index probe per key (a LATERAL with LIMIT), so a chunk never scans
    the sheet whatever the planner believes about its size; the UPDATE's only condition on the
    sheet alone is the key (the version fence compares with `cur`, whose unfenced rows have
    `prev_version` = ours: see `_exact_returning_old` for why no bind may appear there).
    """
    binds = BindParams()
    n = _names(binds, layout, write, chunk, base_fields)
    errors = binds.add(chunk.errors, "text[]")
    attempts = binds.add(chunk.attempts, "integer[]")
    causes = binds.add(chunk.causes, "text[]")
    n = attrs.evolve(_field_binds(binds, n, column, chunk), concurrent=concurrent, units=units)
    target = RowStatus.FAILED if failed else RowStatus.ENRICHED
    build = _exact_returning_old if returning_old else _exact
    return binds.statement(build(port, layout, n, errors, attempts, causes, target, failed,
                                 force_failed))


def _sets(n: _Names, failed: bool) -> str:
    return _policy_sets(n, failed) + "".join(
        f", {col} = CASE WHEN c.data ? {name} THEN c.data -> {name} ELSE t.{col} END"
        for col, name in n.cols
    )


def _row_version(port: Port) -> str:
    return f"nextval({sequence_literal(port, 'row_versions')}::regclass)"


def _counters(port: Port, n: _Names, moved: str, target: RowStatus) -> str:
    return _counter_ctes(port, n, moved, target)


def _already(failed: bool, force_failed: bool) -> str:
    """The `already_completed` fence arm (failed outcomes only, unless forced)."""
    if failed and not force_failed:
        return f"WHEN s._status = {RowStatus.ENRICHED.sql} THEN 'already_completed'"
    return ""


def _exact(port: Port, layout: SheetLayout, n: _Names, errors: str, attempts: str, causes: str,
           target: RowStatus, failed: bool, force_failed: bool) -> str:
    t = layout.qualified
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
      FROM ROWS FROM (unnest({n.keys}), jsonb_array_elements({n.data}), unnest({n.meta}),
                      unnest({errors}), unnest({attempts}), unnest({causes}))
           WITH ORDINALITY AS u(key, data, meta, error, attempts, cause, ord)
),{leased_units(port, n) if n.units else ""}{_base_meta(n, failed)},
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
      CROSS JOIN LATERAL (SELECT {_PATCH} AS patch) AS p
      CROSS JOIN LATERAL (SELECT {new_meta} AS new_meta) AS n
),
applied AS (
    UPDATE {t} AS t
       SET _status = {target.sql}, _error = c.error, _cause = c.cause, _run_id = {n.run_id},
           _cell_meta = c.new_meta,
           _attempt_expires_at = NULL, _version = {_row_version(port)},
           _updated_at = now(){_sets(n, failed)}
      FROM cur c
     WHERE c.found AND c.fence IS NULL AND c.changed
       AND t._key = c.key AND t._write_version = c.prev_version
    RETURNING c.prev_status, c.prev_meta, c.new_meta
),{_counters(port, n, "applied", target)}
{_chunk_result("cur")}"""


def _exact_returning_old(port: Port, layout: SheetLayout, n: _Names, errors: str, attempts: str,
                         causes: str, target: RowStatus, failed: bool, force_failed: bool) -> str:
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
    t = layout.qualified
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
WITH {leased_units(port, n).strip() if n.units else ""}{_base_meta(n, failed)},
source AS MATERIALIZED (
    SELECT i.key, i.data, i.error, i.attempts, i.cause, i.ord, {_PATCH} AS patch,
           {n.version} AS our_version, {n.attempt_id} AS our_attempt,
           {RowStatus.ENRICHED.sql}::text AS kept_status
      FROM ROWS FROM (unnest({n.keys}), jsonb_array_elements({n.data}), unnest({n.meta}),
                      unnest({errors}), unnest({attempts}), unnest({causes}))
           WITH ORDINALITY AS i(key, data, meta, error, attempts, cause, ord)
      CROSS JOIN base b
),
applied AS (
    UPDATE {t} AS t
       SET _status = {target.sql}, _error = c.error, _cause = c.cause, _run_id = {n.run_id},
           _cell_meta = {new_meta},
           _attempt_expires_at = NULL, _version = {_row_version(port)},
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
),{_counters(port, n, "applied", target)},
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


def insert_statement(
    port: Port, layout: SheetLayout, write: SheetWrite, column: SheetColumns,
    chunk: OutcomeChunk, base_fields: Sequence[str], *, concurrent: bool = False,
    units: bool = False,
) -> Statement:
    """Insert completed outcomes whose rows are missing, as `enriched` rows of our version
    (`chunk.indexes` their input indexes), every output of `base_fields` marked completed;
    with `units`, not at the input index of a row of a shared-map unit leased now (those keys
    come back as `leased_keys`)."""
    binds = BindParams()
    n = _names(binds, layout, write, chunk, base_fields)
    indexes = binds.add(chunk.indexes, "bigint[]")
    seq = binds.add(write.attempt.seq if write.attempt else None, "integer")
    attempts = binds.add(chunk.attempts, "integer[]")
    n = attrs.evolve(_field_binds(binds, n, column, chunk), concurrent=concurrent, units=units)
    t = layout.qualified
    insert_cols = "".join(f", {col}" for col, _ in n.cols)
    insert_vals = "".join(f", i.data -> {name}" for _, name in n.cols)
    return binds.statement(f"""
WITH input AS MATERIALIZED (
    SELECT u.key, u.data, u.meta, u.idx, u.attempts, u.ord
      FROM ROWS FROM (unnest({n.keys}), jsonb_array_elements({n.data}), unnest({n.meta}),
                      unnest({indexes}), unnest({attempts}))
           WITH ORDINALITY AS u(key, data, meta, idx, attempts, ord)
),{leased_units(port, n) if units else ""}{_base_meta(n, False)},
inserted AS (
    INSERT INTO {t} (_key, _status, _run_id, _write_version, _input_index, _attempt_id,
                     _attempt_seq, _attempts, _cell_meta{insert_cols})
    SELECT i.key, {RowStatus.ENRICHED.sql}, {n.run_id}, {n.version}, i.idx, {n.attempt_id}, {seq},
           coalesce(i.attempts, 1), {_PATCH}{insert_vals}
      FROM input i CROSS JOIN base b
     WHERE NOT {in_leased_unit(n, "i.idx")}
    ON CONFLICT (_key) DO NOTHING
    RETURNING _key, _cell_meta
),
moved AS MATERIALIZED (
    SELECT NULL::text AS prev_status, '{{}}'::jsonb AS prev_meta, _cell_meta AS new_meta
      FROM inserted
),{_counters(port, n, "moved", RowStatus.ENRICHED)}
SELECT (SELECT array_agg(_key) FROM inserted) AS inserted_keys,
       (SELECT array_agg(i.key) FROM input i WHERE {in_leased_unit(n, "i.idx")}) AS leased_keys,
       (SELECT count(*) FROM summary) + (SELECT count(*) FROM column_summary) AS counter_rows
""")


# The rows of our version at the missing outcomes' input indexes: one lookup per index through
# the sheet's row-order index (its leading column). `OFFSET 0` keeps each lookup a subquery run
# per input index, so the planner cannot turn the whole into a scan of the sheet filtered by
# version (estimated from statistics that may not know our version yet).
def repair_targets_statement(layout: SheetLayout, ords: list[int], indexes: list[int],
                             version: int, keys: list[str]) -> Statement:
    """The rows of write version `version` at `indexes` (one per missing outcome, `ords` their
    positions) whose keys are not among `keys` (this call's)."""
    binds = BindParams()
    ord_array, index_array = binds.add(ords, "bigint[]"), binds.add(indexes, "bigint[]")
    our_version, our_keys = binds.add(version, "bigint"), binds.add(keys, "text[]")
    return binds.statement(f"""
SELECT u.ord, s._key
  FROM unnest({ord_array}, {index_array}) AS u(ord, idx)
  CROSS JOIN LATERAL (SELECT s._key FROM {layout.qualified} AS s
                       WHERE s._input_index = u.idx AND s._write_version = {our_version}
                         AND s._key <> ALL({our_keys})
                      OFFSET 0) AS s
 ORDER BY u.ord, s._key
""")
