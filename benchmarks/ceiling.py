"""Throughput at the physical limit: `run.map` against the raw ceiling of a durable map, in one run.

    python benchmarks/ceiling.py [--rows 1000000] [--rounds 3] [--quick] [--parts ...]

Every figure is measured on the same server in the same run; the ratios are the claim.
1. ceiling — the raw ceilings of a durable map, no engine (`benchmarks/_ceilings.py`): on one
   connection, per 10,000 rows, a binary COPY of the admitted rows (built before the clock
   starts) then one fenced `UPDATE … FROM unnest … WHERE version = $v` of their completions,
   into a table shaped like a sheet and into a minimal five-column table. Against them
   `run.map` of a no-op function over the same rows from an async iterable (targets >= 0.8 of
   the sheet-shaped ceiling's rows/s, >= 0.5 of the minimal one's). A raw side's rows live for
   its own call only, so the map runs in a process that holds what a user's streamed map does
   (with 300,000 such rows kept alive beside it, the map spent ~1 µs more CPU a row).
2. lists — the first run of a list against an async iterable, `open_run` to its exit (a list's
   staging, its recording for reruns and retirement included), at each of `--list-rows`,
   median of `--list-rounds` (target list/stream <= 1.05); beside it the floor, the list's
   staging alone (its pages put, sealed, read back and verified, as SPEC §6 asks), and the
   list against the iterable plus that floor (the same target past the floor: a list's
   durable input costs that much by itself, on the same cores). And, no target, new rows into
   a sheet that holds as many against the first run into the empty sheet.
3. io — `--io-rows` rows whose function awaits 5 ms, 64 at a time, against bare trio tasks doing
   the same awaits with no engine (target <= 1.1 x), and the physical limit rows x 5 ms / 64.
4. rerun — an unchanged rerun of a 10,000-row list, the `run.map` call alone (target <= 6 ms).
5. rss — peak RSS of a child process mapping a `--rss-rows`-row list above what it held with
   the list built (target <= 50 MB).
6. gateway — a gateway server in a child process (`benchmarks/gateway.py --serve-child`):
   `run.map` over `--gateway-rows` rows through it against direct (target >= 0.8), and
   claim + complete of `--keys` keys one at a time through it against direct (target >= 0.3),
   beside the HTTP floor of the same client and server: a round trip the gateway refuses
   before any query, and the ratio two such round trips a key would allow.
Each figure is the median of `--rounds` rounds; the two sides of a ratio run back to back,
alternating which goes first. Between parts the server settles (a checkpoint, then a wait while
autovacuum works on what the part before wrote), so a part is not measured against the last
one's clean-up; and each part runs in a process of its own (`--part-child`: this command's
arguments, the same server), as `runplane run` starts one, so none is measured in the heap
the parts before it left (a 10,000-row rerun read 4.7–6.8 ms after another part in one
process, 3.6–3.9 ms in its own: a new list's digest took 1.5–3 times as long there).
`--quick` shrinks the sizes so a whole run takes a few minutes (100,000 rows for the ceiling,
200,000 for the RSS child, 10,000 for lists); the figures in docs/guide/benchmarks.md use the
defaults.
Its processes (this one, the RSS child, the gateway child) collect garbage as `runplane run`
and `runplane serve` do (`benchmarks/_hosting.py`; `RUNPLANE_BENCH_GC=default` for CPython's).
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg  # noqa: E402  (settling the server between parts only)
import trio  # noqa: E402

from _hosting import collect_as_hosting  # noqa: E402
from _memory import peak_rss_mb  # noqa: E402
from _rows import CONTRACT, OUTPUT, noop, row, stream  # noqa: E402
from _server import bench_dsn  # noqa: E402
import _ceilings as ceilings  # noqa: E402
import gateway as gateway_bench  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.actors.sealer import stage_encoded  # noqa: E402
from runplane.engine import RunScope, array_input, open_tenant, runs  # noqa: E402
from runplane.engine.errors import ScopeError  # noqa: E402
from runplane.engine.runs.cancel import cancel_requested  # noqa: E402
from runplane.engine.gateway import mint_token, open_gateway  # noqa: E402

IO_DELAY, IO_CONCURRENCY = 0.005, 64
RESULTS: list[tuple[str, str, bool]] = []


async def io_bound(_row: dict) -> dict:
    await trio.sleep(IO_DELAY)
    return OUTPUT


def process_cpu_seconds() -> float:
    """This process's CPU time so far (user and system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def target(name: str, figure: str, met: bool) -> None:
    RESULTS.append((name, figure, met))
    print(f"  {name}: {figure} -> {'met' if met else 'NOT met'}", flush=True)


def median_ratio(top: list[float], bottom: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(top, bottom))


async def map_seconds(tenant, table: str, source, fn=noop, *, whole: bool = False,
                      **options) -> float:
    """Seconds of one `run.map` call in a new run of its own; with `whole`, from `open_run` to
    its exit (registration, recording a list for reruns, retirement: what a user waits for)."""
    started = time.perf_counter()
    async with open_run(tenant, "bench") as run:
        if not whole:
            started = time.perf_counter()
        result = await run.map(table, source, fn, contract=CONTRACT, **options)
        elapsed = time.perf_counter() - started
    if whole:
        elapsed = time.perf_counter() - started
    assert result.completed + result.cached == result.admitted, result
    return elapsed


async def ceiling(tenant, schema: str, args) -> None:
    rates = {"sheet": [], "minimal": [], "map": []}
    cpu_us = []  # this process's CPU a row during each map
    for r in range(args.rounds):
        sides = ["sheet", "minimal", "map"]
        for side in sides if r % 2 == 0 else reversed(sides):
            if side == "map":
                cpu = process_cpu_seconds()
                seconds = await map_seconds(tenant, f"streamed_{r}", stream(args.rows),
                                            concurrency=args.concurrency)
                cpu_us.append((process_cpu_seconds() - cpu) * 1e6 / args.rows)
                rates["map"].append(args.rows / seconds)
            else:  # its rows live for its call only: the map's process holds what a user's does
                rates[side].append(await ceilings.ceiling_rate(
                    tenant, schema, f"raw_{side}_{r}", [row(i) for i in range(args.rows)],
                    minimal=side == "minimal"))
    c, mc, m = (statistics.median(rates[k]) for k in ("sheet", "minimal", "map"))
    print(f"sheet-shaped raw ceiling (COPY + fenced unnest UPDATE per {ceilings.CHUNK:,}): "
          f"{c:,.0f} rows/s over {args.rows:,} rows")
    print(f"minimal raw ceiling (five columns, same statements): {mc:,.0f} rows/s")
    print(f"run.map, async iterable, no-op:                      {m:,.0f} rows/s")
    us = statistics.median(cpu_us)
    print(f"  the map's own process (the engine in Python, and the stream's rows): {us:.1f} µs of "
          f"CPU a row, so at most {1e6 / us:,.0f} rows/s on its one core; it ran at "
          f"{median_ratio(rates['map'], [1e6 / u for u in cpu_us]):.2f} of that (the raw "
          f"ceilings spend no client CPU: their rows are built before the clock)")
    ratio = median_ratio(rates["map"], rates["sheet"])
    target("streamed no-op map / sheet-shaped ceiling", f"{ratio:.2f} (>= 0.80)", ratio >= 0.8)
    ratio = median_ratio(rates["map"], rates["minimal"])
    target("streamed no-op map / minimal ceiling", f"{ratio:.2f} (>= 0.50)", ratio >= 0.5)


async def staging_seconds(tenant, size: int) -> float:
    """Seconds to stage a list of `size` rows alone, as a list map must (SPEC §6: encoded,
    its pages put and sealed, every page read back and verified), in a run of its own; the
    run's staged facts are retired after the clock stops. The encoding is not timed: a list map
    encodes its rows once for staging and admission alike, as a stream's admission does."""
    run = await runs.register(tenant, RunScope(tenant.org_id, "bench", f"stage-{uuid.uuid4()}"))
    encoded = array_input.encode_source([row(i) for i in range(size)])
    started = time.perf_counter()
    await stage_encoded(tenant, run.scope.map("staged", "map-0"), encoded)
    elapsed = time.perf_counter() - started
    while not (await array_input.retire(tenant, run.scope)).done:
        pass
    return elapsed


async def lists(tenant, schema: str, args) -> None:
    """List / async iterable, first runs, `open_run` to its exit, at each of `--list-rows`;
    beside them the list's staging alone (the work a list's durable input adds)."""
    for size in (int(n) for n in args.list_rows.split(",")):
        listed, streamed, staged = [], [], []
        for r in range(args.list_rounds):
            sides = [("list", listed, lambda: [row(i) for i in range(size)]),
                     ("stream", streamed, lambda: stream(size))]
            for name, times, make in sides if r % 2 == 0 else reversed(sides):
                times.append(await map_seconds(tenant, f"{name}_{size}_{r}", make(), whole=True,
                                               concurrency=args.concurrency))
            staged.append(await staging_seconds(tenant, size))
        print(f"first run of {size:,} rows, open_run to its exit: list "
              f"{statistics.median(listed):.2f} s, async iterable "
              f"{statistics.median(streamed):.2f} s; staging the list alone "
              f"{statistics.median(staged):.3f} s")
        ratio = median_ratio(listed, streamed)
        target(f"list / async iterable, {size:,} rows (first run, whole run)",
               f"{ratio:.3f} (<= 1.05)", ratio <= 1.05)
        with_staging = [b + c for b, c in zip(streamed, staged)]
        floor, past = median_ratio(with_staging, streamed), median_ratio(listed, with_staging)
        print(f"  the floor: a list's staging (SPEC §6) alone is {floor:.3f} of the async "
              f"iterable's time")
        target(f"list / (async iterable + staging alone), {size:,} rows (the target past "
               f"the floor)", f"{past:.3f} (<= 1.05)", past <= 1.05)
        await appended(tenant, size, args)


async def appended(tenant, size: int, args) -> None:
    """New rows into a sheet that holds as many (a day's rows appended to a sheet of
    yesterday's) against the first run into the empty sheet, lists, `open_run` to its exit
    (no target: what a sheet's existing rows cost a run of new ones; its probe of a hundred
    leading rows finds them new, `actors.admission.probe_unencoded`)."""
    firsts, seconds = [], []
    for r in range(args.list_rounds):
        table = f"appended_{size}_{r}"
        firsts.append(await map_seconds(tenant, table, [row(i) for i in range(size)],
                                        whole=True, concurrency=args.concurrency))
        seconds.append(await map_seconds(tenant, table, [row(i) for i in range(size, 2 * size)],
                                         whole=True, concurrency=args.concurrency))
    print(f"  {size:,} new rows into a sheet of as many / into the empty sheet (lists, whole "
          f"run): {median_ratio(seconds, firsts):.3f} ({statistics.median(seconds):.3f} s "
          f"against {statistics.median(firsts):.3f} s)")


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
    ratio = median_ratio(times, bare)
    target("I/O-bound map / bare trio tasks", f"{ratio:.2f} x (<= 1.1)", ratio <= 1.1)


async def rerun(tenant, schema: str, args) -> None:
    times = []
    for r in range(args.rounds):
        source = [row(i) for i in range(args.rerun_rows)]
        await map_seconds(tenant, f"rerun_{r}", source, concurrency=args.concurrency)
        times.append(await map_seconds(tenant, f"rerun_{r}", source,
                                       concurrency=args.concurrency))
    ms = statistics.median(times) * 1000
    target(f"unchanged rerun of {args.rerun_rows:,} rows", f"{ms:.1f} ms (<= 6 ms)", ms <= 6)


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
            elapsed = await map_seconds(tenant, "rss", source, concurrency=concurrency)
            peak_mb = peak_rss_mb()
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
    above = peak_mb - listed_mb
    target(f"peak RSS of a {args.rss_rows:,}-row list map above its input",
           f"{above:.0f} MB (<= 50 MB; {peak_mb:.0f} MB with the list)", above <= 50)


async def through_gateway(dsn: str, url: str, schema: str, args) -> None:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    token = mint_token(gateway_bench.SECRET, gateway_bench.ORG)
    maps = {"direct": [], "gateway": []}
    keys = {"direct": [], "gateway": []}
    # The HTTP floor, through the same client and the same lean handler: a request the gateway
    # refuses before any query or body read (its action is outside the token's actions claim).
    narrow = mint_token(gateway_bench.SECRET, gateway_bench.ORG, actions=("receipts.claim",))
    async with open_gateway(url, narrow) as refused:
        started = time.perf_counter()
        for _ in range(args.keys):
            try:
                await cancel_requested(refused, RunScope(gateway_bench.ORG, "bench", run_id))
            except ScopeError:
                pass
        floor_ms = (time.perf_counter() - started) * 1000 / args.keys
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
    direct_ms = 1000 / statistics.median(keys["direct"])
    print(f"one HTTP round trip refused before any query (the client and the gateway's HTTP "
          f"floor): {floor_ms:.2f} ms; claim+complete direct takes {direct_ms:.2f} ms a key, "
          f"so two such round trips a key allow at most "
          f"{direct_ms / (direct_ms + 2 * floor_ms):.2f}")
    ratio = median_ratio(keys["gateway"], keys["direct"])
    target("claim+complete gateway / direct", f"{ratio:.2f} (>= 0.3)", ratio >= 0.3)


def gateway_part(dsn: str, args) -> None:
    gateway_bench.with_gateway_child(dsn, "bench_ceiling_gw", through_gateway, args)


async def settle(dsn: str, limit_s: float = 60.0) -> None:
    """Let the server finish what the part before left it (its dropped tables' WAL, autovacuum
    of what it wrote) before the next part's clock starts: a checkpoint, then a wait while an
    autovacuum worker runs (at most `limit_s`). A login that may not checkpoint skips it.
    Plain asyncpg on asyncio, between the parts' trio runs."""
    conn = await asyncpg.connect(dsn)
    try:
        try:
            await conn.execute("CHECKPOINT")
        except asyncpg.PostgresError:  # neither a superuser nor in pg_checkpoint
            pass
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"):
            await asyncio.sleep(0.5)
    finally:
        await conn.close()


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
    parser.add_argument("--list-rows", default="10000,100000", help="sizes, comma-separated")
    parser.add_argument("--list-rounds", type=int, default=5)
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
    parser.add_argument("--parts", default="ceiling,lists,io,rerun,rss,gateway")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rss_rows = 100_000, 200_000
        args.gateway_rows, args.keys = 20_000, 1_000
        args.list_rows = "10000"
    collector_line = collect_as_hosting()  # the part, RSS and gateway children do too
    dsn = args.dsn or bench_dsn()
    if args.rss_child:
        trio.run(rss_child, dsn, args.rss_rows, args.concurrency)
        return
    if args.part_child:
        run_part(dsn, args.part_child, args)
        for result in RESULTS:
            print(RESULT_MARK + json.dumps(result), flush=True)
        return
    print(collector_line, flush=True)
    parts = args.parts.split(",")
    for i, part in enumerate(parts):
        if i:
            asyncio.run(settle(dsn))
        print(f"-- {part}", flush=True)
        in_own_process(dsn, part)
    met = sum(1 for _, _, ok in RESULTS if ok)
    print(f"targets met: {met} of {len(RESULTS)}")
    for name, figure, ok in RESULTS:
        print(f"  {'met    ' if ok else 'NOT met'}  {name}: {figure}")


RESULT_MARK = "@target "


def run_part(dsn: str, part: str, args) -> None:
    """One part, in this process."""
    if part in ("ceiling", "lists", "io", "rerun"):
        trio.run(in_schema, dsn, globals()[part], args)
    elif part == "rss" and args.rss_rows:
        rss(dsn, args)
    elif part == "gateway":
        gateway_part(dsn, args)
    else:
        raise SystemExit(f"unknown part {part!r}")


def in_own_process(dsn: str, part: str) -> None:
    """Run one part in a child process of its own (this command's arguments, on the same
    server), its lines printed as they come and its targets added to this run's."""
    command = [sys.executable, __file__, *sys.argv[1:], "--part-child", part, "--dsn", dsn]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(RESULT_MARK):
                RESULTS.append(tuple(json.loads(line[len(RESULT_MARK):])))
            else:
                print(line, end="", flush=True)
    if child.returncode:
        raise SystemExit(f"the {part} part failed (exit {child.returncode})")


if __name__ == "__main__":
    main()
