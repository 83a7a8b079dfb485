"""What the metrics cost a map: a no-op `run.map` with metrics on and off, in the same run.

    python benchmarks/metrics_overhead.py [--rows 100000] [--rounds 3] [--concurrency 16]

Each round maps `--rows` rows streamed from an async iterable through a no-op function twice,
into fresh sheets of one run: once with the per-call and per-statement observations on (the
default: `runplane_row_seconds`, `runplane_statement_seconds`, `runplane_permit_wait_seconds`)
and once with them off (`engine.observability.metrics.set_enabled(False)`), alternating which
goes first so a load swing between rounds cancels out. The row counters (`MapTally` pushing
deltas as it reports) run either way: they cost a few additions per report, not per row. Prints
rows/s of both sides (medians of rounds) and the median of the per-round ratios on/off (target
>= 0.97, SPEC §31). Traces are not in runplane yet, so this measures metrics alone.

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

from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant, sheets  # noqa: E402
from runplane.engine.observability import metrics  # noqa: E402

CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("ok",))
OUTPUT = {"ok": True}


async def stream(rows: int):
    for i in range(rows):
        yield {"name": f"r{i}", "n": i}


async def noop(_row: dict) -> dict:
    return OUTPUT


async def one_side(run, table: str, rows: int, concurrency: int, on: bool) -> float:
    metrics.set_enabled(on)
    try:
        started = time.perf_counter()
        result = await run.map(table, stream(rows), noop, contract=CONTRACT,
                               concurrency=concurrency)
        elapsed = time.perf_counter() - started
    finally:
        metrics.set_enabled(True)
    assert result.completed == rows, result
    return rows / elapsed


async def measure(dsn: str, rows: int, rounds: int, concurrency: int) -> None:
    schema = f"bench_metrics_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            on_rates, off_rates, ratios = [], [], []
            async with open_run(tenant, "bench") as run:
                for r in range(rounds):
                    order = (True, False) if r % 2 == 0 else (False, True)
                    got = {}
                    for on in order:
                        got[on] = await one_side(run, f"{'on' if on else 'off'}_{r}", rows,
                                                 concurrency, on)
                    on_rates.append(got[True])
                    off_rates.append(got[False])
                    ratios.append(got[True] / got[False])
            print(f"metrics on:  {statistics.median(on_rates):,.0f} rows/s over {rows:,} rows "
                  f"(median of {rounds})")
            print(f"metrics off: {statistics.median(off_rates):,.0f} rows/s")
            print(f"ratio on/off: {statistics.median(ratios):.3f} (per round: "
                  f"{', '.join(f'{x:.3f}' for x in ratios)}; target >= 0.97)")
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    trio.run(measure, bench_dsn(), args.rows, args.rounds, args.concurrency)


if __name__ == "__main__":
    main()
