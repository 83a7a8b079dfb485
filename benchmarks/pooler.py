"""A map through a transaction-mode PgBouncer against the same map straight to the server.

    python benchmarks/pooler.py [--rows 100000] [--rounds 3] [--concurrency 16]

Each round maps `--rows` rows with a no-op function into a fresh schema twice, back to back,
alternating which goes first: once over the server's own socket, once through Debian's
`pgbouncer` 1.18 (`pool_mode = transaction`, started here in front of the same server, as the
tests start it) with `?pooler=transaction`. Prints rows/s of both and the median of the rounds'
ratios pooler/direct. Through the pooler every checkout is one transaction that first sets its
search path, statements are unnamed (parsed on every execution) and every round trip crosses
one more process: that is the price measured.

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
from tests.pooler_support import start_bouncer  # noqa: E402

CONTRACT = sheets.SheetContract(inputs=("n",), outputs=("ok",))


async def noop(row):
    return {"ok": True}


async def one_map(dsn: str, rows: int, concurrency: int) -> float:
    """rows/s of one map of `rows` fresh rows into a fresh schema (dropped afterwards)."""
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    async with open_tenant("org-bench", dsn, schema=schema) as tenant:
        try:
            started = time.perf_counter()
            async with open_run(tenant, "bench") as run:
                result = await run.map("rows", [{"n": i} for i in range(rows)], noop,
                                       contract=CONTRACT, concurrency=concurrency)
            took = time.perf_counter() - started
            assert result.completed == rows, result
            return rows / took
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


async def main(args: argparse.Namespace) -> None:
    server = bench_dsn()
    bouncer = start_bouncer(server)
    try:
        sides = {"direct": server, "pooler": bouncer.dsn}
        ratios = []
        for round_no in range(args.rounds):
            order = ["direct", "pooler"] if round_no % 2 == 0 else ["pooler", "direct"]
            rates = {side: await one_map(sides[side], args.rows, args.concurrency)
                     for side in order}
            ratios.append(rates["pooler"] / rates["direct"])
            print(f"round {round_no + 1}: direct {rates['direct']:,.0f} rows/s, "
                  f"pooler {rates['pooler']:,.0f} rows/s, pooler/direct {ratios[-1]:.2f}",
                  flush=True)
        print(f"pooler/direct (median of {args.rounds}): {statistics.median(ratios):.2f}")
    finally:
        bouncer.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    trio.run(main, parser.parse_args())
