"""run.map against the engine calls it is made of, on the same server in the same run.

    python benchmarks/map.py [--rows 100000] [--rounds 1] [--rss-rows 1000000] [--concurrency 16]
                             [--list-rows 100000] [--rerun-rows 10000,100000] [--parts ...]

1. Throughput: `run.map` with a no-op function over `--rows` rows streamed from an async
   iterable, against the same rows pushed straight through `engine.sheets.admit` +
   `engine.sheets.complete` in 10,000-row batches, inside the same run (each side writes its own
   sheet). Prints rows/s of both and the ratio map/direct (target >= 0.7): what the actors cost
   (channels, workers, batching) on top of the two engine calls.
2. Memory: peak RSS of a child process that streams `--rss-rows` rows through `run.map`
   (its own `VmHWM`, `benchmarks/_memory.py`; target <= 300 MB whatever the source size).

3. List vs stream (`--list-rows`, default 100,000): the first run of `run.map` over a list
   (encoded once, staged, admitted from its page facts) against the same rows from an async
   iterable, each into a fresh sheet; prints the time ratio list/stream (target <= 1.10).
4. Reruns (`--rerun-rows`, default 10000,100000): a new run maps the unchanged list again over
   the sheet a first run finished (every page is settled by a read-only probe); prints the time
   ratio rerun/first run (target <= 0.15).
5. Row policies: a retry policy that never fires on the no-op map (time ratio with/without,
   target overhead <= 5 %), and the shared rate limiter's statements per 1,000 calls at
   500 calls/s (`RateLimit(500, key=...)`, counted at the port; target <= 20).
Each ratio of parts 3-5 is the median over `--rounds` rounds (>= 3 for the figures in
docs/guide/benchmarks.md) of the ratio within a round, whose two sides run back to back, alternating which goes
first (a load swing between rounds, common on these machines, cancels out).

6. Analyzed (`--rows`): a first map into a fresh sheet, `ANALYZE`, then a tenth as many new
   rows and their rerun (`benchmarks/analyzed.py`); prints the new rows' per-row cost against
   the first map's (target <= 1.5), so no figure above hides behind a never-analyzed schema.

`--parts` picks what runs (default all): throughput,rss,list,rerun,policies,analyzed.

The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from _memory import peak_rss_mb  # noqa: E402
from _rows import CONTRACT, OUTPUT, noop, row, stream  # noqa: E402
from _server import bench_dsn  # noqa: E402
import analyzed  # noqa: E402
from runplane.actors import RateLimit, RowRetry, open_run  # noqa: E402
from runplane.simulations.ports import CountingPort  # noqa: E402
from runplane.engine import open_tenant, sheets  # noqa: E402

DIRECT_BATCH = 10_000


async def map_side(run, table: str, rows: int, concurrency: int) -> float:
    started = time.perf_counter()
    result = await run.map(table, stream(rows), noop, contract=CONTRACT, concurrency=concurrency)
    elapsed = time.perf_counter() - started
    assert result.completed == rows, result
    return rows / elapsed


async def direct_side(run, table: str, rows: int) -> float:
    await sheets.ensure_sheet(run.port, run.scope.play_scope, table, CONTRACT)
    started = time.perf_counter()
    done = 0
    for start in range(0, rows, DIRECT_BATCH):
        batch = [row(i) for i in range(start, min(rows, start + DIRECT_BATCH))]
        admission = await sheets.admit(run.port, run.ref, table, CONTRACT, batch,
                                       input_offset=start)
        outcomes = [sheets.RowOutcome(p.key, "completed", data=OUTPUT, input_index=p.input_index)
                    for p in admission.pending]
        completion = await sheets.complete(run.port, run.ref, table, CONTRACT, outcomes)
        done += len(completion.committed_keys)
    elapsed = time.perf_counter() - started
    assert done == rows, done
    return rows / elapsed


async def throughput(dsn: str, rows: int, rounds: int, concurrency: int) -> None:
    schema = f"bench_map_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            map_rates, direct_rates = [], []
            async with open_run(tenant, "bench") as run:
                for r in range(rounds):  # alternate the order so neither side always goes first
                    if r % 2 == 0:
                        direct_rates.append(await direct_side(run, f"direct_{r}", rows))
                        map_rates.append(await map_side(run, f"map_{r}", rows, concurrency))
                    else:
                        map_rates.append(await map_side(run, f"map_{r}", rows, concurrency))
                        direct_rates.append(await direct_side(run, f"direct_{r}", rows))
            m, d = statistics.median(map_rates), statistics.median(direct_rates)
            print(f"run.map (async iterable, no-op fn, concurrency {concurrency}): "
                  f"{m:,.0f} rows/s over {rows:,} rows (median of {rounds})")
            print(f"direct admit+complete ({DIRECT_BATCH:,}-row batches):           "
                  f"{d:,.0f} rows/s")
            print(f"ratio map/direct: {m / d:.2f} (target >= 0.70)")
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def rss_child(dsn: str, rows: int, concurrency: int) -> None:
    schema = f"bench_rss_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            started = time.perf_counter()
            async with open_run(tenant, "bench") as run:
                result = await run.map("rss", stream(rows), noop, contract=CONTRACT,
                                       concurrency=concurrency)
            elapsed = time.perf_counter() - started
            assert result.completed == rows, result
            peak_mb = peak_rss_mb()
            print(f"{peak_mb:.1f} {elapsed:.1f}")
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def timed_map(tenant, table: str, source, **options) -> float:
    """Seconds of one `run.map` call in a new run of its own (retirement not timed)."""
    async with open_run(tenant, "bench") as run:
        started = time.perf_counter()
        result = await run.map(table, source, noop, contract=CONTRACT, **options)
        elapsed = time.perf_counter() - started
    assert result.completed + result.cached == result.admitted, result
    return elapsed


def ratio_line(label: str, top: list[float], bottom: list[float], target: str) -> None:
    """The median of the rounds' ratios (each round's two sides ran back to back, so a swing
    in the machine's load between rounds cancels out), with each side's median time."""
    ratios = [a / b for a, b in zip(top, bottom)]
    a, b = statistics.median(top), statistics.median(bottom)
    shown = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"{label}: {statistics.median(ratios):.3f} (median of {len(ratios)} rounds' ratios"
          f" [{shown}]; medians {a:.3f} s / {b:.3f} s; target {target})")


async def with_schema(dsn: str, prefix: str, body) -> None:
    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            await body(tenant)
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def list_vs_stream(dsn: str, rows: int, rounds: int, concurrency: int) -> None:
    async def body(tenant) -> None:
        listed, streamed = [], []
        for r in range(rounds):
            sides = [("list", listed, lambda: [row(i) for i in range(rows)]),
                     ("stream", streamed, lambda: stream(rows))]
            for name, times, make in sides if r % 2 == 0 else reversed(sides):
                times.append(await timed_map(tenant, f"{name}_{r}", make(),
                                             concurrency=concurrency))
        ratio_line(f"first run of {rows:,} rows, list / async iterable", listed, streamed,
                   "<= 1.10")

    await with_schema(dsn, "bench_list", body)


async def rerun(dsn: str, rows: int, rounds: int, concurrency: int) -> None:
    async def body(tenant) -> None:
        firsts, reruns = [], []
        for r in range(rounds):
            source = [row(i) for i in range(rows)]
            firsts.append(await timed_map(tenant, f"rerun_{r}", source, concurrency=concurrency))
            reruns.append(await timed_map(tenant, f"rerun_{r}", source, concurrency=concurrency))
        ratio_line(f"rerun of an unchanged {rows:,}-row list / its first run", reruns, firsts,
                   "<= 0.15")

    await with_schema(dsn, "bench_rerun", body)


async def policies(dsn: str, rows: int, rounds: int, concurrency: int) -> None:
    async def body(tenant) -> None:
        plain, retrying = [], []
        for r in range(rounds):
            sides = [(plain, {}), (retrying, {"retry": RowRetry()})]
            for times, options in sides if r % 2 == 0 else reversed(sides):
                name = "retry" if options else "plain"
                times.append(await timed_map(tenant, f"{name}_{r}", stream(rows),
                                             concurrency=concurrency, **options))
        ratio_line(f"no-op map of {rows:,} streamed rows, with a retry policy that never fires"
                   " / without", retrying, plain, "<= 1.05")
        port = CountingPort(tenant)
        calls = 1500
        limit = RateLimit(500, key="bench-shared")
        started = time.perf_counter()
        await timed_map(port, "limited", stream(calls), concurrency=concurrency, rate_limit=limit)
        elapsed = time.perf_counter() - started
        leases = sum(1 for sql in port.statements if "rate_limits" in sql)
        print(f"shared rate limit at 500 calls/s: {leases} lease statements for {calls:,} calls"
              f" = {1000 * leases / calls:.1f} per 1,000 calls (target <= 20;"
              f" {calls / elapsed:,.0f} calls/s including the first burst)")

    await with_schema(dsn, "bench_policies", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rss-rows", type=int, default=1_000_000, help="0 skips the RSS run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--list-rows", type=int, default=100_000)
    parser.add_argument("--rerun-rows", default="10000,100000")
    parser.add_argument("--parts", default="throughput,rss,list,rerun,policies,analyzed")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dsn = args.dsn or bench_dsn()
    if args.rss_child:
        trio.run(rss_child, dsn, args.rss_rows, args.concurrency)
        return
    parts = set(args.parts.split(","))
    if "throughput" in parts:
        trio.run(throughput, dsn, args.rows, args.rounds, args.concurrency)
    if "list" in parts:
        trio.run(list_vs_stream, dsn, args.list_rows, args.rounds, args.concurrency)
    if "rerun" in parts:
        for rows in map(int, args.rerun_rows.split(",")):
            trio.run(rerun, dsn, rows, args.rounds, args.concurrency)
    if "policies" in parts:
        trio.run(policies, dsn, args.rows, args.rounds, args.concurrency)
    if "analyzed" in parts:
        ratios = [trio.run(analyzed.measure, dsn, args.rows) for _ in range(args.rounds)]
        analyzed.report(args.rows, args.rounds, [n for n, _ in ratios], [r for _, r in ratios])
    if "rss" in parts and args.rss_rows:
        child = subprocess.run(
            [sys.executable, __file__, "--rss-child", "--rss-rows", str(args.rss_rows),
             "--concurrency", str(args.concurrency), "--dsn", dsn],
            check=True, capture_output=True, text=True,
        )
        peak_mb, elapsed = map(float, child.stdout.split())
        print(f"peak RSS of run.map over {args.rss_rows:,} streamed rows: {peak_mb:.0f} MB "
              f"(target <= 300 MB; {args.rss_rows / elapsed:,.0f} rows/s)")


if __name__ == "__main__":
    main()
