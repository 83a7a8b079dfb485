"""Shared helpers for the sheet tests and simulations: runs, counts over the sheet."""

from __future__ import annotations

from engine import canonical
from engine.ports import table
from engine.runs import register
from engine.scopes import RunScope
from engine.sheets.layout import column_name, layout_for


async def new_run(port, play: str, run_id: str):
    return await register(port, RunScope(port.org_id, play, run_id))


async def counts_over_sheet(port, scope, namespace: str):
    """(summary counters, column counters) as a fresh COUNT over the sheet says, and as stored."""
    layout = layout_for(port, scope, namespace)
    async with port.connection("sheet") as conn:
        present = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", layout.qualified)
        fresh = {"total": 0, "queued": 0, "running": 0, "completed": 0, "failed": 0}
        fresh_columns: dict[str, tuple[int, int]] = {}
        if present:
            row = await conn.fetchrow(
                f"""SELECT count(*) AS total,
                           count(*) FILTER (WHERE _status = 'pending') AS queued,
                           count(*) FILTER (WHERE _status = 'running') AS running,
                           count(*) FILTER (WHERE _status = 'enriched') AS completed,
                           count(*) FILTER (WHERE _status = 'failed') AS failed
                      FROM {layout.qualified}"""
            )
            fresh = dict(row)
            for record in await conn.fetch(
                f"""SELECT e.key AS field,
                           count(*) FILTER (WHERE e.value ->> 'status' = 'completed') AS completed,
                           count(*) FILTER (WHERE e.value ->> 'status' = 'failed') AS failed
                      FROM {layout.qualified} s, jsonb_each(s._cell_meta) AS e
                     GROUP BY e.key"""
            ):
                fresh_columns[record["field"]] = (record["completed"], record["failed"])
        stored_row = await conn.fetchrow(
            f"""SELECT total, queued, running, completed, failed FROM {table(port, 'sheet_summary')}
                 WHERE org_id = $1 AND play = $2 AND table_namespace = $3""",
            *layout.counter_args,
        )
        stored = dict(stored_row) if stored_row else dict.fromkeys(fresh, 0)
        stored_columns = {
            r["field"]: (r["completed"], r["failed"])
            for r in await conn.fetch(
                f"""SELECT field, completed, failed FROM {table(port, 'sheet_column_summary')}
                     WHERE org_id = $1 AND play = $2 AND table_namespace = $3""",
                *layout.counter_args,
            )
        }
    # Fields without cells read as (0, 0) either way.
    fields = set(fresh_columns) | set(stored_columns)
    fresh_columns = {f: fresh_columns.get(f, (0, 0)) for f in fields}
    stored_columns = {f: stored_columns.get(f, (0, 0)) for f in fields}
    return (fresh, fresh_columns), (stored, stored_columns)


async def counters_match(port, scope, namespace: str) -> tuple[bool, str]:
    (fresh, fresh_cols), (stored, stored_cols) = await counts_over_sheet(port, scope, namespace)
    if fresh != stored or fresh_cols != stored_cols:
        return False, f"counters {stored} {stored_cols} != COUNT {fresh} {fresh_cols}"
    return True, ""


async def raw_rows(port, scope, namespace: str, fields=()):
    """Every stored row by key: system columns plus the given fields (decoded)."""
    layout = layout_for(port, scope, namespace)
    cols = "".join(f', "{column_name(f)}"::text AS "c{i}"' for i, f in enumerate(fields))
    async with port.connection("sheet") as conn:
        present = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", layout.qualified)
        if not present:
            return {}
        records = await conn.fetch(
            f"""SELECT _key, _status, _run_id, _write_version, _input_index, _attempt_id,
                       _attempt_seq, _attempt_expires_at, _cell_meta::text AS meta, _error,
                       _version{cols}
                  FROM {layout.qualified}"""
        )
    out = {}
    for r in records:
        row = {k: r[k] for k in ("_status", "_run_id", "_write_version", "_input_index",
                                 "_attempt_id", "_attempt_seq", "_attempt_expires_at",
                                 "_error", "_version")}
        row["_cell_meta"] = canonical.loads(r["meta"])
        for i, f in enumerate(fields):
            row[f] = canonical.loads(r[f"c{i}"])
        out[r["_key"]] = row
    return out
