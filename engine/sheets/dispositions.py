"""How admission judges a row already in the sheet, and the read-only probe that only judges.

How it works
- Two SQL fragments judge an existing row, for the admission statement (`admission_sql`) and
  the probe alike: `cached_predicate` (enriched, every contract output present and its cell
  meta completed, no cell stale under its `CellPolicy`, judged on the server's clock) and
  `disposition_case` (completed, newer_run, attempt_active, gave_up, or admit; `new` when no
  row has the key). A probe therefore settles a row exactly when the admission statement would
  have left it untouched (a row of a leased shared-map unit, which only a plain admission
  fences, `unit_fence`, the probe leaves unsettled: the admission then reports it blocked).
  `disposition_case` reads the row through a `StoredRow`: the SQL expressions naming its
  columns in the statement at hand.
- `probe_statement` is one read-only statement over keys only (sorted, each found by its own
  primary-key probe): it counts cache hits and lists blocked rows, and tells how many rows
  would need admission (new, or to be re-admitted).
This module does no I/O.
"""

from __future__ import annotations

from typing import Mapping

import attrs

from ..ports import Port, table
from ..sql import SqlLiteral
from .column_registry import COLUMNS_OF_FIELDS
from .layout import SheetColumns, SheetLayout
from .model import CellPolicy, OutcomeStatus, RowStatus, SheetContract
from .sheet_write import SheetWrite
from .statements import BindParams, Statement


def output_binds(contract: SheetContract, policies: Mapping[str, CellPolicy],
                 extra: BindParams, column: SheetColumns) -> list[tuple[str, str, str | None]]:
    """(column, field bind, stale-after bind or None) per contract output."""
    outputs = []
    for f in contract.outputs:
        name = extra.add(f, "text")
        policy = policies.get(f)
        seconds = extra.add(float(policy.stale_after_s), "float8") if policy else None
        outputs.append((column(f), name, seconds))
    return outputs


def fresh_cell(value: str, meta: str, seconds: str | None) -> str:
    """True when the output cell `value` (an expression) with cell meta entry `meta` is one a
    cache hit needs (NULL for a missing one): present (not NULL, JSON null or ""), its meta
    status `completed`, and, with a stale-after bind `seconds`, completed no longer ago than
    that on the server's clock."""
    term = (f"{value} IS NOT NULL AND {value} <> 'null'::jsonb AND {value} <> '\"\"'::jsonb"
            f" AND ({meta} ->> 'status') IS NOT DISTINCT FROM {OutcomeStatus.COMPLETED.sql}")
    if seconds is not None:
        term += (f" AND CASE WHEN jsonb_typeof({meta} -> 'completed_at') = 'number'"
                 f" THEN ({meta} ->> 'completed_at')::float8"
                 f" >= extract(epoch FROM now())::float8 - {seconds} ELSE false END")
    return term


def cached_predicate(alias: str, outputs: list[tuple[str, str, str | None]], *,
                     forced_version: str | None = None) -> str:
    """True when the row `alias` is a fresh cache hit (never NULL). With `forced_version` (the
    bind of our write version, under `force=True`) only a row our version wrote counts: a forced
    run recomputes what older runs wrote, and a wake of it keeps what it recomputed already."""
    terms = [f"{alias}._status = {RowStatus.ENRICHED.sql}"]
    if forced_version is not None:
        terms.append(f"{alias}._write_version = {forced_version}")
    for col, name, seconds in outputs:
        terms.append(fresh_cell(f"{alias}.{col}", f"({alias}._cell_meta -> {name})", seconds))
    return "coalesce(" + " AND ".join(f"({term})" for term in terms) + ", false)"


class Disposition(SqlLiteral):
    """What admission decides for one input row (`disposition_case`); the blocked ones are the
    reasons of `BlockedRow`. SQL text writes `Disposition.X.sql`."""

    NEW = "new"                        # no row has the key
    COMPLETED = "completed"            # a fresh cache hit, left untouched
    NEWER_RUN = "newer_run"            # blocked: a newer write version owns the row
    ATTEMPT_ACTIVE = "attempt_active"  # blocked: another attempt's lease is live
    GAVE_UP = "gave_up"                # blocked: failed in give_up_after runs
    ADMIT = "admit"                    # (re-)admitted to our write version


_D = Disposition
BLOCKED = f"({_D.NEWER_RUN.sql}, {_D.ATTEMPT_ACTIVE.sql}, {_D.GAVE_UP.sql})"


@attrs.frozen
class StoredRow:
    """What a disposition reads of the existing row, as SQL expressions of the statement at
    hand: whether it exists, whether it is a fresh cache hit (`cached_predicate`), its status,
    write version, attempt, lease expiry and failed-run count."""

    exists: str
    cached: str
    status: str
    version: str
    attempt: str
    expires: str
    failed_runs: str


def disposition_case(row: StoredRow, *, our_version: str, our_attempt: str,
                     give_up_after: str, leased: str | None = None) -> str:
    """The disposition of one input row, from the existing row's columns (`row`) and the binds
    of our write version, our attempt and `give_up_after`. `leased` (a plain admission on a
    login that reads unit leases, `unit_fence`): true for a row of a shared-map unit leased now,
    which is `attempt_active` unless it is a cache hit or a newer run's, and is not inserted."""
    if leased is None:
        new, fenced = f"WHEN NOT {row.exists} THEN {_D.NEW.sql}", ""
    else:
        new = (f"WHEN NOT {row.exists} THEN CASE WHEN {leased} THEN {_D.ATTEMPT_ACTIVE.sql}"
               f" ELSE {_D.NEW.sql} END")
        fenced = f"\n                WHEN {leased} THEN {_D.ATTEMPT_ACTIVE.sql}"
    return f"""CASE {new}
                WHEN {row.cached} THEN {_D.COMPLETED.sql}
                WHEN {row.version} > {our_version} THEN {_D.NEWER_RUN.sql}{fenced}
                WHEN {row.version} = {our_version}
                     AND {row.status} IN ({RowStatus.PENDING.sql}, {RowStatus.RUNNING.sql})
                     AND {row.attempt} IS NOT NULL AND {row.attempt} IS DISTINCT FROM {our_attempt}
                     AND {row.expires} > now() THEN {_D.ATTEMPT_ACTIVE.sql}
                WHEN {row.status} = {RowStatus.FAILED.sql} AND {row.failed_runs} >= {give_up_after}
                     THEN {_D.GAVE_UP.sql}
                ELSE {_D.ADMIT.sql} END"""


def probe_statement(port: Port, layout: SheetLayout, write: SheetWrite, column: SheetColumns,
                    keys: list[str]) -> Statement:
    """The read-only probe of a chunk of `keys` (unique, sorted).

    Returns how many keys would need admission (`unsettled`: the keys no row has, plus the rows
    to re-admit), the cache hits (`cached`), the blocked rows' keys and reasons (two arrays
    aggregated in one pass, so they pair up element by element), and `columns_ok`: whether
    `column` is what the registry says for every output (the probe may be built from
    first-choice names before the registry is read; its counts mean something only when this
    is true). Each key is looked up by its own primary-key probe (a `LATERAL … LIMIT 1`, which
    the planner cannot turn into a scan of the sheet, whatever its statistics say: `= ANY` over
    5,000 keys became a bitmap or sequential scan of an analyzed 200,000-row sheet); sorted
    keys keep consecutive probes on the same index pages. The aggregates need no order, so
    nothing is sorted on the server.
    """
    binds = BindParams()
    key_array = binds.add(keys, "text[]")
    version = binds.add(write.run.epoch, "bigint")
    attempt_id = binds.add(write.attempt.attempt_id if write.attempt else None, "text")
    give_up = binds.add(write.give_up_after, "integer")
    contract = write.contract
    outputs = output_binds(contract, write.cell_policies, binds, column)
    fields = binds.add(list(contract.outputs), "text[]")
    expected = binds.add([column.names[f] for f in contract.outputs], "text[]")
    registered = COLUMNS_OF_FIELDS.format(
        fields=fields, registry=table(port, "sheet_columns"), org=binds.add(layout.org_id, "text"),
        play=binds.add(layout.play, "text"), ns=binds.add(layout.namespace, "text"))
    row = StoredRow(
        exists="true",
        cached=cached_predicate("s", outputs, forced_version=version if write.force else None),
        status="s._status", version="s._write_version", attempt="s._attempt_id",
        expires="s._attempt_expires_at", failed_runs="s._failed_runs",
    )
    disposition = disposition_case(row, our_version=version, our_attempt=attempt_id,
                                   give_up_after=give_up)
    sql = f"""
SELECT {registered} = {expected} AS columns_ok,
       cardinality({key_array}) - count(*)
           + count(*) FILTER (WHERE disposition = {_D.ADMIT.sql}) AS unsettled,
       count(*) FILTER (WHERE disposition = {_D.COMPLETED.sql}) AS cached,
       array_agg(key) FILTER (WHERE disposition IN {BLOCKED}) AS blocked_keys,
       array_agg(disposition) FILTER (WHERE disposition IN {BLOCKED}) AS blocked_reasons
  FROM (SELECT s._key AS key, {disposition} AS disposition
          FROM unnest({key_array}) AS k(key)
          CROSS JOIN LATERAL (SELECT * FROM {layout.qualified} AS s
                               WHERE s._key = k.key LIMIT 1) AS s) AS decided
"""
    return binds.statement(sql)
