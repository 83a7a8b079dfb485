"""The SQL of admission: one statement per chunk that decides and writes.

How it works
- The statement judges each existing row by the fragments it shares with the probe
  (`dispositions`: `cached_predicate`, `disposition_case`), so a probe settles a row exactly
  when this statement would have left it untouched.
- The admission statement (`admit_statement`) takes the chunk's inputs from one of two sources:
    * `PayloadRows`: the rows' canonical JSON, sent as one array and expanded beside keys and
      indexes (`ROWS FROM`);
    * `PageRows`: a sealed array-input page fact of the run, read in the same statement. The page is
      used only when the fact is the expected one (our run, kind, digest, ordinal, offset, row
      count), the map's seal exists for that fingerprint and covers the ordinal, and the run
      guard is open; otherwise the input is empty, nothing is written, and `page_ok` is false.
      Its rows are zipped positionally with the key and index arrays (`ROWS FROM`), so each row
      takes its input cells from `rows[i].data` of the stored fact: the rows never travel again.
- The builder allocates its binds as it writes the text (`statements.BindParams`) and returns
  the text with its arguments (`Statement`); the write's settings come from the `SheetWrite`.
- Under `force` the re-admission also marks every cell meta entry of the row `pending`
  (`pending_cells`) and takes its completed and failed cells out of the column counters
  (`cell_delta`), so a row that then fails never shows its earlier outputs as current.
- With `previous_cells` the statement also returns each re-admitted row's fresh completed
  output cells, within the byte budget it is given (`previous_cells`).
- Cache hits come back either as rows (their ordinals and one JSON array per output column,
  the public default) or as a count (`count` mode: the pending rows' ordinals, the cached
  count, the blocked rows — a few bytes for a page of hits).
This module does no I/O.
"""

from __future__ import annotations

import attrs

from ..ports import Port, sequence_literal, table
from ..array_input.facts import GUARD_IS_OPEN
from ..receipts import SQL_STATUSES
from ..array_input import facts
from .counters import column_update, previous_statuses, status_deltas, summary_update
from . import unit_fence
from .dispositions import (
    BLOCKED, Disposition, StoredRow, cached_predicate, disposition_case, output_binds,
)
from .layout import SheetColumns, SheetLayout
from .model import CellStatus, RowStatus, StagedPage
from .previous_cells import previous_columns, previous_cte
from .sheet_write import SheetWrite
from .statements import BindParams, Statement

_D = Disposition


@attrs.frozen
class PayloadRows:
    """A chunk's rows sent with the statement: keys, input indexes, and the rows' canonical
    JSON as one array text (None when the contract has no inputs to store)."""

    keys: list[str]
    indexes: list[int]
    rows_json: str | None


@attrs.frozen
class PageRows:
    """A sealed array-input page's rows, read from its stored fact: one key (None for a row not
    to admit, a duplicate) and one input index per page row, and the fact that must match."""

    keys: list[str | None]
    indexes: list[int]
    page: StagedPage
    offset: int


def pending_cells(meta: str, run_id: str, attempts: str) -> str:
    """The cell meta `meta` (an expression) of a row a forced admission re-admits: every entry
    marked `pending` for run `run_id` (the row's `attempts` now: its attempts when the cell
    was last written), its `completed_at` dropped, any other key an outcome gave it kept. The
    values stay stored, hidden until the cell completes again (`reading.shown_cell`)."""
    return f"""(SELECT coalesce(jsonb_object_agg(e.key,
               CASE WHEN jsonb_typeof(e.value) = 'object' THEN e.value - 'completed_at'
                    ELSE '{{}}'::jsonb END
               || jsonb_build_object('status', {CellStatus.PENDING.sql}::text,
                                     'run_id', {run_id}::text, 'attempts', {attempts})),
               '{{}}'::jsonb)
      FROM jsonb_each({meta}) AS e)"""


def _all_pending(meta: str) -> str:
    """Whether every entry of the cell meta `meta` is already pending (true when it has none)."""
    return f"""NOT EXISTS (SELECT 1 FROM jsonb_each({meta}) AS e
                     WHERE (e.value ->> 'status') IS DISTINCT FROM {CellStatus.PENDING.sql})"""


def _cell_counters(port: Port, c: "_Common", *, concurrent: bool) -> str:
    """CTEs taking the cells a forced admission marked pending out of the column counters:
    each completed or failed entry of a re-admitted row's previous cell meta counts one less."""
    completed, failed = CellStatus.COMPLETED.sql, CellStatus.FAILED.sql
    update = column_update(
        port, concurrent=concurrent, org=c.org, play=c.play, namespace=c.namespace,
        source="cell_delta AS v", condition="v.completed <> 0 OR v.failed <> 0")
    return f"""
cell_delta AS (
    SELECT e.key AS field,
           - count(*) FILTER (WHERE e.value ->> 'status' = {completed}) AS completed,
           - count(*) FILTER (WHERE e.value ->> 'status' = {failed}) AS failed
      FROM readmitted AS r, jsonb_each(r.prev_meta) AS e
     GROUP BY e.key
),
column_summary AS ({update}
),"""


@attrs.frozen
class _Common:
    """The binds every admission statement shares, as the text that names them."""

    keys: str  # the row keys expanded (`BindParams.strings`: a set-returning call)
    indexes: str
    version: str
    run_id: str
    attempt_id: str
    attempt_seq: str
    lease_s: str
    org: str
    play: str
    namespace: str
    status: str


def _common(binds: BindParams, write: SheetWrite, layout: SheetLayout,
            rows: PayloadRows | PageRows) -> _Common:
    attempt = write.attempt
    return _Common(
        keys=binds.strings(rows.keys),
        indexes=binds.add(rows.indexes, "bigint[]"),
        version=binds.add(write.run.epoch, "bigint"),
        run_id=binds.add(write.run.run_id, "text"),
        attempt_id=binds.add(attempt.attempt_id if attempt else None, "text"),
        attempt_seq=binds.add(attempt.seq if attempt else None, "integer"),
        lease_s=binds.add(float(attempt.lease_s) if attempt else 0.0, "float8"),
        org=binds.add(layout.org_id, "text"),
        play=binds.add(layout.play, "text"),
        namespace=binds.add(layout.namespace, "text"),
        status=binds.add(write.lease_status, "text"),
    )


def _page_source(port: Port, binds: BindParams, c: _Common, rows: PageRows) -> tuple[str, str]:
    """The `page` CTE (checked fact) and the `input` CTE zipping its rows with keys/indexes."""
    receipts = table(port, "work_receipts")
    scope = rows.page.scope
    page_key = binds.add(facts.page_key(scope, rows.page.ordinal), "bytea")
    seal_key = binds.add(facts.seal_key(scope), "bytea")
    guard_key = binds.add(facts.guard_key(scope), "bytea")
    digest = binds.add(rows.page.digest, "text")
    offset = binds.add(rows.offset, "bigint")
    row_count = binds.add(len(rows.keys), "integer")
    ordinal = binds.add(rows.page.ordinal, "bigint")
    guard_open = GUARD_IS_OPEN.format(g="g", run=c.run_id, **SQL_STATUSES)
    page = f"""page AS MATERIALIZED (
    SELECT h.rows
      FROM {receipts} AS p
      CROSS JOIN LATERAL jsonb_to_record(p.output) AS h(
          kind text, source_fingerprint text, ordinal jsonb, "offset" jsonb, row_count jsonb,
          digest text, rows jsonb)
      JOIN {receipts} AS s ON s.k = {seal_key}
      JOIN {receipts} AS g ON g.k = {guard_key}
     WHERE p.k = {page_key} AND p.status = {SQL_STATUSES["COMPLETED"]} AND p.run_id = {c.run_id}
       AND h.kind = 'array_input_page' AND h.digest = {digest}
       AND h."offset" = to_jsonb({offset}) AND h.row_count = to_jsonb({row_count})
       AND h.ordinal = to_jsonb({ordinal})
       AND jsonb_typeof(h.rows) = 'array' AND jsonb_array_length(h.rows) = {row_count}
       AND s.status = {SQL_STATUSES["COMPLETED"]} AND s.run_id = {c.run_id}
       AND s.output ->> 'kind' = 'array_input_seal'
       AND s.output ->> 'source_fingerprint' = h.source_fingerprint
       AND jsonb_typeof(s.output -> 'page_count') = 'number'
       AND (s.output ->> 'page_count')::numeric > {ordinal}
       AND {guard_open}
),"""
    source = f"""input AS MATERIALIZED (
    SELECT u.key, u.idx, u.ord, u.occ -> 'data' AS payload
      FROM page, ROWS FROM ({c.keys}, unnest({c.indexes}), jsonb_array_elements(page.rows))
           WITH ORDINALITY AS u(key, idx, occ, ord)
     WHERE u.key IS NOT NULL
)"""
    return page, source


def _payload_source(binds: BindParams, c: _Common, rows: PayloadRows) -> str:
    if rows.rows_json is not None:
        payload = binds.add(rows.rows_json, "jsonb")
        return f"""input AS MATERIALIZED (
    SELECT u.key, u.idx, u.ord, u.payload
      FROM ROWS FROM ({c.keys}, unnest({c.indexes}), jsonb_array_elements({payload}))
           WITH ORDINALITY AS u(key, idx, payload, ord)
)"""
    return f"""input AS MATERIALIZED (
    SELECT u.key, u.idx, u.ord
      FROM ROWS FROM ({c.keys}, unnest({c.indexes})) WITH ORDINALITY AS u(key, idx, ord)
)"""


# One chunk's admission in one round trip: insert the new rows, decide each existing one
# (`decided`), re-admit those to admit, move the counters, report. Filled by `admit_statement`
# from its parts; `{c.…}` name the shared binds (`_Common`), the rest are SQL fragments.
_ADMIT = """
WITH {page_cte}
{input_cte},{leased_cte}
inserted AS (
    INSERT INTO {t} (_key, _status, _run_id, _write_version, _input_index, _attempt_id,
                     _attempt_seq, _attempt_expires_at{insert_cols})
    SELECT d.key, {c.status}, {c.run_id}, {c.version}, d.idx, {c.attempt_id}, {c.attempt_seq},
           {lease}{insert_vals}
      FROM input d{insert_filter}{on_conflict}
    RETURNING 1
),
cur AS MATERIALIZED (
    SELECT i.*, s._key IS NOT NULL AS prev_exists, s._status AS prev_status,
           s._write_version AS prev_version, s._run_id AS prev_run, s._input_index AS prev_index,
           s._attempt_id AS prev_attempt, s._attempt_expires_at AS prev_expires,
           s._error AS prev_error, s._failed_runs AS prev_failed_runs,
           s._cell_meta AS prev_meta, s._attempts AS prev_attempts,
           {cached} AS cached{out_cols}{in_cols}
      FROM input i
      LEFT JOIN LATERAL (SELECT * FROM {t} AS s WHERE s._key = i.key LIMIT 1) AS s ON true
     WHERE (SELECT count(*) FROM inserted) < (SELECT count(*) FROM input)
),
decided AS MATERIALIZED (
    SELECT c.*, {disposition} AS disposition
      FROM cur c
),{previous_cte}
readmitted AS (
    UPDATE {t} AS t
       SET _status = {c.status}, _run_id = {c.run_id}, _write_version = {c.version},
           _input_index = d.idx, _attempt_id = {c.attempt_id}, _attempt_seq = {c.attempt_seq},
           _attempt_expires_at = {lease}, _error = NULL, _cause = NULL, _version = {version},
           _updated_at = now(){update_sets}{cell_sets}
      FROM decided d
     WHERE d.disposition = {D.ADMIT.sql} AND t._key = d.key
       AND ({c.attempt_id} IS NOT NULL OR d.prev_attempt IS NOT NULL OR d.prev_error IS NOT NULL
            OR d.prev_status IS DISTINCT FROM {c.status}
            OR d.prev_version IS DISTINCT FROM {c.version}
            OR d.prev_run IS DISTINCT FROM {c.run_id}
            OR d.prev_index IS DISTINCT FROM d.idx{update_diff}{cell_moved})
    RETURNING d.prev_status, d.prev_meta
),{cell_ctes}
delta AS (
    SELECT (SELECT count(*) FROM inserted) AS ins, count(*) AS moved,
           {was}
      FROM readmitted
),
summary AS ({summary})
SELECT {page_ok} AS page_ok,
       (SELECT ins FROM delta) AS inserted,
       (SELECT moved FROM delta) AS readmitted,
       (SELECT count(*) FROM input) AS input_rows,
       (SELECT count(*) FROM summary) AS summary_rows,
       (SELECT count(*) FROM column_summary) AS column_rows,
       {hits},
       (SELECT array_agg(ord ORDER BY ord) FROM decided
         WHERE disposition IN {BLOCKED}) AS blocked_ords,
       (SELECT array_agg(disposition ORDER BY ord) FROM decided
         WHERE disposition IN {BLOCKED}) AS blocked_reasons{previous_cols}
"""


def admit_statement(port: Port, layout: SheetLayout, write: SheetWrite, column: SheetColumns,
                    rows: PayloadRows | PageRows, *, concurrent: bool = False,
                    previous_budget: int = 0, units: bool = False,
                    expect_new: bool = False) -> Statement:
    """The admission statement of one chunk of `rows` (`column` maps each contract field to its
    registered column). With `PageRows` the inputs are read from the page fact, and keys may
    hold None for rows of the page not to admit (duplicates). `concurrent`: the counter deltas
    go to this backend's delta rows (`counters`). With `write.previous_cells` it also returns
    the re-admitted rows' previous cells, `previous_budget` bytes of them (`previous_cells`).
    `units`: a plain admission fenced on the rows of the run's leased shared-map units
    (`unit_fence`): they are `attempt_active`, and those missing are not inserted.
    `expect_new`: the rows are expected to be new, so they are inserted without `ON
    CONFLICT` (no speculative insertion: a fifth of the statement's time for new rows); a row
    that is there after all fails the statement with a unique violation (23505), and the
    caller admits the chunk again without it (`admit_prepared`)."""
    binds = BindParams()
    c = _common(binds, write, layout, rows)
    page_cte, input_cte, page_ok = _admit_source(port, binds, c, rows)
    give_up = binds.add(write.give_up_after, "integer")
    fields = _field_parts(binds, write, column, c)
    sql = _ADMIT.format(
        page_cte=page_cte, input_cte=input_cte, page_ok=page_ok, t=layout.qualified, c=c,
        on_conflict="" if expect_new else "\n    ON CONFLICT (_key) DO NOTHING",
        lease=_lease(c), **_unit_parts(port, c, give_up, units),
        version=f"nextval({sequence_literal(port, 'row_versions')}::regclass)",
        summary=_admit_summary(port, c, concurrent=concurrent),
        hits=_hit_columns(write.cache_hits, fields.outputs),
        **_forced_parts(port, write, c, concurrent=concurrent), **fields.text,
        D=_D, BLOCKED=BLOCKED, was=previous_statuses(),
        **_previous_parts(binds, write, fields.outputs, previous_budget),
    )
    return binds.statement(sql)


def _previous_parts(binds: BindParams, write: SheetWrite,
                    outputs: list[tuple[str, str, str | None]], budget: int) -> dict[str, str]:
    """The CTE and result columns of previous cells with `write.previous_cells`; none without
    (the statement is then exactly what it was before the option existed)."""
    if not write.previous_cells:
        return {"previous_cte": "", "previous_cols": ""}
    return {"previous_cte": previous_cte(outputs),
            "previous_cols": previous_columns(binds.add(budget, "bigint"))}


def _admit_source(port: Port, binds: BindParams, c: _Common,
                  rows: PayloadRows | PageRows) -> tuple[str, str, str]:
    """Where the chunk's rows come from: the checked page fact (and `page_ok`, whether it
    matched) for `PageRows`, the rows sent with the statement for `PayloadRows`."""
    if isinstance(rows, PageRows):
        page_cte, input_cte = _page_source(port, binds, c, rows)
        return page_cte, input_cte, "(SELECT count(*) FROM page) = 1"
    return "", _payload_source(binds, c, rows), "true"


@attrs.frozen
class _FieldParts:
    """The contract's fields in the statement: `outputs` (column, bind, policy) as
    `output_binds` gives them, and `text`, the fragments that read, store and compare them."""

    outputs: list[tuple[str, str, str | None]]
    text: dict[str, str]


def _field_parts(binds: BindParams, write: SheetWrite, column: SheetColumns,
                 c: _Common) -> _FieldParts:
    """How inputs are inserted, re-admitted and compared (a changed input re-admits a row), and
    which output cells are read back and make a row a cache hit."""
    contract = write.contract
    inputs = [(column(f), binds.add(f, "text")) for f in contract.inputs]
    outputs = output_binds(contract, write.cell_policies, binds, column)
    return _FieldParts(outputs, {
        "cached": cached_predicate("s", outputs,
                                   forced_version=c.version if write.force else None),
        "out_cols": "".join(f", s.{col} AS o{i}" for i, (col, _, _) in enumerate(outputs)),
        "in_cols": "".join(f", s.{col} AS p{i}" for i, (col, _) in enumerate(inputs)),
        "insert_cols": "".join(f", {col}" for col, _ in inputs),
        "insert_vals": "".join(f", d.payload -> {name}" for _, name in inputs),
        "update_sets": "".join(f", {col} = d.payload -> {name}" for col, name in inputs),
        "update_diff": "".join(f" OR d.p{i} IS DISTINCT FROM d.payload -> {name}"
                               for i, (_, name) in enumerate(inputs)),
    })


def _hit_columns(cache_hits: str, outputs: list[tuple[str, str, str | None]]) -> str:
    """What the statement returns of its cache hits: their ordinals and output cells
    (`cache_hits="rows"`), or their count and the pending rows' ordinals."""
    if cache_hits == "rows":
        hits = "".join(
            f", (SELECT jsonb_agg(o{i} ORDER BY ord) FROM decided"
            f" WHERE disposition = {_D.COMPLETED.sql})::text AS o{i}"
            for i in range(len(outputs))
        )
        return ("(SELECT array_agg(ord ORDER BY ord) FROM decided"
                f" WHERE disposition = {_D.COMPLETED.sql}) AS completed_ords" + hits)
    return (f"(SELECT count(*) FROM decided WHERE disposition = {_D.COMPLETED.sql}) AS cached,"
            " (SELECT array_agg(ord ORDER BY ord) FROM decided"
            f"   WHERE disposition IN ({_D.NEW.sql}, {_D.ADMIT.sql})) AS pending_ords")


def _lease(c: _Common) -> str:
    """When an admitted row's lease expires: none without an attempt."""
    return (
        f"CASE WHEN {c.attempt_id} IS NULL THEN NULL::timestamptz"
        f" ELSE now() + make_interval(secs => {c.lease_s}) END"
    )


# The existing row as the `cur` CTE names its columns.
_CUR_ROW = StoredRow(exists="c.prev_exists", cached="c.cached", status="c.prev_status",
                     version="c.prev_version", attempt="c.prev_attempt",
                     expires="c.prev_expires", failed_runs="c.prev_failed_runs")


def _unit_parts(port: Port, c: _Common, give_up: str, units: bool) -> dict[str, str]:
    """What becomes of each row (`disposition_case` over the `cur` CTE's columns) and, with
    `units`, the `leased` CTE and the filter that keeps the rows of leased units out of the
    insert (`unit_fence`); without, the statement is what it was before the fence existed."""
    if not units:
        return {"leased_cte": "", "insert_filter": "",
                "disposition": disposition_case(_CUR_ROW, our_version=c.version,
                                                our_attempt=c.attempt_id, give_up_after=give_up)}
    index = "CASE WHEN c.prev_exists THEN c.prev_index ELSE c.idx END"
    return {
        "leased_cte": unit_fence.leased_units(port, org=c.org, play=c.play, run_id=c.run_id,
                                              namespace=c.namespace),
        "insert_filter": f"\n     WHERE NOT {unit_fence.in_leased('d.idx')}",
        "disposition": disposition_case(_CUR_ROW, our_version=c.version,
                                        our_attempt=c.attempt_id, give_up_after=give_up,
                                        leased=unit_fence.in_leased(index)),
    }


def _forced_parts(port: Port, write: SheetWrite, c: _Common, *,
                  concurrent: bool) -> dict[str, str]:
    """With `force`, every output cell of a re-admitted row turns pending (§35) and the column
    counters move with them; otherwise cells are left alone and no column counter moves."""
    if write.force:
        return {
            "cell_sets": ", _cell_meta = "
                         + pending_cells("d.prev_meta", c.run_id, "d.prev_attempts"),
            "cell_moved": f" OR NOT {_all_pending('d.prev_meta')}",
            "cell_ctes": _cell_counters(port, c, concurrent=concurrent),
        }
    return {"cell_sets": "", "cell_moved": "",
            "cell_ctes": "\ncolumn_summary AS (SELECT 1 WHERE false),"}


def _admit_summary(port: Port, c: _Common, *, concurrent: bool) -> str:
    """The summary counters' update: inserted rows count in, re-admitted rows move from their
    previous status to the admitted one."""
    return summary_update(
        port, concurrent=concurrent, org=c.org, play=c.play, namespace=c.namespace,
        source="delta AS d", condition="(d.ins > 0 OR d.moved > 0)",
        deltas=status_deltas("d.ins", {
            status: f"CASE WHEN {c.status} = {status.sql} THEN d.ins + d.moved ELSE 0 END"
            for status in (RowStatus.PENDING, RowStatus.RUNNING)}))
