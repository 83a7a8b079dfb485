"""Admit then complete N rows through `engine.sheets`, against raw asyncpg baselines on the same
server in the same run: an unnest `INSERT … ON CONFLICT DO NOTHING` of the same rows, and a
fenced unnest `UPDATE … WHERE _write_version = $v` of the same patches, 10,000 rows a chunk, one
transaction each. Prints rows/s for each and the ratios (targets: both >= 0.6).
Then the analyzed round: `ANALYZE` of every table of the schema (as autovacuum does), and a new
run admits and completes N/10 new rows into the same sheet; prints their per-row cost against
the first pass's (target <= 1.5: plans that do not depend on the statistics).

    python benchmarks/sheets.py [--rows 100000] [--rounds 1] [--profile]

The baselines write a table of the same shape (created `LIKE` the sheet table, same fillfactor)
with keys already computed; they pay only JSON encoding and the statements. Ours pays everything a caller gets:
validation, canonical JSON, row keys, dispositions, fences, cell meta and exact counters.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import asyncpg  # noqa: E402  (the raw baselines only)
import trio  # noqa: E402

from _server import bench_dsn  # noqa: E402
from analyzed import analyze_schema  # noqa: E402
from runplane.engine import PlayScope, RunScope, open_tenant, runs  # noqa: E402
from runplane.engine.sheets import RowOutcome, SheetContract, admit, complete, ensure_sheet  # noqa: E402
from runplane.engine.sheets import layout  # noqa: E402
from runplane.engine.sheets.layout import column, layout_for  # noqa: E402

CHUNK = 10_000
CONTRACT = SheetContract(inputs=("name", "domain", "employees"), outputs=("score", "summary", "tags"))
NS = "bench_companies"


def make_rows(n: int) -> list[dict]:
    return [
        {"name": f"Company {i}", "domain": f"company-{i}.example.com", "employees": i % 5000}
        for i in range(n)
    ]


def make_output(i: int) -> dict:
    # ~200 bytes of outputs per row
    return {
        "score": (i % 97) / 7,
        "summary": f"Company {i} builds things; enrichment summary text of modest length #{i:07d}.",
        "tags": ["b2b", "saas", f"segment-{i % 13}", "enriched-by-benchmark", f"cohort-{i % 7}"],
    }


async def ours(dsn: str, schema: str, n: int, profile: bool):
    rows = make_rows(n)
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        run = await runs.register(tenant, RunScope("bench", "play", f"ours-{uuid.uuid4().hex}"))
        await ensure_sheet(tenant, PlayScope("bench", "play"), NS, CONTRACT)
        profiler = cProfile.Profile() if profile else None
        if profiler:
            profiler.enable()
        started = time.perf_counter()
        admission = await admit(tenant, run, NS, CONTRACT, rows)
        admit_s = time.perf_counter() - started
        assert admission.inserted == n, admission.inserted
        outcomes = [
            RowOutcome(r.key, "completed", make_output(r.input_index), input_index=r.input_index)
            for r in admission.pending
        ]
        started = time.perf_counter()
        completion = await complete(tenant, run, NS, CONTRACT, outcomes)
        complete_s = time.perf_counter() - started
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
        assert completion.updated == n, completion.updated
        layout = layout_for(tenant, PlayScope("bench", "play"), NS)
        keys = [r.key for r in admission.pending]
        print(f"  completion diagnostics: {completion.diagnostics}")
        await analyze_schema(tenant)
        later = await runs.register(tenant, RunScope("bench", "play", f"later-{uuid.uuid4().hex}"))
        new_rows = [{**r, "name": f"Later {r['name']}"} for r in make_rows(max(1, n // 10))]
        started = time.perf_counter()
        admission = await admit(tenant, later, NS, CONTRACT, new_rows)
        await complete(tenant, later, NS, CONTRACT, [
            RowOutcome(r.key, "completed", make_output(r.input_index), input_index=r.input_index)
            for r in admission.pending])
        analyzed = (time.perf_counter() - started) / len(new_rows) / ((admit_s + complete_s) / n)
        return n / admit_s, n / complete_s, layout.qualified, keys, run.epoch, analyzed


def raw(dsn: str, sheet: str, keys: list[str], epoch: int) -> tuple[float, float]:
    rows = make_rows(len(keys))
    raw_table = sheet[:-1] + '_raw"'
    name, domain, employees = (column(f) for f in CONTRACT.inputs)
    score, summary, tags = (column(f) for f in CONTRACT.outputs)
    insert_sql = f"""
        INSERT INTO {raw_table} (_key, _status, _run_id, _write_version, _input_index,
                                 {name}, {domain}, {employees})
        SELECT u.key, 'pending', 'raw', $3::bigint, u.idx,
               u.row -> 'name', u.row -> 'domain', u.row -> 'employees'
          FROM unnest($1::text[], $2::bigint[], $4::jsonb[]) AS u(key, idx, row)
        ON CONFLICT (_key) DO NOTHING"""
    update_sql = f"""
        UPDATE {raw_table} AS t
           SET _status = 'enriched', {score} = u.data -> 'score',
               {summary} = u.data -> 'summary', {tags} = u.data -> 'tags'
          FROM unnest($1::text[], $2::jsonb[]) AS u(key, data)
         WHERE t._key = u.key AND t._write_version = $3::bigint"""

    async def main() -> tuple[float, float]:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"CREATE TABLE {raw_table} (LIKE {sheet} INCLUDING ALL)")
            # the same storage parameters as the sheet (LIKE does not copy fillfactor)
            await conn.execute(
                f"ALTER TABLE {raw_table} SET (fillfactor = {layout.SHEET_FILLFACTOR})")
            started = time.perf_counter()
            async with conn.transaction():
                for low in range(0, len(keys), CHUNK):
                    chunk = range(low, min(low + CHUNK, len(keys)))
                    await conn.execute(
                        insert_sql, [keys[i] for i in chunk], list(chunk), epoch,
                        [json.dumps(rows[i]) for i in chunk],
                    )
            insert_rate = len(keys) / (time.perf_counter() - started)
            started = time.perf_counter()
            async with conn.transaction():
                for low in range(0, len(keys), CHUNK):
                    chunk = range(low, min(low + CHUNK, len(keys)))
                    await conn.execute(
                        update_sql, [keys[i] for i in chunk],
                        [json.dumps(make_output(i)) for i in chunk], epoch,
                    )
            update_rate = len(keys) / (time.perf_counter() - started)
            return insert_rate, update_rate
        finally:
            await conn.close()

    return asyncio.run(main())


async def drop(dsn: str, schema: str) -> None:
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        async with tenant.connection("sheet") as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    dsn = bench_dsn()
    admit_ratios, complete_ratios, analyzed_ratios = [], [], []
    for round_no in range(args.rounds):
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        try:
            admit_rate, complete_rate, sheet, keys, epoch, analyzed = trio.run(
                ours, dsn, schema, args.rows, args.profile
            )
            analyzed_ratios.append(analyzed)
            insert_rate, update_rate = raw(dsn, sheet, keys, epoch)
        finally:
            trio.run(drop, dsn, schema)
        admit_ratios.append(admit_rate / insert_rate)
        complete_ratios.append(complete_rate / update_rate)
        print(
            f"round {round_no + 1}: admit {admit_rate:8.0f} rows/s  raw insert {insert_rate:8.0f} rows/s"
            f"  ratio {admit_rate / insert_rate:.2f}\n"
            f"         complete {complete_rate:8.0f} rows/s  raw fenced update {update_rate:8.0f}"
            f" rows/s  ratio {complete_rate / update_rate:.2f}\n"
            f"         analyzed: {args.rows // 10} new rows cost {analyzed:.2f}x the first pass per row"
        )
    print(
        f"{args.rows} rows: admission median ratio {statistics.median(admit_ratios):.2f}, "
        f"completion median ratio {statistics.median(complete_ratios):.2f} (targets >= 0.6); "
        f"analyzed sheet, new rows per row / first pass {statistics.median(analyzed_ratios):.2f}"
        " (target <= 1.5)"
    )


if __name__ == "__main__":
    main()
