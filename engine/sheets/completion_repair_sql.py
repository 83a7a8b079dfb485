"""SQL of completion's repair: the outcomes whose keys no row has.

How it works
- Never part of the exact-key statement (`completion_sql`), so the common path never scans by
  input index. `repair_targets_statement` finds, one lookup per input index through the sheet's
  row-order index, the rows of our write version at the missing outcomes' input indexes (whose
  keys are not among the call's); those rows then take their outcomes by the exact-key
  statement. `insert_statement` inserts, as `enriched` rows of our version, the completed
  outcomes nothing matched (a failed one is fenced `missing` by the caller).
Who calls: `engine.sheets.completion` only. This module does no I/O.
"""

from __future__ import annotations

from .completion_parts import (
    PATCH, CompletionSheet, OutcomeChunk, base_meta, completion_binds, counter_ctes,
    field_binds, in_leased_unit, leased_units,
)
from .layout import SheetLayout
from .model import RowStatus
from .statements import BindParams, Statement


def insert_statement(sheet: CompletionSheet, chunk: OutcomeChunk) -> Statement:
    """Insert completed outcomes whose rows are missing, as `enriched` rows of our version
    (`chunk.indexes` their input indexes), every output of `sheet.base_fields` marked
    completed; with `sheet.units`, not at the input index of a row of a shared-map unit leased
    now (those keys come back as `leased_keys`)."""
    binds = BindParams()
    n = completion_binds(binds, sheet, chunk)
    indexes = binds.add(chunk.indexes, "bigint[]")
    write = sheet.write
    seq = binds.add(write.attempt.seq if write.attempt else None, "integer")
    attempts = binds.add(chunk.attempts, "integer[]")
    n = field_binds(binds, n, sheet.columns, chunk)
    port, units = sheet.port, sheet.units
    t = sheet.layout.qualified
    insert_cols = "".join(f", {col}" for col, _ in n.cols)
    insert_vals = "".join(f", i.data -> {name}" for _, name in n.cols)
    return binds.statement(f"""
WITH input AS MATERIALIZED (
    SELECT u.key, u.data, u.meta, u.idx, u.attempts, u.ord
      FROM ROWS FROM ({n.keys}, jsonb_array_elements({n.data}), unnest({n.meta}),
                      unnest({indexes}), unnest({attempts}))
           WITH ORDINALITY AS u(key, data, meta, idx, attempts, ord)
),{leased_units(port, n) if units else ""}{base_meta(n, False)},
inserted AS (
    INSERT INTO {t} (_key, _status, _run_id, _write_version, _input_index, _attempt_id,
                     _attempt_seq, _attempts, _cell_meta{insert_cols})
    SELECT i.key, {RowStatus.ENRICHED.sql}, {n.run_id}, {n.version}, i.idx, {n.attempt_id}, {seq},
           coalesce(i.attempts, 1), {PATCH}{insert_vals}
      FROM input i CROSS JOIN base b
     WHERE NOT {in_leased_unit(n, "i.idx")}
    ON CONFLICT (_key) DO NOTHING
    RETURNING _key, _cell_meta
),
moved AS MATERIALIZED (
    SELECT NULL::text AS prev_status, '{{}}'::jsonb AS prev_meta, _cell_meta AS new_meta
      FROM inserted
),{counter_ctes(port, n, "moved", RowStatus.ENRICHED)}
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

