"""Claim + complete of N keys through `engine.receipts`, against the same two statements issued
with raw asyncpg on asyncio, on the same server in the same run. Prints both rates and the ratio.

    python benchmarks/receipts.py [--keys 5000] [--rounds 3]

Both sides run one key at a time (claim, then complete) on one connection, so the ratio is the
cost of our layers: the trio bridge, permits, scope and key checks, canonical JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import asyncpg  # noqa: E402  (the raw baseline only)
import trio  # noqa: E402

from _server import bench_dsn  # noqa: E402
from runplane.engine import RunScope, open_tenant, receipts, runs  # noqa: E402
from runplane.engine.canonical import normalize, stable_dumps  # noqa: E402
from runplane.engine.values.keys import receipt_key  # noqa: E402


async def ours(dsn: str, schema: str, keys: int) -> float:
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        tag = uuid.uuid4().hex
        run = await runs.register(tenant, RunScope("bench", "play", f"ours-{tag}"))
        started = time.perf_counter()
        for i in range(keys):
            claim = await receipts.claim(tenant, run, f"ours-{tag}-{i}")
            assert claim.disposition == "claimed"
            await receipts.complete(tenant, run, f"ours-{tag}-{i}", {"i": i, "ok": True})
        return keys / (time.perf_counter() - started)


def raw(dsn: str, schema: str, keys: int) -> float:
    claim_sql = receipts._statement(receipts._CLAIM, schema)
    complete_sql = receipts._statement(receipts._SETTLE, schema)
    scope = RunScope("bench", "play", "raw").play_scope

    tag = uuid.uuid4().hex

    async def main() -> float:
        conn = await asyncpg.connect(dsn)
        try:
            epoch = 10**12
            started = time.perf_counter()
            for i in range(keys):
                k = receipt_key(scope, f"raw-{tag}-{i}")
                row = await conn.fetchrow(claim_sql, k, "raw", epoch, False,
                                          float(receipts.DEFAULT_LEASE_S))
                assert row["disposition"] == "claimed"
                output = stable_dumps(normalize({"i": i, "ok": True}))
                await conn.fetchrow(complete_sql, k, "raw", epoch, 2, output, None)
            return keys / (time.perf_counter() - started)
        finally:
            await conn.close()

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dsn = bench_dsn()
    ratios = []
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    trio.run(ours, dsn, schema, 200)  # bootstrap the schema and warm the server up
    raw(dsn, schema, 200)
    for round_no in range(args.rounds):
        # Alternate which side goes first, so neither always meets a warmer server.
        if round_no % 2 == 0:
            ours_rate = trio.run(ours, dsn, schema, args.keys)
            raw_rate = raw(dsn, schema, args.keys)
        else:
            raw_rate = raw(dsn, schema, args.keys)
            ours_rate = trio.run(ours, dsn, schema, args.keys)
        ratios.append(ours_rate / raw_rate)
        print(
            f"round {round_no + 1}: engine.receipts {ours_rate:8.0f} keys/s   "
            f"raw asyncpg {raw_rate:8.0f} keys/s   ratio {ours_rate / raw_rate:.2f}"
        )
    print(f"claim+complete of {args.keys} keys: median ratio {statistics.median(ratios):.2f} (target >= 0.6)")


if __name__ == "__main__":
    main()
