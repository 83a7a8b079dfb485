"""The gateway against direct calls, on the same server in the same run.

    python benchmarks/gateway.py [--rows 50000] [--keys 2000] [--rounds 1] [--concurrency 16]

A gateway server runs in a child process on this machine (as `runplane serve` would), over
the same PostgreSQL and schema as the direct side.
1. `run.map` with a no-op function over `--rows` rows streamed from an async iterable, through
   the gateway vs direct, both in one run (the gateway side wakes the direct side's run id, so
   both write at the same epoch; each side writes its own sheet). Target ratio >= 0.8.
   The same map through the gateway with `db_sessions=True` (the gateway mints a
   database session and the map's admission, completion and pages go straight to PostgreSQL
   with it). Target ratio >= 0.9.
2. Receipts one key at a time: claim + complete of `--keys` keys through the gateway vs direct.
   Target ratio >= 0.3: each call through a gateway is one HTTP round trip (plus JSON on both
   ends) on top of the database round trip a direct call makes.
Both processes collect garbage as `runplane serve` and a runner's `runplane run` do
(`benchmarks/_hosting.py`; `RUNPLANE_BENCH_GC=default` for CPython's defaults).
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from _hosting import collect_as_hosting  # noqa: E402
from _rows import CONTRACT, OUTPUT, noop, stream  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant, receipts, sessions  # noqa: E402
from runplane.engine.gateway import mint_token, open_gateway, open_server  # noqa: E402

ORG, PLAY = "bench", "bench"
SECRET = "benchmark-gateway-secret-" + uuid.uuid4().hex


async def map_rate(port, run_id: str, table: str, rows: int, concurrency: int) -> float:
    async with open_run(port, PLAY, run_id, retire_on_exit=False) as run:
        started = time.perf_counter()
        result = await run.map(table, stream(rows, f"{table}-company"), noop, contract=CONTRACT,
                               concurrency=concurrency)
        elapsed = time.perf_counter() - started
    assert result.completed == rows, result
    return rows / elapsed


async def receipts_rate(port, run_id: str, keys: int, tag: str) -> float:
    async with open_run(port, PLAY, run_id, retire_on_exit=False) as run:
        started = time.perf_counter()
        for i in range(keys):
            key = f"{tag}-{i}"
            claim = await receipts.claim(port, run.ref, key)
            assert claim.disposition == "claimed", claim
            await receipts.complete(port, run.ref, key, OUTPUT)
        elapsed = time.perf_counter() - started
    return keys / elapsed


async def measure(dsn: str, url: str, schema: str, args: argparse.Namespace) -> None:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    token = mint_token(SECRET, ORG)
    map_ratios, direct_maps, gateway_maps = [], [], []
    session_ratios, session_maps = [], []
    direct_keys, gateway_keys = [], []
    async with open_tenant(ORG, dsn, schema=schema) as tenant:
        async with open_gateway(url, token) as gateway, \
                open_gateway(url, token, db_sessions=True) as fast:
            for r in range(args.rounds):  # alternate which side goes first
                sides = [("direct", tenant), ("gateway", gateway), ("sessions", fast)]
                if r % 2:
                    sides.reverse()
                rates = {}
                for name, port in sides:
                    rates[name] = await map_rate(port, run_id, f"{name}_{r}", args.rows,
                                                 args.concurrency)
                assert fast.db_sessions is not None and fast.db_sessions.disabled is None
                direct_maps.append(rates["direct"])
                gateway_maps.append(rates["gateway"])
                session_maps.append(rates["sessions"])
                map_ratios.append(rates["gateway"] / rates["direct"])
                session_ratios.append(rates["sessions"] / rates["direct"])
                for name, port in [side for side in sides if side[0] != "sessions"]:
                    rate = await receipts_rate(port, run_id, args.keys, f"{name}-{r}")
                    (direct_keys if name == "direct" else gateway_keys).append(rate)
        await sessions.drop_expired(tenant, include_unexpired=True)
    d, g = statistics.median(direct_maps), statistics.median(gateway_maps)
    print(f"run.map direct:  {d:,.0f} rows/s over {args.rows:,} rows (median of {args.rounds})")
    print(f"run.map gateway: {g:,.0f} rows/s")
    print(f"ratio gateway/direct (map): {statistics.median(map_ratios):.2f} (target >= 0.80)")
    print(f"run.map gateway + db sessions: {statistics.median(session_maps):,.0f} rows/s")
    print(f"ratio db sessions/direct (map): {statistics.median(session_ratios):.2f} (target >= 0.90)")
    dk, gk = statistics.median(direct_keys), statistics.median(gateway_keys)
    print(f"claim+complete direct:  {dk:,.0f} keys/s; gateway: {gk:,.0f} keys/s")
    print(f"ratio gateway/direct (claim+complete, one key at a time): {gk / dk:.2f} "
          "(target >= 0.30)")


async def serve_child(dsn: str, schema: str) -> None:
    async with open_server(secret=SECRET, dsn=dsn, schema=schema) as server:
        print(server.url, flush=True)
        await trio.sleep_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--keys", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--serve-child", default=None, metavar="SCHEMA", help=argparse.SUPPRESS)
    args = parser.parse_args()
    collector_line = collect_as_hosting()  # the child as `runplane serve`, this side as a runner
    dsn = args.dsn or bench_dsn()
    if args.serve_child:
        global SECRET
        SECRET = os.environ["RUNPLANE_GATEWAY_SECRET"]
        trio.run(serve_child, dsn, args.serve_child)
        return
    print(collector_line, flush=True)
    with_gateway_child(dsn, "bench_gw", measure, args)


def with_gateway_child(dsn: str, prefix: str, measure, *args) -> None:
    """`trio.run(measure, dsn, url, schema, *args)` against a gateway in a child process (as
    `runplane serve`) on a new schema named from `prefix`, dropped afterwards."""
    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-child", schema, "--dsn", dsn],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "RUNPLANE_GATEWAY_SECRET": SECRET},
    )
    try:
        url = child.stdout.readline().strip()
        if not url:
            raise SystemExit("the gateway child did not start")
        trio.run(measure, dsn, url, schema, *args)
    finally:
        child.terminate()
        child.wait(timeout=30)
        trio.run(drop_schema, dsn, schema)


async def drop_schema(dsn: str, schema: str) -> None:
    async with open_tenant(ORG, dsn, schema=schema) as tenant:
        async with tenant.connection("sheet") as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


if __name__ == "__main__":
    main()
