"""The raw ceilings of a durable map for `benchmarks/ceiling.py`: no engine, one connection.

- sheet-shaped: per 10,000 rows a binary COPY of the admitted rows (SHA-256 key, canonical JSON
  inputs, one jsonb column per field) into a table shaped like a sheet (its system columns,
  order index and fillfactor), then one fenced `UPDATE … FROM unnest … WHERE _write_version = $v` of their
  completions.
- minimal: the same into a five-column table (key, inputs as one jsonb, status, version,
  outputs): a binary COPY of (key, inputs, status, version), then a fenced unnest UPDATE of
  status and outputs.
The rows are built before the clock starts, so each figure is the database's alone.
"""

from __future__ import annotations

import hashlib
import json
import time

from runplane.engine.sheets.layout import SHEET_FILLFACTOR

CHUNK = 10_000

_SHEET_TABLE = """
CREATE TABLE {t} (
    _key text PRIMARY KEY, _status text NOT NULL DEFAULT 'pending', _run_id text,
    _write_version bigint NOT NULL, _input_index bigint,
    _cell_meta jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    _created_at timestamptz NOT NULL DEFAULT now(), _updated_at timestamptz NOT NULL DEFAULT now(),
    name jsonb, n jsonb, ok jsonb
) WITH (fillfactor = {fillfactor})"""
_SHEET_INDEX = "CREATE INDEX ON {t} (_input_index, _created_at, _key)"
_SHEET_COMPLETE = """
UPDATE {t} AS s SET _status = 'completed', ok = u.ok, _updated_at = now()
  FROM unnest($1::text[], $2::jsonb[]) AS u(k, ok)
 WHERE s._key = u.k AND s._write_version = $3 AND s._status = 'pending'"""
_SHEET_COLUMNS = ("_key", "_run_id", "_write_version", "_input_index", "name", "n")

_MINIMAL_TABLE = """
CREATE TABLE {t} (
    key text PRIMARY KEY, inputs jsonb NOT NULL, status text NOT NULL,
    version bigint NOT NULL, outputs jsonb
) WITH (fillfactor = 70)"""
_MINIMAL_COMPLETE = """
UPDATE {t} AS s SET status = 'completed', outputs = u.o
  FROM unnest($1::text[], $2::jsonb[]) AS u(k, o)
 WHERE s.key = u.k AND s.version = $3 AND s.status = 'pending'"""
_MINIMAL_COLUMNS = ("key", "inputs", "status", "version")

_dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode


async def copy_records(conn, table: str, records: list[tuple], *, columns, schema: str):
    """Binary COPY of `records` into `schema.table` through the adapter's statement path (the
    engine itself writes with INSERT … unnest; COPY is the raw ceiling's)."""
    return await conn._statement(f"COPY {schema}.{table}", "copy_records_to_table", table,
                                 records=records, columns=list(columns), schema_name=schema)


def sheet_records(rows: list[dict], start: int) -> list[tuple]:
    """The admitted rows, sheet-shaped: SHA-256 key of the canonical row, inputs per field."""
    return [(hashlib.sha256(_dumps(r).encode()).hexdigest(), "raw", 1, start + i,
             _dumps(r["name"]), _dumps(r["n"])) for i, r in enumerate(rows)]


def minimal_records(rows: list[dict], start: int) -> list[tuple]:
    """The admitted rows, minimal: key, the canonical row as one jsonb, status, version."""
    records = []
    for r in rows:
        text = _dumps(r)
        records.append((hashlib.sha256(text.encode()).hexdigest(), text, "pending", 1))
    return records


async def ceiling_rate(tenant, schema: str, table: str, rows: list[dict], *,
                       minimal: bool = False) -> float:
    """Rows/s of the raw durable map of `rows` on one connection (see the module docstring)."""
    qualified = f'"{schema}"."{table}"'
    build = minimal_records if minimal else sheet_records
    chunks = [build(rows[start:start + CHUNK], start) for start in range(0, len(rows), CHUNK)]
    output = _dumps({"ok": True}) if minimal else _dumps(True)
    columns = _MINIMAL_COLUMNS if minimal else _SHEET_COLUMNS
    async with tenant.connection("sheet") as conn:
        await conn.execute((_MINIMAL_TABLE if minimal else _SHEET_TABLE).format(
            t=qualified, fillfactor=SHEET_FILLFACTOR))
        if not minimal:
            await conn.execute(_SHEET_INDEX.format(t=qualified))
        complete = (_MINIMAL_COMPLETE if minimal else _SHEET_COMPLETE).format(t=qualified)
        started = time.perf_counter()
        done = 0
        for records in chunks:
            await copy_records(conn, table, records, columns=columns, schema=schema)
            status = await conn.execute(complete, [r[0] for r in records],
                                        [output] * len(records), 1)
            done += int(status.split()[-1])
        elapsed = time.perf_counter() - started
        await conn.execute(f"DROP TABLE {qualified}")
    assert done == len(rows), done
    return len(rows) / elapsed
