"""Completion: write map outcomes into a sheet, fenced by write version and attempt.

How it works
- Outcomes are validated and encoded before any query; duplicates collapse to the last one.
  Completed and failed outcomes are chunked separately by at most `COMPLETE_CHUNK_ROWS` rows and
  `COMPLETE_CHUNK_BYTES` of patch JSON; every chunk is one statement, and all of them run in one
  sheet write transaction with a statement timeout (`layout.run_sheet_transaction`).
- One statement per chunk reads the rows by exact key, decides each row's fence, applies the
  unfenced changes, and applies the exact counter deltas (`sheet_summary` by status transition,
  `sheet_column_summary` by cell-meta status transition) — a CTE over unnest of arrays:
    * `_write_version` newer than ours → fenced `stale_write_version`; older → `unadmitted`;
    * with an attempt, a row leased to another attempt → `attempt_superseded` (our own lease
      still counts as ours after it expired);
    * a failed outcome for an `enriched` row → `already_completed`;
    * otherwise applied: completed → `enriched`, the data keys present patched, cell meta of
      every output `{status: completed, run_id, completed_at}` (epoch seconds, server clock)
      merged with the outcome's own cell meta; failed → `failed`, `_error` set, cells and cell
      meta patched likewise but no output marked completed. The lease ends (`_attempt_expires_at`
      cleared). A row already exactly so is not touched: an identical replay is committed
      without a physical change (a replay only differing in `completed_at` keeps the old one).
- Keys that no row has are repaired afterwards (never in the exact-key statement, so the common
  path never scans by input index): an outcome whose `input_index` matches a row of our write
  version (whose key is not among this call's keys) is applied to that row through the same
  statement; a completed outcome left unmatched is inserted `enriched`; a failed one is fenced
  `missing`.
- `on_diagnostics(CompletionDiagnostics)` is observational: what it raises is logged and never
  changes the result.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable, Sequence

import attrs

from engine.errors import InvalidInputError
from engine.pg import Connection
from engine.ports import Port, sequence_literal, table
from engine.scopes import RunRef, check_scope, normalize_namespace

from .admission import _Params
from .layout import PhaseClock, SheetLayout, column, layout_for, run_sheet_transaction
from .model import (
    Attempt,
    Completion,
    CompletionDiagnostics,
    FencedRow,
    PreparedOutcome,
    SheetContract,
    prepare_outcomes,
)

log = logging.getLogger("runplane.sheets")

COMPLETE_CHUNK_ROWS = 10_000
COMPLETE_CHUNK_BYTES = 2 * 1024 * 1024
COMPLETE_STATEMENT_TIMEOUT_MS = 60_000

_BASE_META = """
base AS MATERIALIZED (
    SELECT coalesce(jsonb_object_agg(f, jsonb_build_object(
               'status', 'completed', 'run_id', $5::text,
               'completed_at', extract(epoch FROM now())::float8)), '{}'::jsonb) AS meta
      FROM unnest($7::text[]) AS f
)"""

# The cell-meta patch of one outcome: the completed base, each field merged with the
# outcome's own meta for it (completed outcomes); the outcome's own meta (failed ones).
_COMPLETED_PATCH = """CASE WHEN i.meta IS NULL THEN b.meta ELSE b.meta || (
    SELECT jsonb_object_agg(e.key, coalesce(b.meta -> e.key, '{}'::jsonb) || e.value)
      FROM jsonb_each(i.meta) AS e) END"""
_FAILED_PATCH = "coalesce(i.meta, '{}'::jsonb)"

# New cell meta. A row already in the target status may be a replay: its fields recorded
# identically but for `completed_at` keep the old entry. Other rows just take the patch.
_NEW_META = """CASE WHEN s._status = '{target}' THEN s._cell_meta || coalesce((
    SELECT jsonb_object_agg(e.key, CASE
               WHEN jsonb_typeof(s._cell_meta -> e.key) = 'object'
                AND (s._cell_meta -> e.key) - 'completed_at' = e.value - 'completed_at'
               THEN s._cell_meta -> e.key ELSE e.value END)
      FROM jsonb_each(p.patch) AS e), '{{}}'::jsonb)
    ELSE s._cell_meta || p.patch END"""


def _counter_ctes(
    summary: str, column_summary: str, moved: str, target: str | None, counted: Sequence[str]
) -> str:
    """CTEs applying the status and cell-meta deltas of the rows in `moved` (prev_status,
    prev_meta, new_meta); `target` is the status they moved to, `counted` the binds naming the
    fields whose cell-meta status may have moved (one pass over `moved` for all of them)."""
    completed_plus = "d.n" if target == "enriched" else "0"
    failed_plus = "d.n" if target == "failed" else "0"
    sums = ", ".join(
        f"sum(((m.new_meta -> {name} ->> 'status') IS NOT DISTINCT FROM 'completed')::int"
        f" - ((m.prev_meta -> {name} ->> 'status') IS NOT DISTINCT FROM 'completed')::int)"
        f" AS c{j}, "
        f"sum(((m.new_meta -> {name} ->> 'status') IS NOT DISTINCT FROM 'failed')::int"
        f" - ((m.prev_meta -> {name} ->> 'status') IS NOT DISTINCT FROM 'failed')::int) AS f{j}"
        for j, name in enumerate(counted)
    )
    rows = ", ".join(f"({name}, d.c{j}, d.f{j})" for j, name in enumerate(counted))
    if counted:
        cells = f"""
cell_delta AS (
    SELECT {sums} FROM {moved} AS m WHERE cardinality($8::text[]) >= 0
),
column_summary AS (
    INSERT INTO {column_summary} AS c (org_id, play, table_namespace, field, completed, failed)
    SELECT $9::text, $10::text, $11::text, v.field, v.completed, v.failed
      FROM cell_delta d CROSS JOIN LATERAL (VALUES {rows}) AS v(field, completed, failed)
     WHERE v.completed <> 0 OR v.failed <> 0
    ON CONFLICT (org_id, play, table_namespace, field) DO UPDATE
       SET completed = c.completed + EXCLUDED.completed, failed = c.failed + EXCLUDED.failed
    RETURNING 1
)"""
    else:
        cells = """
column_summary AS (SELECT 1 WHERE cardinality($8::text[]) < 0)"""
    return f"""
status_delta AS (
    SELECT count(*) AS n,
           count(*) FILTER (WHERE prev_status = 'pending') AS was_pending,
           count(*) FILTER (WHERE prev_status = 'running') AS was_running,
           count(*) FILTER (WHERE prev_status = 'enriched') AS was_enriched,
           count(*) FILTER (WHERE prev_status = 'failed') AS was_failed,
           count(*) FILTER (WHERE prev_status IS NULL) AS was_absent
      FROM {moved}
),
summary AS (
    UPDATE {summary} AS s
       SET total = s.total + d.was_absent,
           queued = s.queued - d.was_pending,
           running = s.running - d.was_running,
           completed = s.completed - d.was_enriched + {completed_plus},
           failed = s.failed - d.was_failed + {failed_plus},
           updated_at = now()
      FROM status_delta d
     WHERE s.org_id = $9::text AND s.play = $10::text AND s.table_namespace = $11::text
       AND d.n > 0
    RETURNING 1
),{cells}"""


def build_exact_sql(
    port: Port, layout: SheetLayout, fields: Sequence[str], counted: Sequence[str], failed: bool
) -> str:
    """The exact-key statement of one chunk.

    Binds: $1 keys, $2 data, $3 cell meta, $4 write version, $5 run id, $6 attempt id,
    $7 fields marked completed, $8 fields whose cell counters may move, $9 org, $10 play,
    $11 namespace, $12 errors, then one name per data field.
    Rows are looked up one index probe per key (a LATERAL with LIMIT), so a chunk never scans
    the sheet whatever the planner believes about its size.
    """
    names = _Params(13)
    t = layout.qualified
    cols = [(column(f), names.add(f, "text")) for f in fields]
    counted_names = [names.add(f, "text") for f in counted]
    data_changed = "".join(
        f" OR (i.data ? {name} AND s.{col} IS DISTINCT FROM i.data -> {name})" for col, name in cols
    )
    sets = "".join(
        f", {col} = CASE WHEN c.data ? {name} THEN c.data -> {name} ELSE t.{col} END"
        for col, name in cols
    )
    target = "failed" if failed else "enriched"
    already = "WHEN s._status = 'enriched' THEN 'already_completed'" if failed else ""
    patch = _FAILED_PATCH if failed else _COMPLETED_PATCH
    new_error = "i.error" if failed else "NULL::text"
    version = f"nextval({sequence_literal(port, 'row_versions')}::regclass)"
    counters = _counter_ctes(
        table(port, "sheet_summary"), table(port, "sheet_column_summary"), "applied", target,
        counted_names,
    )
    new_meta = _NEW_META.format(target=target)
    return f"""
WITH input AS MATERIALIZED (
    SELECT u.key, u.data, u.meta, u.error, u.ord
      FROM unnest($1::text[], $2::jsonb[], $3::jsonb[], $12::text[])
           WITH ORDINALITY AS u(key, data, meta, error, ord)
),{_BASE_META},
cur AS MATERIALIZED (
    SELECT i.ord, i.key, i.data, i.error, s._key IS NOT NULL AS found,
           s._status AS prev_status, s._write_version AS prev_version,
           s._cell_meta AS prev_meta, n.new_meta,
           CASE WHEN s._write_version > $4::bigint THEN 'stale_write_version'
                WHEN s._write_version < $4::bigint THEN 'unadmitted'
                WHEN $6::text IS NOT NULL AND s._attempt_id IS NOT NULL
                     AND s._attempt_id <> $6::text THEN 'attempt_superseded'
                {already}
           END AS fence,
           (s._status IS DISTINCT FROM '{target}' OR s._error IS DISTINCT FROM {new_error}
            OR n.new_meta IS DISTINCT FROM s._cell_meta{data_changed}) AS changed
      FROM input i
      CROSS JOIN base b
      LEFT JOIN LATERAL (SELECT * FROM {t} AS s WHERE s._key = i.key LIMIT 1) AS s ON true
      CROSS JOIN LATERAL (SELECT {patch} AS patch) AS p
      CROSS JOIN LATERAL (SELECT {new_meta} AS new_meta) AS n
),
applied AS (
    UPDATE {t} AS t
       SET _status = '{target}', _error = c.error, _run_id = $5::text, _cell_meta = c.new_meta,
           _attempt_expires_at = NULL, _version = {version}, _updated_at = now(){sets}
      FROM cur c
     WHERE c.found AND c.fence IS NULL AND c.changed
       AND t._key = c.key AND t._write_version = $4::bigint
    RETURNING c.prev_status, c.prev_meta, c.new_meta
),{counters}
SELECT (SELECT count(*) FROM applied) AS updated,
       (SELECT count(*) FROM summary) + (SELECT count(*) FROM column_summary) AS counter_rows,
       (SELECT array_agg(ord ORDER BY ord) FROM cur WHERE NOT found) AS missing_ords,
       (SELECT array_agg(ord ORDER BY ord) FROM cur WHERE fence IS NOT NULL) AS fenced_ords,
       (SELECT array_agg(fence ORDER BY ord) FROM cur WHERE fence IS NOT NULL) AS fenced_reasons,
       (SELECT array_agg(prev_version ORDER BY ord) FROM cur WHERE fence IS NOT NULL)
           AS fenced_versions
"""


RETURNING_OLD_SINCE = 180000  # PostgreSQL 18: RETURNING old.* / new.*


def build_exact_sql_returning_old(
    port: Port, layout: SheetLayout, fields: Sequence[str], counted: Sequence[str], failed: bool
) -> str:
    """The exact-key statement for PostgreSQL >= 18, with the binds of `build_exact_sql`.

    The fenced UPDATE probes each row once and returns the old status and cell meta for the
    counters (`RETURNING old.*`). Rows it did not update are classified afterwards from the
    statement's snapshot — and only when some row was not updated (a one-time filter), so the
    common all-applied chunk never probes the sheet twice.
    """
    names = _Params(13)
    t = layout.qualified
    cols = [(column(f), names.add(f, "text")) for f in fields]
    counted_names = [names.add(f, "text") for f in counted]
    data_changed = "".join(
        f" OR (c.data ? {name} AND t.{col} IS DISTINCT FROM c.data -> {name})" for col, name in cols
    )
    sets = "".join(
        f", {col} = CASE WHEN c.data ? {name} THEN c.data -> {name} ELSE t.{col} END"
        for col, name in cols
    )
    target = "failed" if failed else "enriched"
    already = "WHEN s._status = 'enriched' THEN 'already_completed'" if failed else ""
    not_enriched = "AND t._status <> 'enriched'" if failed else ""
    patch = _FAILED_PATCH if failed else _COMPLETED_PATCH
    new_error = "c.error" if failed else "NULL::text"
    version = f"nextval({sequence_literal(port, 'row_versions')}::regclass)"
    counters = _counter_ctes(
        table(port, "sheet_summary"), table(port, "sheet_column_summary"), "applied", target,
        counted_names,
    )
    new_meta = (
        _NEW_META.format(target=target)
        .replace("s._status", "t._status").replace("s._cell_meta", "t._cell_meta")
        .replace("p.patch", "c.patch")
    )
    return f"""
WITH {_BASE_META.strip()},
source AS MATERIALIZED (
    SELECT i.key, i.data, i.error, i.ord, {patch} AS patch
      FROM unnest($1::text[], $2::jsonb[], $3::jsonb[], $12::text[])
           WITH ORDINALITY AS i(key, data, meta, error, ord)
      CROSS JOIN base b
),
applied AS (
    UPDATE {t} AS t
       SET _status = '{target}', _error = c.error, _run_id = $5::text, _cell_meta = {new_meta},
           _attempt_expires_at = NULL, _version = {version}, _updated_at = now(){sets}
      FROM source c
     WHERE t._key = c.key AND t._write_version = $4::bigint
       AND ($6::text IS NULL OR t._attempt_id IS NULL OR t._attempt_id = $6::text)
       {not_enriched}
       AND (t._status IS DISTINCT FROM '{target}' OR t._error IS DISTINCT FROM {new_error}{data_changed}
            OR {new_meta} IS DISTINCT FROM t._cell_meta)
    RETURNING c.ord, old._status AS prev_status, old._cell_meta AS prev_meta,
              new._cell_meta AS new_meta
),{counters},
rest AS MATERIALIZED (
    SELECT i.ord, s._key IS NOT NULL AS found, s._write_version AS prev_version,
           CASE WHEN s._write_version > $4::bigint THEN 'stale_write_version'
                WHEN s._write_version < $4::bigint THEN 'unadmitted'
                WHEN $6::text IS NOT NULL AND s._attempt_id IS NOT NULL
                     AND s._attempt_id <> $6::text THEN 'attempt_superseded'
                {already}
           END AS fence
      FROM source i
      LEFT JOIN LATERAL (SELECT _key, _status, _write_version, _attempt_id FROM {t} AS s
                          WHERE s._key = i.key LIMIT 1) AS s ON true
     WHERE (SELECT count(*) FROM applied) < (SELECT count(*) FROM source)
)
SELECT (SELECT count(*) FROM applied) AS updated,
       (SELECT count(*) FROM summary) + (SELECT count(*) FROM column_summary) AS counter_rows,
       (SELECT array_agg(ord ORDER BY ord) FROM rest WHERE NOT found) AS missing_ords,
       (SELECT array_agg(ord ORDER BY ord) FROM rest WHERE fence IS NOT NULL) AS fenced_ords,
       (SELECT array_agg(fence ORDER BY ord) FROM rest WHERE fence IS NOT NULL) AS fenced_reasons,
       (SELECT array_agg(prev_version ORDER BY ord) FROM rest WHERE fence IS NOT NULL)
           AS fenced_versions
"""


def build_insert_sql(
    port: Port, layout: SheetLayout, fields: Sequence[str], counted: Sequence[str]
) -> str:
    """Insert completed outcomes whose rows are missing, as `enriched` rows of our version.

    Binds: $1 keys, $2 data, $3 cell meta, $4 write version, $5 run id, $6 attempt id,
    $7 fields marked completed, $8 fields whose cell counters may move, $9 org, $10 play,
    $11 namespace, $12 input indexes, $13 attempt seq, then one name per data field.
    """
    names = _Params(14)
    t = layout.qualified
    cols = [(column(f), names.add(f, "text")) for f in fields]
    counted_names = [names.add(f, "text") for f in counted]
    insert_cols = "".join(f", {col}" for col, _ in cols)
    insert_vals = "".join(f", i.data -> {name}" for _, name in cols)
    counters = _counter_ctes(
        table(port, "sheet_summary"), table(port, "sheet_column_summary"), "moved", "enriched",
        counted_names,
    )
    return f"""
WITH input AS MATERIALIZED (
    SELECT u.key, u.data, u.meta, u.idx, u.ord
      FROM unnest($1::text[], $2::jsonb[], $3::jsonb[], $12::bigint[])
           WITH ORDINALITY AS u(key, data, meta, idx, ord)
),{_BASE_META},
inserted AS (
    INSERT INTO {t} (_key, _status, _run_id, _write_version, _input_index, _attempt_id,
                     _attempt_seq, _cell_meta{insert_cols})
    SELECT i.key, 'enriched', $5::text, $4::bigint, i.idx, $6::text, $13::integer,
           {_COMPLETED_PATCH}{insert_vals}
      FROM input i CROSS JOIN base b
    ON CONFLICT (_key) DO NOTHING
    RETURNING _key, _cell_meta
),
moved AS MATERIALIZED (
    SELECT NULL::text AS prev_status, '{{}}'::jsonb AS prev_meta, _cell_meta AS new_meta
      FROM inserted
),{counters}
SELECT (SELECT array_agg(_key) FROM inserted) AS inserted_keys,
       (SELECT count(*) FROM summary) + (SELECT count(*) FROM column_summary) AS counter_rows
"""


# The repair joins on (write version, input index), which no index covers: let the planner
# hash it (the sheet transaction turned hash and merge joins off for its key probes).
_JOINS_ON = "SET LOCAL enable_hashjoin = on; SET LOCAL enable_mergejoin = on"

_REPAIR_TARGETS = """
SELECT u.ord, s._key
  FROM unnest($1::bigint[], $2::bigint[]) AS u(ord, idx)
  JOIN {t} s ON s._write_version = $3::bigint AND s._input_index = u.idx
 WHERE s._key <> ALL($4::text[])
 ORDER BY u.ord, s._key
"""


def _chunks(outcomes: list[PreparedOutcome]) -> list[list[PreparedOutcome]]:
    chunks: list[list[PreparedOutcome]] = []
    current: list[PreparedOutcome] = []
    size = 0
    for outcome in outcomes:
        if current and (
            len(current) >= COMPLETE_CHUNK_ROWS or size + outcome.size > COMPLETE_CHUNK_BYTES
        ):
            chunks.append(current)
            current, size = [], 0
        current.append(outcome)
        size += outcome.size
    if current:
        chunks.append(current)
    return chunks


@attrs.define(eq=False)
class _Tally:
    """Results of one transaction attempt (rebuilt from scratch if it is retried)."""

    updated: int = 0
    chunks: int = 0
    committed: set[str] = attrs.field(factory=set)
    fenced: dict[str, FencedRow] = attrs.field(factory=dict)


@attrs.define(eq=False)
class _Writer:
    port: Port
    layout: SheetLayout
    run: RunRef
    attempt: Attempt | None
    base_fields: list[str]
    clock: PhaseClock
    server_version: int = 0

    def _counted(self, chunk: list[PreparedOutcome], failed: bool) -> list[str]:
        """Fields whose cell-meta status this chunk may move."""
        meta_keys = {k for o in chunk for k in o.meta_keys}
        return sorted(meta_keys if failed else meta_keys.union(self.base_fields))

    def _common(self, counted: list[str], failed: bool) -> list[Any]:
        return [
            self.run.epoch, self.run.run_id,
            self.attempt.attempt_id if self.attempt else None,
            [] if failed else self.base_fields, counted, *self.layout.counter_args,
        ]

    async def exact(
        self, conn: Connection, chunk: list[PreparedOutcome], keys: list[str], failed: bool,
        phase: str, tally: _Tally,
    ) -> list[PreparedOutcome]:
        """Apply one chunk by exact key (`keys[i]` is the row for `chunk[i]`); return misses."""
        fields = sorted({k for o in chunk for k in o.data_keys})
        build = (
            build_exact_sql_returning_old if self.server_version >= RETURNING_OLD_SINCE
            else build_exact_sql
        )
        counted = self._counted(chunk, failed)
        sql = build(self.port, self.layout, fields, counted, failed)
        args = [
            keys, [o.data_text for o in chunk], [o.meta_text for o in chunk],
            *self._common(counted, failed), [o.error for o in chunk], *fields, *counted,
        ]
        record = await self.clock.measure(phase, conn.fetchrow(sql, *args))
        tally.chunks += 1
        tally.updated += record["updated"]
        missing = set(record["missing_ords"] or ())
        fenced_ords = record["fenced_ords"] or []
        for ord_, reason, version in zip(
            fenced_ords, record["fenced_reasons"] or [], record["fenced_versions"] or []
        ):
            key = chunk[ord_ - 1].key
            tally.fenced[key] = FencedRow(key, reason, version)
        fenced = set(fenced_ords)
        for ord_, outcome in enumerate(chunk, start=1):
            if ord_ not in missing and ord_ not in fenced:
                tally.committed.add(outcome.key)
        return [chunk[ord_ - 1] for ord_ in sorted(missing)]

    async def repair(
        self, conn: Connection, misses: list[PreparedOutcome], all_keys: list[str], tally: _Tally
    ) -> None:
        indexed = [(i, o) for i, o in enumerate(misses) if o.input_index is not None]
        targets: dict[int, str] = {}
        if indexed:
            await conn.execute(_JOINS_ON)
            rows = await self.clock.measure("insert_missing", conn.fetch(
                _REPAIR_TARGETS.format(t=self.layout.qualified),
                [i for i, _ in indexed], [o.input_index for _, o in indexed],
                self.run.epoch, all_keys,
            ))
            used: set[str] = set()
            for row in rows:
                if row["ord"] in targets or row["_key"] in used:
                    continue
                targets[row["ord"]] = row["_key"]
                used.add(row["_key"])
        unmatched: list[PreparedOutcome] = []
        target_of = {id(misses[i]): key for i, key in targets.items()}
        for failed in (False, True):
            group = [o for o in misses if o.failed == failed and id(o) in target_of]
            for chunk in _chunks(group):
                keys = [target_of[id(o)] for o in chunk]
                unmatched += await self.exact(conn, chunk, keys, failed, "insert_missing", tally)
        unmatched += [o for i, o in enumerate(misses) if i not in targets]
        to_insert = [o for o in unmatched if not o.failed]
        for o in unmatched:
            if o.failed:
                tally.fenced[o.key] = FencedRow(o.key, "missing", None)
        for chunk in _chunks(to_insert):
            fields = sorted({k for o in chunk for k in o.data_keys})
            counted = self._counted(chunk, False)
            sql = build_insert_sql(self.port, self.layout, fields, counted)
            args = [
                [o.key for o in chunk], [o.data_text for o in chunk],
                [o.meta_text for o in chunk], *self._common(counted, False),
                [o.input_index for o in chunk],
                self.attempt.seq if self.attempt else None, *fields, *counted,
            ]
            record = await self.clock.measure("insert_missing", conn.fetchrow(sql, *args))
            tally.chunks += 1
            inserted = set(record["inserted_keys"] or ())
            tally.updated += len(inserted)
            for o in chunk:
                if o.key in inserted:
                    tally.committed.add(o.key)
                else:  # a concurrent writer cannot interleave; kept for completeness
                    tally.fenced[o.key] = FencedRow(o.key, "missing", None)


async def complete(
    port: Port,
    run: RunRef,
    table_namespace: str,
    contract: SheetContract,
    outcomes: Sequence[Any],
    *,
    attempt: Attempt | None = None,
    on_diagnostics: Callable[[CompletionDiagnostics], Any] | None = None,
) -> Completion:
    """Write `outcomes` into the sheet under the run's write version (see module docstring)."""
    started = time.perf_counter()
    check_scope(port, run)
    if not isinstance(contract, SheetContract):
        raise InvalidInputError("contract must be a SheetContract")
    if attempt is not None and not isinstance(attempt, Attempt):
        raise InvalidInputError("attempt must be an Attempt or None")
    namespace = normalize_namespace(table_namespace)
    prepared, input_rows = prepare_outcomes(outcomes)
    inputs = set(contract.inputs)
    data_fields = {k for o in prepared for k in o.data_keys}
    base_fields = sorted(set(contract.outputs) | (data_fields - inputs))
    layout = layout_for(port, run.scope.play_scope, namespace)
    clock = PhaseClock()
    writer = _Writer(port, layout, run, attempt, base_fields, clock)
    completed = [o for o in prepared if not o.failed]
    failed = [o for o in prepared if o.failed]
    all_keys = [o.key for o in prepared]

    async def op(conn: Connection, server_version: int) -> _Tally:
        writer.server_version = server_version
        tally = _Tally()
        misses: list[PreparedOutcome] = []
        for chunk in _chunks(completed):
            misses += await writer.exact(conn, chunk, [o.key for o in chunk], False, "update", tally)
        for chunk in _chunks(failed):
            misses += await writer.exact(
                conn, chunk, [o.key for o in chunk], True, "failed_update", tally
            )
        if misses:
            await writer.repair(conn, misses, all_keys, tally)
        return tally

    tally = _Tally()
    outcome = "failed"
    try:
        if prepared:
            fields = list(dict.fromkeys([*contract.fields, *sorted(data_fields)]))
            tally = await run_sheet_transaction(
                port, layout, fields, op, timeout_ms=COMPLETE_STATEMENT_TIMEOUT_MS, clock=clock,
            )
        outcome = "succeeded"
    finally:
        diagnostics = _diagnostics(
            clock, outcome, input_rows, prepared, tally, time.perf_counter() - started
        )
        if on_diagnostics is not None:
            await _deliver(on_diagnostics, diagnostics)
    return Completion(
        updated=tally.updated,
        committed_keys=tuple(k for k in all_keys if k in tally.committed),
        fenced=tuple(tally.fenced[k] for k in all_keys if k in tally.fenced),
        diagnostics=diagnostics,
    )


def _diagnostics(clock: PhaseClock, outcome: str, input_rows: int, prepared, tally: _Tally,
                 total_s: float) -> CompletionDiagnostics:
    ms, failures = clock.ms, clock.failures
    values: dict[str, Any] = {}
    for phase in ("permit_wait", "connect", "begin", "update", "insert_missing",
                  "failed_update", "commit"):
        values[f"{phase}_ms"] = round(ms.get(phase, 0.0), 3)
        values[f"{phase}_failures"] = failures.get(phase, 0)
    return CompletionDiagnostics(
        outcome=outcome,
        input_rows=input_rows,
        unique_rows=len(prepared),
        completed_rows=sum(1 for o in prepared if not o.failed),
        failed_rows=sum(1 for o in prepared if o.failed),
        chunks=tally.chunks,
        updated_rows=tally.updated,
        fenced_rows=len(tally.fenced),
        column_retries=clock.column_retries,
        total_ms=round(total_s * 1000.0, 3),
        **values,
    )


async def _deliver(sink: Callable[[CompletionDiagnostics], Any], diagnostics) -> None:
    """Hand diagnostics to the sink; its failures are logged, never raised."""
    try:
        result = sink(diagnostics)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("sheet completion diagnostics sink failed; the result is unaffected")
