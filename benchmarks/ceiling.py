"""Throughput at the physical limit: `run.map` against the raw ceiling of a durable map, in one run.

    python benchmarks/ceiling.py [--rows 1000000] [--rounds 3] [--quick] [--parts ...]

Every figure is measured on the same server in the same run; the ratios are the claim.
1. ceiling — the raw ceiling of a durable map, no engine: on one connection, per 10,000 rows, a
   binary COPY of the admitted rows (SHA-256 key, canonical JSON inputs; built before the clock
   starts) into a table shaped like a sheet, then one fenced
   `UPDATE … FROM unnest … WHERE _write_version = $v` of their completions. Against it `run.map` of a no-op function over the same rows from an async
   iterable (target >= 0.5 of the ceiling's rows/s), and the first run of a list against an
   async iterable over `--list-rows` rows (target list/stream <= 1.05).
2. io — `--io-rows` rows whose function awaits 5 ms, 64 at a time, against the physical limit
   rows x 5 ms / 64 (target <= 1.2 x).
3. rerun — an unchanged rerun of a 10,000-row list, the `run.map` call alone (target <= 20 ms).
4. rss — peak RSS of a child process mapping a `--rss-rows`-row list, the list included
   (target <= 300 MB).
5. gateway — a gateway server in a child process (`benchmarks/gateway.py --serve-child`):
   `run.map` over `--gateway-rows` rows through it against direct (target >= 0.8), and
   claim + complete of `--keys` keys one at a time through it against direct (target >= 0.3).
Each figure is the median of `--rounds` rounds; the two sides of a ratio run back to back,
alternating which goes first. `--quick` shrinks the sizes so a whole run takes a few minutes
(100,000 rows for the ceiling, 200,000 for the RSS child); the figures in docs/guide/benchmarks.md use the
defaults.
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402  (the HTTP floor only)
import trio  # noqa: E402

from _server import bench_dsn  # noqa: E402
import gateway as gateway_bench  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant, sheets  # noqa: E402
from runplane.engine.gateway import mint_token, open_gateway, protocol  # noqa: E402

CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("ok",))
OUTPUT = {"ok": True}
CHUNK = 10_000
IO_DELAY, IO_CONCURRENCY = 0.005, 64
RESULTS: list[tuple[str, str, bool]] = []


def row(i: int) -> dict:
    return {"name": f"company-{i}", "n": i}


async def stream(rows: int):
    for i in range(rows):
        yield row(i)


async def noop(_row: dict) -> dict:
    return OUTPUT


async def io_bound(_row: dict) -> dict:
    await trio.sleep(IO_DELAY)
    return OUTPUT


def target(name: str, figure: str, met: bool) -> None:
    RESULTS.append((name, figure, met))
    print(f"  {name}: {figure} -> {'met' if met else 'NOT met'}", flush=True)


def median_ratio(top: list[float], bottom: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(top, bottom))


# -- the raw ceiling ---------------------------------------------------------------------------
_RAW_TABLE = """
CREATE TABLE {t} (
    _key text PRIMARY KEY, _status text NOT NULL DEFAULT 'pending', _run_id text,
    _write_version bigint NOT NULL, _input_index bigint,
    _cell_meta jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    _created_at timestamptz NOT NULL DEFAULT now(), _updated_at timestamptz NOT NULL DEFAULT now(),
    name jsonb, n jsonb, ok jsonb
) WITH (fillfactor = 70)"""
_RAW_INDEX = "CREATE INDEX ON {t} (_input_index, _created_at, _key)"
_RAW_COMPLETE = """
UPDATE {t} AS s SET _status = 'completed', ok = u.ok, _updated_at = now()
  FROM unnest($1::text[], $2::jsonb[]) AS u(k, ok)
 WHERE s._key = u.k AND s._write_version = $3 AND s._status = 'pending'"""
_COLUMNS = ("_key", "_run_id", "_write_version", "_input_index", "name", "n")


async def copy_records(conn, table: str, records: list[tuple], *, columns, schema: str):
    """Binary COPY of `records` into `schema.table` through the adapter's statement path (the
    engine itself writes with INSERT … unnest; COPY is the raw ceiling's)."""
    return await conn._statement(f"COPY {schema}.{table}", "copy_records_to_table", table,
                                 records=records, columns=list(columns), schema_name=schema)


def raw_records(start: int, stop: int) -> list[tuple]:
    """The admitted rows of the ceiling: each row's SHA-256 key of its canonical JSON, and its
    inputs as canonical JSON text (built before the clock starts)."""
    records = []
    for i in range(start, stop):
        r = row(i)
        key = hashlib.sha256(_dumps(r).encode()).hexdigest()
        records.append((key, "raw", 1, i, _dumps(r["name"]), _dumps(r["n"])))
    return records


_dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode


async def ceiling_side(tenant, schema: str, table: str, rows: int) -> float:
    """Rows/s of the raw durable map on one connection: per 10,000-row chunk a binary COPY of
    the admitted rows and one fenced unnest UPDATE of their completions. The rows are built
    before the clock starts, so the figure is the database's alone."""
    qualified = f'"{schema}"."{table}"'
    chunks = [raw_records(start, min(rows, start + CHUNK)) for start in range(0, rows, CHUNK)]
    output = _dumps(OUTPUT)
    async with tenant.connection("sheet") as conn:
        await conn.execute(_RAW_TABLE.format(t=qualified))
        await conn.execute(_RAW_INDEX.format(t=qualified))
        complete = _RAW_COMPLETE.format(t=qualified)
        started = time.perf_counter()
        done = 0
        for records in chunks:
            await copy_records(conn, table, records, columns=_COLUMNS, schema=schema)
            status = await conn.execute(complete, [r[0] for r in records],
                                        [output] * len(records), 1)
            done += int(status.split()[-1])
        elapsed = time.perf_counter() - started
    assert done == rows, done
    return rows / elapsed


async def map_seconds(tenant, table: str, source, fn=noop, **options) -> float:
    """Seconds of one `run.map` call in a new run of its own (registration, retirement not
    timed)."""
    async with open_run(tenant, "bench") as run:
        started = time.perf_counter()
        result = await run.map(table, source, fn, contract=CONTRACT, **options)
        elapsed = time.perf_counter() - started
    assert result.completed + result.cached == result.admitted, result
    return elapsed


async def ceiling(tenant, schema: str, args) -> None:
    raw_rates, map_rates = [], []
    for r in range(args.rounds):
        sides = ["raw", "map"] if r % 2 == 0 else ["map", "raw"]
        for side in sides:
            if side == "raw":
                raw_rates.append(await ceiling_side(tenant, schema, f"raw_{r}", args.rows))
            else:
                seconds = await map_seconds(tenant, f"streamed_{r}", stream(args.rows),
                                            concurrency=args.concurrency)
                map_rates.append(args.rows / seconds)
    c, m = statistics.median(raw_rates), statistics.median(map_rates)
    print(f"raw ceiling (COPY + fenced unnest UPDATE per {CHUNK:,}): {c:,.0f} rows/s over "
          f"{args.rows:,} rows")
    print(f"run.map, async iterable, no-op:                  {m:,.0f} rows/s")
    ratio = median_ratio(map_rates, raw_rates)
    target("streamed no-op map / raw ceiling", f"{ratio:.2f} (>= 0.50)", ratio >= 0.5)

    listed, streamed = [], []
    for r in range(args.rounds):
        sides = [("list", listed, lambda: [row(i) for i in range(args.list_rows)]),
                 ("stream", streamed, lambda: stream(args.list_rows))]
        for name, times, make in sides if r % 2 == 0 else reversed(sides):
            times.append(await map_seconds(tenant, f"{name}_{r}", make(),
                                           concurrency=args.concurrency))
    print(f"first run of {args.list_rows:,} rows: list {statistics.median(listed):.2f} s, "
          f"async iterable {statistics.median(streamed):.2f} s")
    ratio = median_ratio(listed, streamed)
    target("list / async iterable (first run)", f"{ratio:.3f} (<= 1.05)", ratio <= 1.05)


async def bare_trio_seconds(rows: int) -> float:
    """The same awaits with no engine: `IO_CONCURRENCY` trio tasks taking rows from a channel,
    each awaiting `IO_DELAY` (what this machine's scheduler allows at this moment)."""
    send, recv = trio.open_memory_channel(2 * IO_CONCURRENCY)

    async def worker(recv) -> None:
        async with recv:
            async for _ in recv:
                await trio.sleep(IO_DELAY)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        async with recv:
            for _ in range(IO_CONCURRENCY):
                nursery.start_soon(worker, recv.clone())
        async with send:
            for i in range(rows):
                await send.send(i)
    return time.perf_counter() - started


async def io(tenant, schema: str, args) -> None:
    limit = args.io_rows * IO_DELAY / IO_CONCURRENCY
    times, bare = [], []
    for r in range(args.rounds):
        times.append(await map_seconds(tenant, f"io_{r}", stream(args.io_rows), io_bound,
                                       concurrency=IO_CONCURRENCY))
        bare.append(await bare_trio_seconds(args.io_rows))
    t = statistics.median(times)
    print(f"{args.io_rows:,} rows awaiting {IO_DELAY * 1000:.0f} ms, {IO_CONCURRENCY} at a time: "
          f"{t:.2f} s; physical limit {limit:.2f} s; bare trio tasks, no engine, "
          f"{statistics.median(bare):.2f} s (map / bare {median_ratio(times, bare):.2f})")
    target("I/O-bound map / physical limit", f"{t / limit:.2f} x (<= 1.2)", t / limit <= 1.2)


async def rerun(tenant, schema: str, args) -> None:
    times = []
    for r in range(args.rounds):
        source = [row(i) for i in range(args.rerun_rows)]
        await map_seconds(tenant, f"rerun_{r}", source, concurrency=args.concurrency)
        times.append(await map_seconds(tenant, f"rerun_{r}", source,
                                       concurrency=args.concurrency))
    ms = statistics.median(times) * 1000
    target(f"unchanged rerun of {args.rerun_rows:,} rows", f"{ms:.1f} ms (<= 20 ms)", ms <= 20)


def resident_mb() -> float:
    """The process's resident set now (VmRSS), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def rss_child(dsn: str, rows: int, concurrency: int) -> None:
    schema = f"bench_ceiling_rss_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            source = [row(i) for i in range(rows)]
            listed_mb = resident_mb()
            started = time.perf_counter()
            elapsed = await map_seconds(tenant, "rss", source, concurrency=concurrency)
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"{peak_mb:.1f} {listed_mb:.1f} {elapsed:.2f}")
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def rss(dsn: str, args) -> None:
    child = subprocess.run(
        [sys.executable, __file__, "--rss-child", "--rss-rows", str(args.rss_rows),
         "--concurrency", str(args.concurrency), "--dsn", dsn],
        check=True, capture_output=True, text=True,
    )
    peak_mb, listed_mb, elapsed = map(float, child.stdout.split())
    print(f"list map of {args.rss_rows:,} rows: {args.rss_rows / elapsed:,.0f} rows/s; the "
          f"process held {listed_mb:.0f} MB with the list built, before the map "
          f"(the peak is {peak_mb - listed_mb:.0f} MB above that)")
    target(f"peak RSS of a {args.rss_rows:,}-row list map", f"{peak_mb:.0f} MB (<= 300 MB)",
           peak_mb <= 300)


async def through_gateway(dsn: str, url: str, schema: str, args) -> None:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    token = mint_token(gateway_bench.SECRET, gateway_bench.ORG)
    maps = {"direct": [], "gateway": []}
    keys = {"direct": [], "gateway": []}
    async with httpx.AsyncClient() as client:  # the HTTP floor: a health check per round trip
        started = time.perf_counter()
        for _ in range(args.keys):
            (await client.get(url + protocol.HEALTH_PATH)).raise_for_status()
        health_ms = (time.perf_counter() - started) * 1000 / args.keys
    async with open_tenant(gateway_bench.ORG, dsn, schema=schema) as tenant:
        async with open_gateway(url, token) as gateway:
            for r in range(args.rounds):
                sides = [("direct", tenant), ("gateway", gateway)]
                for name, port in sides if r % 2 == 0 else reversed(sides):
                    maps[name].append(await gateway_bench.map_rate(
                        port, run_id, f"{name}_{r}", args.gateway_rows, args.concurrency))
                    keys[name].append(await gateway_bench.receipts_rate(
                        port, run_id, args.keys, f"{name}-{r}"))
    print(f"run.map over {args.gateway_rows:,} rows: direct "
          f"{statistics.median(maps['direct']):,.0f} rows/s, gateway "
          f"{statistics.median(maps['gateway']):,.0f} rows/s")
    ratio = median_ratio(maps["gateway"], maps["direct"])
    target("run.map gateway / direct", f"{ratio:.2f} (>= 0.8)", ratio >= 0.8)
    print(f"claim+complete of {args.keys:,} keys: direct {statistics.median(keys['direct']):,.0f}"
          f" keys/s, gateway {statistics.median(keys['gateway']):,.0f} keys/s")
    print(f"one HTTP round trip to the gateway's health check (no action, no database): "
          f"{health_ms:.2f} ms; claim+complete direct takes "
          f"{1000 / statistics.median(keys['direct']):.2f} ms a key")
    ratio = median_ratio(keys["gateway"], keys["direct"])
    target("claim+complete gateway / direct", f"{ratio:.2f} (>= 0.3)", ratio >= 0.3)


def gateway_part(dsn: str, args) -> None:
    schema = f"bench_ceiling_gw_{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, gateway_bench.__file__, "--serve-child", schema, "--dsn", dsn],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "RUNPLANE_GATEWAY_SECRET": gateway_bench.SECRET},
    )
    try:
        url = child.stdout.readline().strip()
        if not url:
            raise SystemExit("the gateway child did not start")
        trio.run(through_gateway, dsn, url, schema, args)
    finally:
        child.terminate()
        child.wait(timeout=30)
        trio.run(gateway_bench.drop_schema, dsn, schema)


async def in_schema(dsn: str, part, args) -> None:
    schema = f"bench_ceiling_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            await part(tenant, schema, args)
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--list-rows", type=int, default=100_000)
    parser.add_argument("--io-rows", type=int, default=10_000)
    parser.add_argument("--rerun-rows", type=int, default=10_000)
    parser.add_argument("--rss-rows", type=int, default=1_000_000, help="0 skips the RSS run")
    parser.add_argument("--gateway-rows", type=int, default=50_000)
    parser.add_argument("--keys", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--quick", action="store_true",
                        help="100,000 ceiling rows, 200,000 RSS rows, 20,000 gateway rows, "
                             "1,000 keys")
    parser.add_argument("--parts", default="ceiling,io,rerun,rss,gateway")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rss_rows = 100_000, 200_000
        args.gateway_rows, args.keys = 20_000, 1_000
    dsn = args.dsn or bench_dsn()
    if args.rss_child:
        trio.run(rss_child, dsn, args.rss_rows, args.concurrency)
        return
    parts = args.parts.split(",")
    for part in parts:
        print(f"-- {part}", flush=True)
        if part in ("ceiling", "io", "rerun"):
            trio.run(in_schema, dsn, globals()[part], args)
        elif part == "rss" and args.rss_rows:
            rss(dsn, args)
        elif part == "gateway":
            gateway_part(dsn, args)
    met = sum(1 for _, _, ok in RESULTS if ok)
    print(f"targets met: {met} of {len(RESULTS)}")
    for name, figure, ok in RESULTS:
        print(f"  {'met    ' if ok else 'NOT met'}  {name}: {figure}")


if __name__ == "__main__":
    main()
