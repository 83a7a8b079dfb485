"""Maps into a sheet PostgreSQL has statistics on, against the first map into it.

    python benchmarks/analyzed.py [--rows 200000] [--rounds 3]

Each round, in a fresh schema: `run.map` of `--rows` rows (a list, a no-op function) into a new
sheet; `ANALYZE` of every table of the schema (what autovacuum does by itself once a table has
changed by 10%); then a new run maps `--rows`/10 new rows into the same sheet, and a third run
maps those rows again (a rerun: every row a cache hit). Prints the per-row cost of the new rows
and of the rerun against the first map's (targets: new rows <= 1.5; the rerun's is the fast
path's figure). Before the sheet statements were shaped to reach the sheet by its keys whatever
the statistics say, the new rows cost about 30-75 times the first map's per row.

The ratios are the median over `--rounds` of each round's own ratio (its sides run back to back
on the same server, so load swings between rounds cancel out).

`measure(dsn, rows)` is shared with `benchmarks/map.py --parts analyzed` and
`benchmarks/sheets.py`.

The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from _rows import CONTRACT, noop  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402


def rows(tag: str, count: int) -> list[dict]:
    return [{"name": f"{tag}-{i}", "n": i} for i in range(count)]


async def analyze_schema(tenant) -> None:
    async with tenant.connection("sheet") as conn:
        tables = await conn.fetch(
            "SELECT quote_ident(schemaname) || '.' || quote_ident(relname) AS t"
            " FROM pg_stat_user_tables WHERE schemaname = $1", tenant.schema)
        for row in tables:
            await conn.execute(f"ANALYZE {row['t']}")


async def per_row(tenant, source: list[dict]) -> float:
    """Seconds per row of one `run.map` of `source` in a run of its own."""
    async with open_run(tenant, "bench") as run:
        started = time.perf_counter()
        await run.map("analyzed", source, noop, contract=CONTRACT)
        elapsed = time.perf_counter() - started
    return elapsed / len(source)


async def measure(dsn: str, count: int) -> tuple[float, float]:
    """(new rows / first map, rerun / first map), per row, in a fresh schema."""
    schema = f"bench_analyzed_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            first = await per_row(tenant, rows("first", count))
            await analyze_schema(tenant)
            new_rows = rows("new", max(1, count // 10))
            new = await per_row(tenant, new_rows)
            rerun = await per_row(tenant, new_rows)
            return new / first, rerun / first
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def main(count: int, rounds: int) -> None:
    dsn = bench_dsn()
    new_ratios, rerun_ratios = [], []
    for r in range(rounds):
        new, rerun = await measure(dsn, count)
        new_ratios.append(new)
        rerun_ratios.append(rerun)
        print(f"round {r + 1}: new rows {new:.2f}x, rerun {rerun:.3f}x the first map per row")
    report(count, rounds, new_ratios, rerun_ratios)


def report(count: int, rounds: int, new_ratios: list[float], rerun_ratios: list[float]) -> None:
    print(f"analyzed sheet of {count:,} rows, {count // 10:,} new rows (median of {rounds}):")
    print(f"  per-row cost of new rows / first map: {statistics.median(new_ratios):.2f}"
          " (target <= 1.5)")
    print(f"  per-row cost of their rerun / first map: {statistics.median(rerun_ratios):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trio.run(main, args.rows, args.rounds)
