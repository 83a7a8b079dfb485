"""A map's tail held for one completion, against every batch going at its linger, in one run.

    python benchmarks/tail_hold.py [--slow-rows 1000] [--slow-ms 50] [--io-rows 10000]
                                   [--rounds 3]

As built, once a map's admission is over and at most `TAIL_ROWS` (1,000) of its rows are left
to settle, its completion batch waits past its linger for the rest of them, up to `tail_hold_s`
(0.5 s; `actors.completer`). The baseline is `tail_hold_s=0`: every batch goes at its linger
(50 ms) when a writer is idle, as before. Each round, both ways, the order turning each round:
1. a small slow map: `--slow-rows` rows whose function awaits `--slow-ms` ms, 16 at a time
   (what a map calling a remote service looks like), directly and through a gateway (a child
   process, as `runplane serve`): completions a map and seconds, `open_run` to its exit;
2. the I/O-bound map of `ceiling.py` (`--io-rows` rows awaiting 5 ms, 64 at a time), directly:
   seconds (its last 1,000 rows are a tail: held, they are written after the last call
   returns, which must not slow the map).
Prints each side's medians and the ratios as built / baseline.
Both processes collect garbage as `runplane run` and `runplane serve` do
(`benchmarks/_hosting.py`). The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`,
else a throwaway embedded one.
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

import gateway as gateway_bench  # noqa: E402
from _hosting import collect_as_hosting  # noqa: E402
from _rows import CONTRACT, OUTPUT, row  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import map_state, open_run  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402
from runplane.engine.gateway import mint_token, open_gateway  # noqa: E402

SIDES = {"as built": map_state.TAIL_HOLD_S, "every batch at its linger": 0.0}
COMPLETIONS = [0]  # completions written by this process's maps (`counted`)


def count_completions() -> None:
    """Count every completion this process's maps write (`actors.map_state.complete_write`)."""
    original = map_state.complete_write

    async def counted(port, write, outcomes):
        COMPLETIONS[0] += 1
        return await original(port, write, outcomes)

    map_state.complete_write = counted


def awaiting(ms: float):
    async def fn(_row: dict) -> dict:
        await trio.sleep(ms / 1000)
        return OUTPUT

    return fn


async def one_map(port, rows: int, ms: float, concurrency: int,
                  tail_hold_s: float) -> tuple[float, int]:
    """(seconds, completions) of one new run mapping `rows` new rows, open_run to its exit."""
    before, started = COMPLETIONS[0], time.perf_counter()
    tag = uuid.uuid4().hex[:8]
    async with open_run(port, f"tail-{tag}") as run:
        result = await run.map("t", [row(i, tag) for i in range(rows)], awaiting(ms),
                               contract=CONTRACT, concurrency=concurrency,
                               tail_hold_s=tail_hold_s)
    assert result.completed == rows, result
    return time.perf_counter() - started, COMPLETIONS[0] - before


async def measure(dsn: str, url: str, schema: str, args: argparse.Namespace) -> None:
    found: dict[tuple[str, str], list[tuple[float, int]]] = {}
    async with open_tenant(gateway_bench.ORG, dsn, schema=schema) as tenant, \
            open_gateway(url, mint_token(gateway_bench.SECRET, gateway_bench.ORG)) as gateway:
        cases = [("small slow map, direct", tenant, args.slow_rows, args.slow_ms, 16),
                 ("small slow map, gateway", gateway, args.slow_rows, args.slow_ms, 16),
                 ("I/O-bound map, direct", tenant, args.io_rows, 5.0, 64)]
        for r in range(args.rounds):
            sides = list(SIDES.items())
            for side, hold in sides if r % 2 == 0 else sides[::-1]:
                for name, port, rows, ms, concurrency in cases:
                    found.setdefault((name, side), []).append(
                        await one_map(port, rows, ms, concurrency, hold))
    for name, *_ in cases:
        built, base = found[(name, "as built")], found[(name, "every batch at its linger")]
        for side, readings in (("as built", built), ("every batch at its linger", base)):
            print(f"{name}, {side}: {statistics.median(s for s, _ in readings):.3f} s, "
                  f"{statistics.median(c for _, c in readings):.0f} completions a map")
        time_ratio = statistics.median(a[0] / b[0] for a, b in zip(built, base))
        count_ratio = statistics.median(a[1] / b[1] for a, b in zip(built, base))
        print(f"{name}: as built / baseline: time {time_ratio:.3f}, completions "
              f"{count_ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow-rows", type=int, default=1000)
    parser.add_argument("--slow-ms", type=float, default=50.0)
    parser.add_argument("--io-rows", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    print(collect_as_hosting(), flush=True)
    count_completions()
    gateway_bench.with_gateway_child(args.dsn or bench_dsn(), "bench_tail", measure, args)


if __name__ == "__main__":
    main()
