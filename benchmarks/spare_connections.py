"""A gateway at low load: orgs one after another, each taking another org's spare connection
rather than starting a backend (`engine.limits.connections`, `spare_idle_s`).

    python benchmarks/spare_connections.py [--orgs 20] [--gap 1.2] [--rounds 3]

This process hosts the orgs' tenants on one connection budget as a gateway does
(`engine.gateway.tenants.OrgTenants` on one event loop: the server's default budget, the
tenants after the first opening without a statement), and `--orgs` new orgs each map one row
in a run of their own, one after another, `--gap` seconds apart: when an org comes, the orgs
before it hold idle connections. In the same run, alternating which goes first, two sides:
- spare: the budget as it is — below its size, another org's connection idle 1 s or more moves
  to the org that needs one before a new one opens;
- no spare: no idle connection counts as spare (`spare_idle_s` infinite), so below its size
  every org's first connection is a new backend, as before the twenty-fifth pass.
Each side prints the backends the server started for it (`pg_stat_activity`, idle connections
kept open past the side: `RUNPLANE_IDLE_CLOSE_S` is 600 s here), the server's CPU a run (the
machine's busy time less this process's: the PostgreSQL server, mostly) and this process's CPU
a run; then the medians and the ratio spare / no spare of each CPU figure.
The process collects garbage as `runplane serve` does (`benchmarks/_hosting.py`).
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ["RUNPLANE_IDLE_CLOSE_S"] = "600"  # the backends a side started are all there to count

import attrs  # noqa: E402
import trio  # noqa: E402

from _hosting import collect_as_hosting  # noqa: E402
from _machine import machine_busy_s  # noqa: E402
from _rows import CONTRACT, noop, row  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant, pg  # noqa: E402
from runplane.engine.gateway.tenants import OrgTenants  # noqa: E402
from runplane.engine.limits.connections import SPARE_IDLE_S  # noqa: E402

PLAY = "bench"
_STARTED = """
SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND backend_start >= $1 AND pid <> pg_backend_pid()
"""


@attrs.frozen
class Side:
    backends: int
    server_ms: float  # a run
    process_ms: float  # a run


async def side(dsn: str, schema: str, orgs: int, gap: float, spare_idle_s: float) -> Side:
    """`orgs` new orgs map one row each, `gap` seconds apart, on one budget (module docstring)."""
    tenants = OrgTenants(dsn, schema)
    tag = uuid.uuid4().hex[:6]
    async with pg.open_driver(), trio.open_nursery() as nursery:  # one loop, as a gateway's
        tenants.serve_in(nursery)
        await tenants.get(f"warm-{tag}")  # sizes the budget, opens the first tenant
        assert tenants.budget is not None
        tenants.budget.spare_idle_s = spare_idle_s
        async with open_tenant("bench-count", dsn, schema=schema) as counter:
            async with counter.connection("receipts") as conn:
                since = await conn.fetchval("SELECT clock_timestamp()")
            await trio.sleep(gap)
            machine, process = machine_busy_s(), time.process_time()
            for i in range(orgs):
                tenant = await tenants.get(f"org-{tag}-{i}")
                async with open_run(tenant, PLAY) as run:
                    await run.map("t", [row(i, tag)], noop, contract=CONTRACT)
                await trio.sleep(gap)
            process = time.process_time() - process
            machine = (machine_busy_s() or math.nan) - (machine or math.nan)
            async with counter.connection("receipts") as conn:
                backends = await conn.fetchval(_STARTED, since)
        tenants.close()
    return Side(backends, (machine - process) / orgs * 1000, process / orgs * 1000)


async def run_all(args: argparse.Namespace) -> None:
    dsn = args.dsn or bench_dsn()
    schema = f"bench_spare_{uuid.uuid4().hex[:8]}"
    results: dict[str, list[Side]] = {"spare": [], "no spare": []}
    try:
        for r in range(args.rounds):
            sides = [("spare", SPARE_IDLE_S), ("no spare", math.inf)]
            for name, spare_idle_s in sides if r % 2 == 0 else reversed(sides):
                got = await side(dsn, schema, args.orgs, args.gap, spare_idle_s)
                results[name].append(got)
                print(f"round {r + 1}, {name}: {got.backends} backends started; server "
                      f"{got.server_ms:.1f} ms a run, this process {got.process_ms:.1f} ms a run",
                      flush=True)
    finally:
        async with open_tenant("bench", dsn, schema=schema) as tenant:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(s, field) for s in results[name])

    for name in results:
        print(f"{name}: median {median(name, 'backends'):.0f} backends started for "
              f"{args.orgs} orgs; server {median(name, 'server_ms'):.1f} ms a run, this "
              f"process {median(name, 'process_ms'):.1f} ms a run")
    print(f"spare / no spare: server CPU a run "
          f"{median('spare', 'server_ms') / median('no spare', 'server_ms'):.2f}, this "
          f"process's {median('spare', 'process_ms') / median('no spare', 'process_ms'):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orgs", type=int, default=20)
    parser.add_argument("--gap", type=float, default=1.2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    print(collect_as_hosting(), flush=True)
    trio.run(run_all, args)


if __name__ == "__main__":
    main()
