"""A hosting process's garbage-collector tuning (`cli.collector`) against CPython's defaults.

    python benchmarks/gc_tuning.py [--rows 100000] [--list-rows 100000] [--rounds 3]

In one process, alternating which goes first, each round maps `--rows` rows of an async
iterable and `--list-rows` rows of a list (no-op function, `open_run` to its exit, each a new
run of its own play) once with the defaults (700, 10, 10; nothing frozen) and once tuned
(`tune_for_hosting`: `gc.freeze()` then (50,000, 20, 100)). Prints, for each source, the median
ratio of rows/s tuned / default and of the process's CPU seconds default / tuned, and the
seconds the collector took (`gc.callbacks`) on each side.
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from _rows import CONTRACT, noop, row, stream  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.cli import collector  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402


class CollectorClock:
    """Seconds spent in collections, from `gc.callbacks`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


async def one_map(tenant, source, rows: int, clock: CollectorClock) -> tuple[float, float, float]:
    """(rows/s, CPU seconds, collector seconds) of one run mapping `source`, open_run to exit."""
    clock.seconds = 0.0
    cpu, started = time.process_time(), time.perf_counter()
    async with open_run(tenant, f"gc-{uuid.uuid4().hex[:8]}") as run:
        result = await run.map("t", source, noop, contract=CONTRACT, concurrency=16)
    elapsed = time.perf_counter() - started
    assert result.completed == rows, result
    return rows / elapsed, time.process_time() - cpu, clock.seconds


async def bench(dsn: str, args) -> None:
    clock = CollectorClock()
    gc.callbacks.append(clock)
    schema = f"bench_gc_{uuid.uuid4().hex[:8]}"
    sources = {"async iterable": (args.rows, lambda: stream(args.rows)),
               "list": (args.list_rows, lambda: [row(i) for i in range(args.list_rows)])}
    figures = {(name, side): [] for name in sources for side in ("default", "tuned")}
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            for r in range(args.rounds):
                for side in (("default", "tuned") if r % 2 == 0 else ("tuned", "default")):
                    for name, (rows, make) in sources.items():
                        if rows <= 0:
                            continue
                        collector.restore_defaults()
                        if side == "tuned":
                            collector.tune_for_hosting()
                        source = make()  # a list is built under the side's settings
                        figures[name, side].append(await one_map(tenant, source, rows, clock))
        finally:
            collector.restore_defaults()
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    for name, (rows, _) in sources.items():
        if rows <= 0:
            continue
        default, tuned = figures[name, "default"], figures[name, "tuned"]
        speed = statistics.median(t[0] / d[0] for t, d in zip(tuned, default))
        cpu = statistics.median(d[1] / t[1] for t, d in zip(tuned, default))
        print(f"{name}, {rows:,} rows: rows/s tuned / default {speed:.2f} "
              f"(median {statistics.median(t[0] for t in tuned):,.0f} / "
              f"{statistics.median(d[0] for d in default):,.0f}); CPU default / tuned {cpu:.2f}; "
              f"collector {statistics.median(d[2] for d in default):.2f} s default, "
              f"{statistics.median(t[2] for t in tuned):.2f} s tuned", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--list-rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    trio.run(bench, args.dsn or bench_dsn(), args)


if __name__ == "__main__":
    main()
