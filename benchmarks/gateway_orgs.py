"""Many orgs through one gateway inside its connection budget (issue 43, SPEC §35).

    python benchmarks/gateway_orgs.py [--many 100] [--few 10] [--rows 100000] [--rounds 4]
                                      [--max-connections N] [--no-upkeep]

A gateway server runs in a child process (as `runplane serve` would) with its default
connection budget (half of what the server's `max_connections` leaves past the owner reserve
and the session budget, at most 6 a core for a server on this machine, as the embedded one is;
`--max-connections` sets another). In the same run:
1. `--few` orgs (10) map `--rows` rows between them at once (10 × 10,000), each org's runner
   a trio task here with its own token;
2. `--many` orgs (100) map the same `--rows` rows between them at once (100 × 1,000).
Prints the total rows/s of each, the ratio many/few (target >= 0.8: a hundred orgs share the
budget without losing throughput to connection churn), the p99 wait for a connection slot
in the gateway during each phase, and the `--many` phase's requests a run by action. Then
both phases again with the same orgs, new rows (each org's second run: its tenant open in the
gateway, its sheet made; a gateway's steady state) and their ratio. Then the floor: `--few`
and `--many` new orgs each map one row at once (an org's fixed cost: its first run, a new
sheet, its first connections), and the rows/s and ratio with that fixed cost taken out of each
phase. Each phase also prints the gateway requests and the database statements a run sent,
and where its CPU went (the client, the gateway, the rest of the machine, and how busy its
cores were). All of that is one round; `--rounds` of them (4) run one after the other on the
same gateway, each with new orgs, after a warm-up (`--few` orgs mapping 100 rows each: the
first phase does not meet a cold gateway alone). Odd rounds run the `--few` phase of each pair
first, even rounds the `--many` one (this machine drifts within a run — it slowed by a third
over minutes in one measurement — so a fixed order would charge the drift to the phase that
always runs second). The run ends with each order's ratios, the median of the
rounds' ratios (one round's phases last seconds, and the ratio swings with the machine) and
one request's CPU cost (a one-read action, 2,000 times in a row): the client's and the
gateway's, which each run's requests multiply.
Each phase's time includes the first `VACUUM (ANALYZE)` of the sheets it wrote, and before
each phase, outside its time and its CPU readings, the server's upkeep of everything else
written before it (the schema's own tables, the system catalogs, late-reported sheets) is
done, and a checkpoint: autovacuum, a minute apart, otherwise lands its pass over one phase's
writes in whichever phase runs then (it doubled one phase's server CPU in a run here), and a
checkpoint the WAL of earlier phases called for likewise (`--no-upkeep` leaves both to the
server, as before). The upkeep adds about 11 s a phase to the run.
Both processes collect garbage as `runplane serve` and the runners' `runplane demo` do
(`benchmarks/_hosting.py`; `RUNPLANE_BENCH_GC=default` for CPython's defaults).
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attrs  # noqa: E402
import trio  # noqa: E402

from _hosting import collect_as_hosting  # noqa: E402
from _machine import machine_busy_s  # noqa: E402
from _rows import CONTRACT, noop  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import Tenant, open_tenant  # noqa: E402
from runplane.engine.errors import InsufficientPrivilegeError  # noqa: E402
from runplane.engine.runs.cancel import cancel_requested  # noqa: E402
from runplane.engine.gateway import RetryPolicy, ServerOptions, mint_token, open_gateway, open_server  # noqa: E402
from runplane.engine.observability import metrics  # noqa: E402
from runplane.engine.sheets.layout import table_name  # noqa: E402

PLAY = "bench"
TABLE = "t"  # the one table each run maps into
SECRET = "benchmark-gateway-orgs-" + uuid.uuid4().hex
RETRY = RetryPolicy(unreachable_budget_s=600.0, completion_total_s=900.0)
FLOOR_CALLS = 2_000


async def one_org(url: str, org: str, rows: int, done: list[int], again: int = 0) -> None:
    """One run of `org` mapping `rows` new rows (`again`: the how-manieth time for this org,
    so its rows are new ones, not cache hits)."""
    async with open_gateway(url, mint_token(SECRET, org), retry=RETRY) as gateway:
        async with open_run(gateway, PLAY, f"run-{uuid.uuid4().hex[:8]}") as run:
            result = await run.map(TABLE, [{"name": f"{org}-{again}-{i}", "n": i}
                                         for i in range(rows)],
                                   noop, contract=CONTRACT, concurrency=16)
    assert result.completed == rows, result
    done.append(rows)


@attrs.frozen
class Upkeep:
    """Where the server's upkeep around a phase runs (`phase`)."""

    dsn: str
    schema: str


async def vacuum(tenant: Tenant, tables: list[str]) -> None:
    """`VACUUM (ANALYZE)` `tables` on two connections at once, as autovacuum's workers would."""
    async def part(names: list[str]) -> None:
        if names:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f"VACUUM (ANALYZE) {', '.join(names)}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(part, tables[0::2])
        nursery.start_soon(part, tables[1::2])


# An idle backend reports its table statistics within 10 s (PostgreSQL's idle flush); a
# table's writes are in them, for autovacuum to see, only then.
STATS_FLUSH_S = 11.0

_CHANGED = """
SELECT coalesce(array_agg(format('%I.%I', schemaname, relname)), '{}') FROM pg_stat_all_tables
 WHERE schemaname IN ($1, 'pg_catalog')
   AND (n_mod_since_analyze > 0 OR n_ins_since_vacuum > 0 OR n_dead_tup > 0)
"""


async def settle(tenant: Tenant) -> None:
    """The server's upkeep before a phase, outside its time: once every backend has reported
    what earlier phases wrote, `VACUUM (ANALYZE)` each table of the schema and each system
    catalog with writes since its last one, then a `CHECKPOINT`. Autovacuum then finds nothing
    of theirs to do in the phase, and no checkpoint their WAL called for falls in it: no phase
    pays for another's."""
    await trio.sleep(STATS_FLUSH_S)
    async with tenant.connection("sheet") as conn:
        changed = await conn.fetchval(_CHANGED, tenant.schema)
    await vacuum(tenant, changed)
    async with tenant.connection("sheet") as conn:
        try:
            await conn.execute("CHECKPOINT")
        except InsufficientPrivilegeError:
            pass  # a login without pg_checkpoint: the server checkpoints on its own schedule


async def settle_at(where: Upkeep) -> None:
    async with open_tenant("bench-upkeep", where.dsn, schema=where.schema) as tenant:
        await settle(tenant)


async def phase(url: str, orgs: int, rows: int, tag: str, again: int = 0,
                where: Upkeep | None = None) -> float:
    """`orgs` orgs map `rows` new rows between them at once (new orgs, or with `again` the
    orgs of an earlier phase of `tag`); the seconds it took. With `where`, that time includes
    the first vacuum and analyze of the orgs' sheets: the server does them soon after any
    phase; done here, each phase pays for its own sheets, where autovacuum's next pass (a
    minute apart) would land in whichever phase runs then (a tenth of a phase's CPU, in one
    phase or another). `measured` settles the rest first, outside the phase's time."""
    done: list[int] = []
    names = [f"{tag}-{i:03d}" for i in range(orgs)]
    async with contextlib.AsyncExitStack() as stack:
        tenant = None
        if where is not None:
            tenant = await stack.enter_async_context(
                open_tenant("bench-upkeep", where.dsn, schema=where.schema))
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(one_org, url, name, rows // orgs, done, again)
        if tenant is not None:
            await vacuum(tenant, [f'"{tenant.schema}"."{table_name(org, PLAY, TABLE)}"'
                                  for org in names])
        elapsed = time.perf_counter() - started
    assert sum(done) == rows // orgs * orgs
    return elapsed


@attrs.frozen
class Reading:
    """What the gateway child answers: the p99 of its slot waits since the last ask, the
    requests it answered so far (in all, and by action), its CPU seconds and the statements
    its tenants sent so far."""

    p99_wait_s: float
    requests: int
    cpu_s: float
    statements: int
    by_action: dict[str, int]


def ask(child: subprocess.Popen) -> Reading:
    child.stdin.write("ask\n")
    child.stdin.flush()
    p99, requests, cpu, statements, by_action = child.stdout.readline().split(maxsplit=4)
    return Reading(float(p99), int(requests), float(cpu), int(statements), json.loads(by_action))


def per_run(before: Reading, after: Reading, runs: int) -> str:
    """The requests a run sent between two readings, by action, most first."""
    sent = {name: (after.by_action.get(name, 0) - before.by_action.get(name, 0)) / runs
            for name in after.by_action}
    return ", ".join(f"{name} {count:.1f}"
                     for name, count in sorted(sent.items(), key=lambda item: -item[1])
                     if count >= 0.05)


async def request_floor(url: str, child: subprocess.Popen, calls: int) -> tuple[float, float]:
    """One org's `runs.cancel_requested` (one primary-key read) `calls` times in a row: the
    CPU seconds of this process (the client) and of the gateway child, per call."""
    async with open_gateway(url, mint_token(SECRET, "floor"), retry=RETRY) as gateway:
        async with open_run(gateway, PLAY, f"run-{uuid.uuid4().hex[:8]}") as run:
            for _ in range(100):  # warm: the tenant, the run's registration, the connection
                await cancel_requested(gateway, run.scope)
            before, started = ask(child), time.process_time()
            for _ in range(calls):
                await cancel_requested(gateway, run.scope)
            client, after = time.process_time() - started, ask(child)
    return client / calls, (after.cpu_s - before.cpu_s) / calls


async def serve_child(dsn: str, schema: str, max_connections: int | None) -> None:
    options = ServerOptions(bind="127.0.0.1:0", max_connections=max_connections)
    async with open_server(secret=SECRET, dsn=dsn, schema=schema, options=options) as server:
        print(server.url, flush=True)
        while await trio.to_thread.run_sync(sys.stdin.readline):
            budget = server.tenants.budget
            waits = sorted(budget.take_waits()) if budget is not None else []
            p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))] if waits else 0.0
            cpu = os.times()
            statements = sum(sum(histogram.counts)
                             for histogram in metrics.STATEMENT_SECONDS.children.values())
            print(f"{p99:.6f} {sum(server.requests.values())} {cpu.user + cpu.system:.6f} "
                  f"{statements} {json.dumps(dict(server.requests))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--many", type=int, default=100)
    parser.add_argument("--few", type=int, default=10)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-connections", type=int, default=None)
    parser.add_argument("--no-upkeep", action="store_true",
                        help="leave the vacuum and analyze of each phase's writes to autovacuum")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--serve-child", default=None, metavar="SCHEMA", help=argparse.SUPPRESS)
    args = parser.parse_args()
    collector_line = collect_as_hosting()  # the child as `runplane serve`, the runners' side
    dsn = args.dsn or bench_dsn()
    if args.serve_child:
        global SECRET
        SECRET = os.environ["RUNPLANE_GATEWAY_SECRET"]
        trio.run(serve_child, dsn, args.serve_child, args.max_connections)
        return
    print(collector_line, flush=True)
    schema = f"bench_orgs_{uuid.uuid4().hex[:8]}"
    extra = [] if args.max_connections is None else ["--max-connections", str(args.max_connections)]
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-child", schema, "--dsn", dsn, *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "RUNPLANE_GATEWAY_SECRET": SECRET})
    rounds: list[Round] = []
    try:
        url = child.stdout.readline().strip()
        if not url:
            raise SystemExit("the gateway child did not start")
        # Warm the gateway first (the schema's first opening, the budget's connections, the
        # first preparations of the statements every org shares), so that the first round's
        # 10-org phase, the first thing it serves, does not pay for them alone.
        args.where = None if args.no_upkeep else Upkeep(dsn, schema)
        trio.run(phase, url, args.few, args.few * 100, "warm", 0, args.where)
        for number in range(1, args.rounds + 1):
            rounds.append(one_round(url, child, args, f"r{number}", many_first=number % 2 == 0))
            if args.rounds > 1:
                print(f"-- round {number} of {args.rounds}")
            print("\n".join(rounds[-1].lines), flush=True)
        # and one request's cost: the client's CPU and the gateway's, per call
        client_cpu, gateway_cpu = trio.run(request_floor, url, child, FLOOR_CALLS)
    finally:
        child.stdin.close()
        child.terminate()
        child.wait(timeout=30)
        trio.run(drop_schema, dsn, schema)
    print(f"one request's CPU (runs.cancel_requested, {FLOOR_CALLS:,} in a row): client "
          f"{client_cpu * 1000:.2f} ms + gateway {gateway_cpu * 1000:.2f} ms")
    if args.rounds > 1:
        for many_first, name in ((False, "the few phase first"), (True, "the many phase first")):
            ratios = [r.ratio for r in rounds if r.many_first == many_first]
            print(f"rounds with {name}: ratio many/few "
                  f"{', '.join(f'{ratio:.2f}' for ratio in ratios)}")
        print(f"median of {args.rounds} rounds: ratio many/few "
              f"{statistics.median(r.ratio for r in rounds):.2f} (target >= 0.80); their "
              f"second runs {statistics.median(r.again_ratio for r in rounds):.2f}; with each "
              f"org's fixed cost taken out {statistics.median(r.net_ratio for r in rounds):.2f}")


@attrs.frozen
class Round:
    """One round's printed lines and its ratios: the phases', their second runs', and with
    each org's fixed cost taken out."""

    lines: list[str]
    ratio: float
    again_ratio: float
    net_ratio: float
    many_first: bool


@attrs.frozen
class Measured:
    """One phase: its seconds, and the gateway's and this process's readings around it."""

    seconds: float
    before: Reading
    after: Reading
    cpu_before: "CpuNow"
    cpu_after: "CpuNow"

    def a_run(self, field: str, runs: int) -> float:
        """The change of the readings' `field` (requests, statements) over the phase, a run."""
        return (getattr(self.after, field) - getattr(self.before, field)) / runs

    def cpu_line(self, name: str) -> str:
        return cpu_split(name, self.seconds, self.cpu_before, self.cpu_after,
                         self.after.cpu_s - self.before.cpu_s)


def measured(url: str, child: subprocess.Popen, args: argparse.Namespace, orgs: int, rows: int,
             tag: str, again: int = 0) -> Measured:
    """A `phase`, after the server settled (`settle`, outside its time and its readings)."""
    if args.where is not None:
        trio.run(settle_at, args.where)
    before, cpu_before = ask(child), cpu_now()
    seconds = trio.run(phase, url, orgs, rows, tag, again, args.where)
    return Measured(seconds, before, ask(child), cpu_before, cpu_now())


def one_round(url: str, child: subprocess.Popen, args: argparse.Namespace, tag: str,
              many_first: bool) -> Round:
    """Both phases with new orgs (their names end in `tag`), again with the same orgs, then
    the one-row phases that measure each org's fixed cost; of each pair the `--many` phase
    first when `many_first`, else the `--few` one."""
    def pair(rows_few: int, rows_many: int, suffix: str,
             again: int = 0) -> tuple[Measured, Measured]:
        sides = [("few", args.few, rows_few), ("many", args.many, rows_many)]
        done = {name: measured(url, child, args, orgs, rows, f"{name}-{suffix}", again)
                for name, orgs, rows in (sides[::-1] if many_first else sides)}
        return done["few"], done["many"]

    few, many = pair(args.rows, args.rows, tag)
    # the same orgs again: their tenants open, their sheets made (a gateway's steady state)
    few_again, many_again = pair(args.rows, args.rows, tag, 1)
    # the floor: each org's fixed cost (its first run, a new sheet), one row an org
    few_fixed, many_fixed = pair(args.few, args.many, f"fixed-{tag}")
    few_rate, many_rate = args.rows / few.seconds, args.rows / many.seconds
    lines = [
        f"{args.few} orgs x {args.rows // args.few:,} rows:  {few_rate:,.0f} rows/s; "
        f"p99 wait for a connection {few.after.p99_wait_s * 1000:.0f} ms; "
        f"{few.a_run('requests', args.few):.1f} requests and "
        f"{few.a_run('statements', args.few):.1f} statements a run",
        f"{args.many} orgs x {args.rows // args.many:,} rows: {many_rate:,.0f} rows/s; "
        f"p99 wait for a connection {many.after.p99_wait_s * 1000:.0f} ms; "
        f"{many.a_run('requests', args.many):.1f} requests and "
        f"{many.a_run('statements', args.many):.1f} statements a run",
        f"ratio many/few: {many_rate / few_rate:.2f} (target >= 0.80; "
        f"{'the many phase' if many_first else 'the few phase'} ran first)",
        f"requests a run by action, {args.many} orgs: "
        f"{per_run(many.before, many.after, args.many)}",
        few.cpu_line("few"), many.cpu_line("many"),
    ]
    again_few, again_many = args.rows / few_again.seconds, args.rows / many_again.seconds
    lines.append(
        f"the same orgs again (their second run): {args.few} orgs {again_few:,.0f} rows/s, "
        f"{args.many} orgs {again_many:,.0f} rows/s (p99 wait for a connection "
        f"{many_again.after.p99_wait_s * 1000:.0f} ms, "
        f"{many_again.a_run('requests', args.many):.1f} requests and "
        f"{many_again.a_run('statements', args.many):.1f} statements a run); "
        f"ratio {again_many / again_few:.2f}")
    lines += [few_again.cpu_line("few again"), many_again.cpu_line("many again")]
    few_net = rows_per_s(args.rows, few.seconds - few_fixed.seconds)
    many_net = rows_per_s(args.rows, many.seconds - many_fixed.seconds)
    lines.append(
        f"each org's fixed cost (its first run of one row, at once): {args.few} orgs "
        f"{few_fixed.seconds:.2f} s, {args.many} orgs {many_fixed.seconds:.2f} s; rows/s with "
        f"it taken out: {few_net:,.0f} / {many_net:,.0f}, ratio {many_net / few_net:.2f}; such "
        f"a run sent {many_fixed.a_run('requests', args.many):.1f} requests and its tenant "
        f"{many_fixed.a_run('statements', args.many):.1f} statements")
    lines += [few_fixed.cpu_line("few fixed"), many_fixed.cpu_line("many fixed")]
    return Round(lines, many_rate / few_rate, again_many / again_few, many_net / few_net,
                 many_first)


@attrs.frozen
class CpuNow:
    """CPU seconds so far: this process's (the client's) and the whole machine's busy time
    (`/proc/stat`; None where there is none)."""

    client_s: float
    machine_s: float | None


def cpu_now() -> CpuNow:
    return CpuNow(time.process_time(), machine_busy_s())


def cpu_split(tag: str, seconds: float, before: CpuNow, after: CpuNow, gateway_s: float) -> str:
    """Where a phase's CPU went: the client, the gateway, and the rest of the machine (the
    PostgreSQL server, mostly), and how busy the machine's cores were."""
    client_s = after.client_s - before.client_s
    line = f"{tag} phase CPU: client {client_s:.1f} s, gateway {gateway_s:.1f} s"
    if before.machine_s is None or after.machine_s is None:
        return line
    busy_s = after.machine_s - before.machine_s
    cores = os.cpu_count() or 1
    return (f"{line}, the rest (the server) {busy_s - client_s - gateway_s:.1f} s; "
            f"{busy_s / seconds / cores:.0%} of {cores} cores busy")


def rows_per_s(rows: int, seconds: float) -> float:
    return rows / max(seconds, 1e-9)


async def drop_schema(dsn: str, schema: str) -> None:
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        async with tenant.connection("sheet") as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


if __name__ == "__main__":
    main()
