"""Shared helpers for the sheet tests and simulations: runs, counts over the sheet."""

from __future__ import annotations

from engine import canonical
from engine.runs import register
from engine.scopes import RunScope
from engine.sheets.layout import column_name, layout_for
from simulations.counters import counters_match  # noqa: F401  (re-exported for the tests)


async def new_run(port, play: str, run_id: str):
    return await register(port, RunScope(port.org_id, play, run_id))


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
