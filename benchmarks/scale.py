"""Shared maps on this machine: workers=2 against one process, and the lease statements.

    python benchmarks/scale.py [--cpu-rows 20000] [--noop-rows 100000]
                               [--parts capacity,cpu,noop,leases]

0. Capacity: the machine's own parallelism just then — the same pure-Python work (about 4 s)
   in one process, then in two processes at once; prints the ratio (2.0 on two idle cores).
   The machine is shared, so the CPU-bound ratio below can only be read against it.
1. CPU-bound (`--cpu-rows`, default 20,000): a function holding the core for about 2 ms of
   pure Python a row (`benchmarks/scale_play.py`), mapped by one process (`run.map` in this
   process) against two `runplane worker` processes (`run.map(..., shared=True)`, the workers
   started before the clock). Prints the speed-up one/two (target >= 1.7 on 2 cores).
2. No-op (`--noop-rows`, default 100,000): the same comparison with a function that does
   nothing, timed from publishing to the result (target >= 0.9: coordination costs little).
3. Lease statements: a no-op shared map of `--lease-rows` (default 20,000) rows served by two
   in-process workers behind a counting port; prints claims, renewals, progress batches (each
   unit's settled rows, counters and done mark, in the transaction of a batch of completions)
   and the lease checks in each claim's admission per 1,000 rows (target <= 5), and the
   heartbeats and polls beside them.
Each part maps into a fresh schema; the server is `RUNPLANE_BENCH_DSN`, else
`RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).parent))

from _server import bench_dsn  # noqa: E402
from scale_play import PLAY, burn, noop  # noqa: E402

from runplane.actors import open_run  # noqa: E402
from runplane.actors.shared.worker import WorkerOptions, serve_play  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402
from runplane.engine.sheets import SheetContract  # noqa: E402
from runplane.simulations.ports import CountingPort  # noqa: E402

PLAY_FILE = str(Path(__file__).parent / "scale_play.py")
CPU = SheetContract(("n",), ("burn",))
NOOP = SheetContract(("n",), ("ok",))


def rows(n: int) -> list[dict]:
    return [{"n": i} for i in range(n)]


async def one_process(tenant, table: str, fn, contract, n: int) -> float:
    source = rows(n)
    async with open_run(tenant, PLAY) as run:
        started = time.perf_counter()
        result = await run.map(table, source, fn, contract=contract, concurrency=16)
        elapsed = time.perf_counter() - started
    assert result.completed == n, result
    return elapsed


async def two_workers(tenant, dsn: str, table: str, fn, contract, n: int) -> float:
    env = {**os.environ, "RUNPLANE_DSN": dsn, "RUNPLANE_SCHEMA": tenant.schema,
           "RUNPLANE_ORG": tenant.org_id}
    command = [sys.executable, "-m", "runplane.cli", "worker", PLAY_FILE, "--exit-when-idle",
               "--concurrency", "16"]
    workers = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL) for _ in range(2)]
    try:
        await trio.sleep(3)  # started before the clock: imported, connected, joined
        source = rows(n)
        async with open_run(tenant, PLAY) as run:
            started = time.perf_counter()
            result = await run.map(table, source, fn, contract=contract, concurrency=16,
                                   shared=True)
            elapsed = time.perf_counter() - started
        assert result.completed == n, result
    finally:
        for worker in workers:
            worker.wait(timeout=120)
    return elapsed


async def with_schema(dsn: str, body):
    schema = f"bench_scale_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            return await body(tenant)
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def compare(dsn: str, label: str, fn, contract, n: int, target: str) -> None:
    single = await with_schema(dsn, lambda t: one_process(t, "single", fn, contract, n))
    double = await with_schema(dsn, lambda t: two_workers(t, dsn, "double", fn, contract, n))
    print(f"{label}, {n:,} rows: one process {single:.1f} s ({n / single:,.0f} rows/s), "
          f"workers=2 {double:.1f} s ({n / double:,.0f} rows/s): ratio {single / double:.2f} "
          f"(target {target})", flush=True)


_SPIN = "total = 0\nfor i in range(20_000_000):\n    total += i * i % 7\n"


def capacity() -> None:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", _SPIN], check=True)
    one = time.perf_counter() - started
    started = time.perf_counter()
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(2)]
    for spinner in spinners:
        spinner.wait()
    two = time.perf_counter() - started
    print(f"capacity: one process {one:.1f} s, two at once {two:.1f} s: ratio "
          f"{2 * one / two:.2f} (2.00 on two idle cores)", flush=True)


async def lease_statements(dsn: str, n: int) -> None:
    async def body(tenant) -> None:
        port = CountingPort(tenant)
        async with open_run(tenant, PLAY) as run:
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(lambda: serve_play(
                        port, PLAY, PLAY_FILE, WorkerOptions(exit_when_idle=True, poll_s=0.2)))
                await run.map("leases", rows(n), noop, contract=NOOP, shared=True)
        kinds = {"claims": "SKIP LOCKED", "renewals": "renewed AS",
                 "progress batches (settled masks, done marks)": "settled AS",
                 "admission lease checks": "FOR SHARE OF u"}
        counts = {kind: sum(1 for sql in port.statements if marker in sql)
                  for kind, marker in kinds.items()}
        lease = sum(counts.values())
        other = sum(1 for sql in port.statements if "shared_" in sql) - lease
        print(f"lease statements for {n:,} rows: " + ", ".join(
            f"{count} {kind}" for kind, count in counts.items())
            + f" = {1000 * lease / n:.2f} per 1,000 rows (target <= 5); besides, "
              f"{other} heartbeats and polls", flush=True)

    await with_schema(dsn, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-rows", type=int, default=20_000)
    parser.add_argument("--noop-rows", type=int, default=100_000)
    parser.add_argument("--lease-rows", type=int, default=20_000)
    parser.add_argument("--parts", default="capacity,cpu,noop,leases")
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    dsn = args.dsn or bench_dsn()
    parts = set(args.parts.split(","))

    async def run_all() -> None:
        if "capacity" in parts:
            capacity()
        if "cpu" in parts:
            await compare(dsn, "CPU-bound (~2 ms of pure Python a row)", burn, CPU,
                          args.cpu_rows, ">= 1.7")
        if "noop" in parts:
            await compare(dsn, "no-op", noop, NOOP, args.noop_rows, ">= 0.9")
        if "leases" in parts:
            await lease_statements(dsn, args.lease_rows)

    trio.run(run_all)


if __name__ == "__main__":
    main()
