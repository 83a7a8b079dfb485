"""Many orgs through one gateway inside its connection budget (issue 43, SPEC §35).

    python benchmarks/gateway_orgs.py [--many 100] [--few 10] [--rows 100000] [--rounds 3]
                                      [--max-connections N]

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
cores were). All of that is one round; `--rounds` of them (3) run one after the other on the
same gateway, each with new orgs, after a warm-up (`--few` orgs mapping 100 rows each: the
first phase does not meet a cold gateway alone), and the run ends with the median of the
rounds' ratios (one round's phases last seconds, and the ratio swings with the machine) and
one request's CPU cost (a one-read action, 2,000 times in a row): the client's and the
gateway's, which each run's requests multiply.
Both processes collect garbage as `runplane serve` and the runners' `runplane demo` do
(`benchmarks/_hosting.py`; `RUNPLANE_BENCH_GC=default` for CPython's defaults).
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
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
from _rows import CONTRACT, noop  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402
from runplane.engine.runs.cancel import cancel_requested  # noqa: E402
from runplane.engine.gateway import RetryPolicy, ServerOptions, mint_token, open_gateway, open_server  # noqa: E402
from runplane.engine.observability import metrics  # noqa: E402

PLAY = "bench"
SECRET = "benchmark-gateway-orgs-" + uuid.uuid4().hex
RETRY = RetryPolicy(unreachable_budget_s=600.0, completion_total_s=900.0)
FLOOR_CALLS = 2_000


async def one_org(url: str, org: str, rows: int, done: list[int], again: int = 0) -> None:
    """One run of `org` mapping `rows` new rows (`again`: the how-manieth time for this org,
    so its rows are new ones, not cache hits)."""
    async with open_gateway(url, mint_token(SECRET, org), retry=RETRY) as gateway:
        async with open_run(gateway, PLAY, f"run-{uuid.uuid4().hex[:8]}") as run:
            result = await run.map("t", [{"name": f"{org}-{again}-{i}", "n": i}
                                         for i in range(rows)],
                                   noop, contract=CONTRACT, concurrency=16)
    assert result.completed == rows, result
    done.append(rows)


async def phase(url: str, orgs: int, rows: int, tag: str, again: int = 0) -> float:
    """`orgs` orgs map `rows` new rows between them at once (new orgs, or with `again` the
    orgs of an earlier phase of `tag`); the seconds it took."""
    done: list[int] = []
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(orgs):
            nursery.start_soon(one_org, url, f"{tag}-{i:03d}", rows // orgs, done, again)
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-connections", type=int, default=None)
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
        trio.run(phase, url, args.few, args.few * 100, "warm")
        for number in range(1, args.rounds + 1):
            rounds.append(one_round(url, child, args, f"r{number}"))
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


def one_round(url: str, child: subprocess.Popen, args: argparse.Namespace, tag: str) -> Round:
    """Both phases with new orgs (their names end in `tag`), again with the same orgs, then
    the one-row phases that measure each org's fixed cost."""
    start, cpu_start = ask(child), cpu_now()
    few_s = trio.run(phase, url, args.few, args.rows, f"few-{tag}")
    few, cpu_few = ask(child), cpu_now()
    many_s = trio.run(phase, url, args.many, args.rows, f"many-{tag}")
    many, cpu_many = ask(child), cpu_now()
    # the same orgs again: their tenants open, their sheets made (a gateway's steady state)
    few_again_s = trio.run(phase, url, args.few, args.rows, f"few-{tag}", 1)
    few_again = ask(child)
    many_again_s = trio.run(phase, url, args.many, args.rows, f"many-{tag}", 1)
    many_again = ask(child)
    # the floor: each org's fixed cost (its first run, a new sheet), one row an org
    few_fixed = trio.run(phase, url, args.few, args.few, f"few-fixed-{tag}")
    fixed_before = ask(child)
    many_fixed = trio.run(phase, url, args.many, args.many, f"many-fixed-{tag}")
    fixed_after = ask(child)
    few_rate, many_rate = args.rows / few_s, args.rows / many_s
    lines = [
        f"{args.few} orgs x {args.rows // args.few:,} rows:  {few_rate:,.0f} rows/s; "
        f"p99 wait for a connection {few.p99_wait_s * 1000:.0f} ms; "
        f"{(few.requests - start.requests) / args.few:.1f} requests and "
        f"{(few.statements - start.statements) / args.few:.1f} statements a run",
        f"{args.many} orgs x {args.rows // args.many:,} rows: {many_rate:,.0f} rows/s; "
        f"p99 wait for a connection {many.p99_wait_s * 1000:.0f} ms; "
        f"{(many.requests - few.requests) / args.many:.1f} requests and "
        f"{(many.statements - few.statements) / args.many:.1f} statements a run",
        f"ratio many/few: {many_rate / few_rate:.2f} (target >= 0.80)",
        f"requests a run by action, {args.many} orgs: {per_run(few, many, args.many)}",
    ]
    for name, seconds, (c0, g0), (c1, g1) in (
            ("few", few_s, (cpu_start, start), (cpu_few, few)),
            ("many", many_s, (cpu_few, few), (cpu_many, many))):
        lines.append(cpu_split(name, seconds, c0, c1, g1.cpu_s - g0.cpu_s))
    again_few, again_many = args.rows / few_again_s, args.rows / many_again_s
    lines.append(
        f"the same orgs again (their second run): {args.few} orgs {again_few:,.0f} rows/s, "
        f"{args.many} orgs {again_many:,.0f} rows/s (p99 wait for a connection "
        f"{many_again.p99_wait_s * 1000:.0f} ms, "
        f"{(many_again.requests - few_again.requests) / args.many:.1f} requests and "
        f"{(many_again.statements - few_again.statements) / args.many:.1f} statements a run); "
        f"ratio {again_many / again_few:.2f}")
    few_net = rows_per_s(args.rows, few_s - few_fixed)
    many_net = rows_per_s(args.rows, many_s - many_fixed)
    lines.append(
        f"each org's fixed cost (its first run of one row, at once): {args.few} orgs "
        f"{few_fixed:.2f} s, {args.many} orgs {many_fixed:.2f} s; rows/s with it taken out: "
        f"{few_net:,.0f} / {many_net:,.0f}, ratio {many_net / few_net:.2f}; such a run sent "
        f"{(fixed_after.requests - fixed_before.requests) / args.many:.1f} requests and its "
        f"tenant {(fixed_after.statements - fixed_before.statements) / args.many:.1f} "
        "statements")
    return Round(lines, many_rate / few_rate, again_many / again_few, many_net / few_net)


@attrs.frozen
class CpuNow:
    """CPU seconds so far: this process's (the client's) and the whole machine's busy time
    (`/proc/stat`; None where there is none)."""

    client_s: float
    machine_s: float | None


def cpu_now() -> CpuNow:
    try:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:]]
    except OSError:
        return CpuNow(time.process_time(), None)
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return CpuNow(time.process_time(), busy / os.sysconf("SC_CLK_TCK"))


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
