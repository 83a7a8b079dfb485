"""The parts every completion statement is built of: its binds, the cell meta it writes, the
counter deltas of the rows it moved, and the fence on rows of shared-map units leased now.

How it works
- A completion transaction writes through one `CompletionSheet`: the sheet (port, layout, the
  columns registered for it), the `SheetWrite`, the fields every outcome marks, and whether
  counter deltas go to this backend's delta rows (`concurrent`), rows of leased shared-map units
  are fenced (`units`) and the server returns old rows (`returning_old`, PostgreSQL >= 18).
- A chunk of outcomes travels as one `OutcomeChunk` of arrays; `completion_binds` allocates the
  binds every statement has (`CompletionBinds`: the text naming each), field names last and
  always as binds.
- Counter deltas (`counter_ctes`) come from the rows a statement changed: status transitions
  for `sheet_summary`, cell-meta status transitions of the counted fields for
  `sheet_column_summary`, both in one pass over the changed rows.
Who calls: the statement builders `completion_sql` (exact keys) and `completion_repair_sql`
(missing rows). This module does no I/O.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from ..ports import Port, sequence_literal

from . import unit_fence
from .counters import column_update, previous_statuses, status_deltas, summary_update
from .layout import SheetColumns, SheetLayout
from .model import OutcomeStatus, RowStatus
from .sheet_write import SheetWrite
from .statements import BindParams


@attrs.frozen
class CompletionSheet:
    """Where one completion transaction's statements write, and how (see the module doc)."""

    port: Port
    layout: SheetLayout
    write: SheetWrite
    columns: SheetColumns
    base_fields: Sequence[str]  # every output of these is marked by every outcome
    concurrent: bool = False    # counter deltas to this backend's delta rows (`counters`)
    units: bool = False         # fence rows of shared-map units leased now (`leased_units`)
    returning_old: bool = False  # the server has `RETURNING old.*` (PostgreSQL >= 18)


@attrs.frozen
class OutcomeChunk:
    """One chunk of outcomes as the statement's arrays (None: a NULL array, which a
    multi-argument unnest pads with NULLs), the data fields they patch and the fields whose
    cell counters may move."""

    keys: list[str]
    data_json: str
    metas: list[str | None] | None  # each outcome's cell meta text
    errors: list[str | None] | None
    attempts: list[int | None] | None
    fields: Sequence[str]
    counted: Sequence[str]
    indexes: list[int | None] | None = None  # inserted rows' input indexes (insert only)
    causes: list[str | None] | None = None   # failed rows' causes (`sheets.causes`)


@attrs.frozen
class CompletionBinds:
    """The binds of a completion statement, as the text that names them."""

    keys: str  # the outcomes' keys expanded (`BindParams.strings`: a set-returning call)
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


def completion_binds(binds: BindParams, sheet: CompletionSheet,
                     chunk: OutcomeChunk) -> CompletionBinds:
    """Allocate the binds every completion statement has (the field names come last, once the
    statement's own arrays are allocated: `field_binds`)."""
    layout, write = sheet.layout, sheet.write
    return CompletionBinds(
        keys=binds.strings(chunk.keys),
        data=binds.add(chunk.data_json, "jsonb"),
        meta=binds.add(chunk.metas, "jsonb[]"),
        version=binds.add(write.run.epoch, "bigint"),
        run_id=binds.add(write.run.run_id, "text"),
        attempt_id=binds.add(write.attempt.attempt_id if write.attempt else None, "text"),
        base=binds.add(list(sheet.base_fields), "text[]"),
        org=binds.add(layout.org_id, "text"),
        play=binds.add(layout.play, "text"),
        namespace=binds.add(layout.namespace, "text"),
        cols=[],
        counted=[],
        concurrent=sheet.concurrent,
        units=sheet.units,
    )


def field_binds(binds: BindParams, names: CompletionBinds, column: SheetColumns,
                chunk: OutcomeChunk) -> CompletionBinds:
    """`names` with the binds naming the chunk's data fields and counted fields."""
    return attrs.evolve(
        names,
        cols=[(column(f), binds.add(f, "text")) for f in chunk.fields],
        counted=[binds.add(f, "text") for f in chunk.counted],
    )



# The cell-meta entry every output gets: completed outcomes mark it completed (with the
# time); failed ones mark it failed, so column counters count a failed row's cells as failed.
def base_meta(n: CompletionBinds, failed: bool) -> str:
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
# for it. An entry the outcome marks completed (a failed outcome's stored outputs,
# `actors.RowError`) gets `completed_at` from the server's clock unless it gives one.
PATCH = f"""CASE WHEN i.meta IS NULL THEN b.meta ELSE b.meta || (
    SELECT jsonb_object_agg(e.key, CASE WHEN e.value ->> 'status' = {OutcomeStatus.COMPLETED.sql}
               THEN jsonb_build_object('completed_at', extract(epoch FROM now())::float8)
               ELSE '{{}}'::jsonb END || coalesce(b.meta -> e.key, '{{}}'::jsonb) || e.value)
      FROM jsonb_each(i.meta) AS e) END"""


def counter_ctes(port: Port, n: CompletionBinds, moved: str, target: RowStatus) -> str:
    """CTEs applying the status and cell-meta deltas of the rows in `moved` (prev_status,
    prev_meta, new_meta); `target` is the status they moved to; the fields whose cell-meta
    status may have moved are `n.counted` (one pass over `moved` for all of them). Where the
    deltas go: `counters.summary_update` / `column_update`."""
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
                             deltas=status_deltas("d.was_absent", {target: "d.n"}))
    return f"""
status_delta AS (
    SELECT count(*) AS n,
           {previous_statuses()},
           count(*) FILTER (WHERE prev_status IS NULL) AS was_absent
      FROM {moved}
),
summary AS ({summary}
),{cells}"""



def leased_units(port: Port, n: CompletionBinds) -> str:
    """The CTE `leased` of the completion's run and sheet (`unit_fence`): a write without an
    attempt is fenced on its rows (`in_leased_unit`); only the unit's holder, whose admission
    gave the rows its attempt, may write them."""
    return unit_fence.leased_units(port, org=n.org, play=n.play, run_id=n.run_id,
                                   namespace=n.namespace)


def in_leased_unit(n: CompletionBinds, index: str) -> str:
    """True when input index `index` is a row of a unit in `leased` (false without that CTE)."""
    return unit_fence.in_leased(index) if n.units else "false"


def row_version(port: Port) -> str:
    """The next row version (`_version`) of a changed row."""
    return f"nextval({sequence_literal(port, 'row_versions')}::regclass)"
