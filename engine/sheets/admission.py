"""Admission: put a page of input rows into a sheet under the run's write version.

How it works
- Rows are validated, normalized, keyed (`row_key`, or the explicit `keys`) and deduplicated in
  Python before any query (the first occurrence wins; later ones count as `skipped`).
- Chunks of at most `ADMIT_CHUNK_ROWS` rows go to one statement each, all in one sheet write
  transaction (`layout.run_sheet_transaction`). The statement inserts the new rows (`ON
  CONFLICT DO NOTHING`), and only when some row already existed reads the existing rows from
  its snapshot (which predates the inserts), decides their dispositions and re-admits the rows
  that need it; it applies the exact counter deltas to `sheet_summary`, in one round trip:
    * absent → inserted `pending` (`running` under the attempt's lease);
    * `enriched` with every contract output present (not NULL, JSON null or "") and its cell
      meta status `completed`, and no cell stale under its `CellPolicy` → `completed`, a cache
      hit whichever run wrote it; the row is not touched;
    * otherwise, owned by a newer write version → `blocked` (`newer_run`);
    * of our write version, `pending`/`running` under another attempt's unexpired lease →
      `blocked` (`attempt_active`);
    * with `give_up_after=N`, `failed` in N or more runs (`_failed_runs`, counted by
      completion) → `blocked` (`gave_up`); a larger N, or None, lets it run again;
    * otherwise → (re-)admitted to ours: status pending/running, our run, version, input index
      and lease, error cleared, stored input cells refreshed, earlier output cells and cell meta
      kept. Rows already exactly so are left untouched.
- Cell meta `completed_at` is epoch seconds from the server clock, so staleness is judged on
  the server's clock only; policies for fields that are not contract outputs are ignored.
- Cache hits are not touched: their `_run_id` stays the run that wrote them, so
  `read_rows(run_id=...)` lists only the rows a run (re)wrote itself.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from .. import canonical
from ..actions import action
from ..codecs import INT, RUN_REF, STR, USER_JSON, list_of, optional
from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import Port, sequence_literal, table
from ..scopes import RunRef, normalize_namespace

from .inputs import PreparedRows, check_write, prepare_rows
from .layout import BindParams, PhaseClock, SheetLayout, column, layout_for, run_sheet_transaction
from .model import (
    Admission,
    AdmittedRow,
    Attempt,
    BlockedRow,
    CellPolicy,
    SheetContract,
    Timing,
    clean_field,
    ADMISSION, ATTEMPT, CELL_POLICIES, CONTRACT,
)

ADMIT_CHUNK_ROWS = 10_000
ADMIT_STATEMENT_TIMEOUT_MS = 120_000


def build_admit_sql(
    port: Port, layout: SheetLayout, contract: SheetContract, policies: Mapping[str, CellPolicy]
) -> tuple[str, list[Any]]:
    """The admission statement of one chunk and its constant extra binds (after $1..$13).

    Binds: $1 keys, $2 input indexes, $3 write version, $4 run id, $5 attempt id, $6 attempt
    seq, $7 lease seconds, $8 org, $9 play, $10 namespace, $11 admitted status, $12 the rows as
    one JSON array (expanded beside the other arrays in `ROWS FROM`), $13 give up after this
    many failed runs (NULL: never).
    """
    extra = BindParams(14)
    t = layout.qualified
    inputs = [(column(f), extra.add(f, "text")) for f in contract.inputs]
    outputs = []
    for f in contract.outputs:
        name = extra.add(f, "text")
        policy = policies.get(f)
        seconds = extra.add(float(policy.stale_after_s), "float8") if policy else None
        outputs.append((column(f), name, seconds))

    cached_terms = ["s._status = 'enriched'"]
    for i, (col, name, seconds) in enumerate(outputs):
        cached_terms.append(
            f"s.{col} IS NOT NULL AND s.{col} <> 'null'::jsonb AND s.{col} <> '\"\"'::jsonb"
            f" AND (s._cell_meta -> {name} ->> 'status') IS NOT DISTINCT FROM 'completed'"
        )
        if seconds is not None:
            cached_terms.append(
                f"CASE WHEN jsonb_typeof(s._cell_meta -> {name} -> 'completed_at') = 'number'"
                f" THEN (s._cell_meta -> {name} ->> 'completed_at')::float8"
                f" >= extract(epoch FROM now())::float8 - {seconds} ELSE false END"
            )
    cached = " AND ".join(f"({term})" for term in cached_terms)
    out_cols = "".join(f", s.{col} AS o{i}" for i, (col, _, _) in enumerate(outputs))
    in_cols = "".join(f", s.{col} AS p{i}" for i, (col, _) in enumerate(inputs))
    payload_unnest = ", jsonb_array_elements($12::jsonb)" if inputs else ""
    unused_payload = "" if inputs else " WHERE $12::jsonb IS NULL OR true"
    payload_alias = ", payload" if inputs else ""
    insert_cols = "".join(f", {col}" for col, _ in inputs)
    insert_vals = "".join(f", d.payload -> {name}" for _, name in inputs)
    update_sets = "".join(f", {col} = d.payload -> {name}" for col, name in inputs)
    update_diff = "".join(
        f" OR d.p{i} IS DISTINCT FROM d.payload -> {name}" for i, (_, name) in enumerate(inputs)
    )
    completed_outputs = "".join(
        f", (SELECT jsonb_agg(o{i} ORDER BY ord) FROM decided"
        f" WHERE disposition = 'completed')::text AS o{i}"
        for i in range(len(outputs))
    )
    lease = (
        "CASE WHEN $5::text IS NULL THEN NULL::timestamptz"
        " ELSE now() + make_interval(secs => $7::float8) END"
    )
    version = f"nextval({sequence_literal(port, 'row_versions')}::regclass)"
    summary = table(port, "sheet_summary")
    sql = f"""
WITH input AS MATERIALIZED (
    SELECT u.key, u.idx, u.ord{payload_alias}
      FROM ROWS FROM (unnest($1::text[]), unnest($2::bigint[]){payload_unnest})
           WITH ORDINALITY AS u(key, idx{payload_alias}, ord){unused_payload}
),
inserted AS (
    INSERT INTO {t} (_key, _status, _run_id, _write_version, _input_index, _attempt_id,
                     _attempt_seq, _attempt_expires_at{insert_cols})
    SELECT d.key, $11::text, $4::text, $3::bigint, d.idx, $5::text, $6::integer, {lease}{insert_vals}
      FROM input d
    ON CONFLICT (_key) DO NOTHING
    RETURNING 1
),
cur AS MATERIALIZED (
    SELECT i.*, s._status AS prev_status,
           s._write_version AS prev_version, s._run_id AS prev_run, s._input_index AS prev_index,
           s._attempt_id AS prev_attempt, s._attempt_expires_at AS prev_expires,
           s._error AS prev_error, s._failed_runs AS prev_failed_runs,
           coalesce({cached}, false) AS cached{out_cols}{in_cols}
      FROM input i
      JOIN LATERAL (SELECT * FROM {t} AS s WHERE s._key = i.key LIMIT 1) AS s ON true
     WHERE (SELECT count(*) FROM inserted) < (SELECT count(*) FROM input)
),
decided AS MATERIALIZED (
    SELECT c.*,
           CASE WHEN c.cached THEN 'completed'
                WHEN c.prev_version > $3::bigint THEN 'newer_run'
                WHEN c.prev_version = $3::bigint AND c.prev_status IN ('pending', 'running')
                     AND c.prev_attempt IS NOT NULL AND c.prev_attempt IS DISTINCT FROM $5::text
                     AND c.prev_expires > now() THEN 'attempt_active'
                WHEN c.prev_status = 'failed' AND c.prev_failed_runs >= $13::integer
                     THEN 'gave_up'
                ELSE 'admit' END AS disposition
      FROM cur c
),
readmitted AS (
    UPDATE {t} AS t
       SET _status = $11::text, _run_id = $4::text, _write_version = $3::bigint,
           _input_index = d.idx, _attempt_id = $5::text, _attempt_seq = $6::integer,
           _attempt_expires_at = {lease}, _error = NULL, _version = {version},
           _updated_at = now(){update_sets}
      FROM decided d
     WHERE d.disposition = 'admit' AND t._key = d.key
       AND ($5::text IS NOT NULL OR d.prev_attempt IS NOT NULL OR d.prev_error IS NOT NULL
            OR d.prev_status IS DISTINCT FROM $11::text
            OR d.prev_version IS DISTINCT FROM $3::bigint
            OR d.prev_run IS DISTINCT FROM $4::text
            OR d.prev_index IS DISTINCT FROM d.idx{update_diff})
    RETURNING d.prev_status
),
delta AS (
    SELECT (SELECT count(*) FROM inserted) AS ins, count(*) AS moved,
           count(*) FILTER (WHERE prev_status = 'pending') AS was_pending,
           count(*) FILTER (WHERE prev_status = 'running') AS was_running,
           count(*) FILTER (WHERE prev_status = 'enriched') AS was_enriched,
           count(*) FILTER (WHERE prev_status = 'failed') AS was_failed
      FROM readmitted
),
summary AS (
    UPDATE {summary} AS s
       SET total = s.total + d.ins,
           queued = s.queued - d.was_pending
                    + CASE WHEN $11::text = 'pending' THEN d.ins + d.moved ELSE 0 END,
           running = s.running - d.was_running
                    + CASE WHEN $11::text = 'running' THEN d.ins + d.moved ELSE 0 END,
           completed = s.completed - d.was_enriched,
           failed = s.failed - d.was_failed,
           updated_at = now()
      FROM delta d
     WHERE s.org_id = $8::text AND s.play = $9::text AND s.table_namespace = $10::text
       AND (d.ins > 0 OR d.moved > 0)
    RETURNING 1
)
SELECT (SELECT ins FROM delta) AS inserted,
       (SELECT moved FROM delta) AS readmitted,
       (SELECT count(*) FROM summary) AS summary_rows,
       (SELECT array_agg(ord ORDER BY ord) FROM decided WHERE disposition = 'completed')
           AS completed_ords{completed_outputs},
       (SELECT array_agg(ord ORDER BY ord) FROM decided
         WHERE disposition IN ('newer_run', 'attempt_active', 'gave_up')) AS blocked_ords,
       (SELECT array_agg(disposition ORDER BY ord) FROM decided
         WHERE disposition IN ('newer_run', 'attempt_active', 'gave_up')) AS blocked_reasons
"""
    return sql, extra.values


def check_give_up_after(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidInputError(f"give_up_after must be an integer >= 1 or None, got {value!r}")


def _check_policies(cell_policies: Any) -> dict[str, CellPolicy]:
    if cell_policies is None:
        return {}
    if not isinstance(cell_policies, Mapping):
        raise InvalidInputError("cell_policies must map field names to CellPolicy")
    out = {}
    for name, policy in cell_policies.items():
        field = clean_field(name, "cell_policies")
        if not isinstance(policy, CellPolicy):
            raise InvalidInputError(f"cell_policies[{name!r}] must be a CellPolicy")
        out[field] = policy
    return out


@action("sheets.admit", params={
    "run": RUN_REF, "table_namespace": STR, "contract": CONTRACT, "rows": list_of(USER_JSON),
    "input_offset": INT, "keys": optional(list_of(STR)), "attempt": optional(ATTEMPT),
    "cell_policies": optional(CELL_POLICIES), "input_indexes": optional(list_of(INT)),
    "give_up_after": optional(INT),
}, result=ADMISSION, deadline_s=30.0)
async def admit(
    port: Port,
    run: RunRef,
    table_namespace: str,
    contract: SheetContract,
    rows: Sequence[dict],
    *,
    input_offset: int = 0,
    keys: Sequence[str] | None = None,
    attempt: Attempt | None = None,
    cell_policies: Mapping[str, CellPolicy] | None = None,
    input_indexes: Sequence[int] | None = None,
    give_up_after: int | None = None,
) -> Admission:
    """Admit `rows` into the sheet of (run's play, `table_namespace`) at the run's epoch.

    `input_indexes` (one per row) replaces `input_offset` + position as each row's input index.
    """
    started = time.perf_counter()
    check_write(port, run, contract, attempt)
    policies = _check_policies(cell_policies)
    check_give_up_after(give_up_after)
    namespace = normalize_namespace(table_namespace)
    prepared = prepare_rows(
        rows, namespace, input_offset=input_offset, keys=keys, need_texts=bool(contract.inputs),
        input_indexes=input_indexes,
    )
    layout = layout_for(port, run.scope.play_scope, namespace)
    sql, extra = build_admit_sql(port, layout, contract, policies)
    status = "running" if attempt is not None else "pending"
    common = [
        run.epoch, run.run_id,
        attempt.attempt_id if attempt else None,
        attempt.seq if attempt else None,
        float(attempt.lease_s) if attempt else 0.0,
        *layout.counter_args, status,
    ]
    extra = [give_up_after, *extra]
    clock = PhaseClock()
    clock.add("prepare", time.perf_counter() - started)
    n = len(prepared.keys)

    async def op(conn: Connection, _server_version: int) -> list[Any]:
        results = []
        for low in range(0, n, ADMIT_CHUNK_ROWS):
            high = min(low + ADMIT_CHUNK_ROWS, n)
            args = [prepared.keys[low:high], prepared.indexes[low:high], *common]
            texts = prepared.texts
            args.append("[" + ",".join(texts[low:high]) + "]" if texts is not None else None)
            statement = conn.fetchrow(sql, *args, *extra)
            results.append((low, await clock.measure("statement", statement)))
        return results

    results = []
    if n:
        results = await run_sheet_transaction(
            port, layout, contract.fields, op, timeout_ms=ADMIT_STATEMENT_TIMEOUT_MS, clock=clock,
        )
    admission = _build_admission(prepared, contract, results, run.epoch)
    clock.add("total", time.perf_counter() - started)
    timings = tuple(Timing(phase, ms, n) for phase, ms in clock.ms.items())
    return Admission(
        inserted=admission[0],
        skipped=prepared.skipped,
        pending=admission[1],
        completed=admission[2],
        blocked=admission[3],
        write_version=run.epoch,
        timings=timings,
    )


def _build_admission(prepared: PreparedRows, contract: SheetContract, results, version: int):
    inserted = 0
    completed: list[AdmittedRow] = []
    blocked: list[BlockedRow] = []
    taken: set[int] = set()
    loads = canonical.loads
    for low, record in results:
        inserted += record["inserted"]
        ords = record["completed_ords"] or []
        # each output column comes back as one JSON array (one decode per chunk and column)
        columns = [loads(record[f"o{i}"]) or [] for i in range(len(contract.outputs))]
        for j, ord_ in enumerate(ords):
            i = low + ord_ - 1
            row = dict(prepared.rows[i])
            for field, values in zip(contract.outputs, columns):
                row[field] = values[j]
            completed.append(AdmittedRow(prepared.keys[i], prepared.indexes[i], row))
            taken.add(i)
        for ord_, reason in zip(record["blocked_ords"] or [], record["blocked_reasons"] or []):
            i = low + ord_ - 1
            blocked.append(BlockedRow(prepared.keys[i], prepared.indexes[i], reason))
            taken.add(i)
    pending = tuple(
        AdmittedRow(key, index, row)
        for i, (key, index, row) in enumerate(zip(prepared.keys, prepared.indexes, prepared.rows))
        if i not in taken
    )
    return inserted, pending, tuple(completed), tuple(blocked)
