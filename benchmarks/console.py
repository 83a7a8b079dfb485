"""The web console's cost: a running map's throughput while the console streams it, and the
runs page over 10,000 runs.

    python benchmarks/console.py [--rows 100000] [--rounds 2] [--runs 10000] [--parts ...]

1. Streaming (`--rows`, default 100,000): `run.map` with a no-op function over `--rows` rows,
   each time a new run of a new play, alternately with nobody looking and with the console
   (`runplane console`'s server, in the same process) open on the run's page: the page loaded
   as the map starts (it scans the sheet once for the run's own figures), then its live stream
   read for the whole map (one counters read a second). Prints rows/s of both and the ratio
   with/without (target >= 0.95; the median of `--rounds` rounds, the two sides back to back,
   alternating which goes first).
2. Runs page (`--runs`, default 10,000): 20 plays, each with a finished 1,000-row map, plus
   registered runs up to `--runs` in all (most retired, some open); then `GET /ui/` twenty times
   and prints the console's own time for it (`Server-Timing`), median and worst (target: <= 50
   ms). The page lists the newest 50 runs with their rows by status, which reads the tables of
   the plays on the page.

`--parts` picks what runs (default both): streaming,runs.
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import trio  # noqa: E402

from _rows import CONTRACT, noop, stream  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402
from runplane.engine.console import open_console  # noqa: E402

PLAYS = 20
PLAY_ROWS = 1_000


def server_ms(response: httpx.Response) -> float:
    match = re.search(r"dur=([0-9.]+)", response.headers.get("server-timing", ""))
    assert response.status_code == 200 and match, (response.status_code, response.text[:200],
                                                    response.headers.get("location"))
    return float(match.group(1))


async def logged_in(server) -> httpx.AsyncClient:
    http = httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=60)
    response = await http.get(server.login_url().removeprefix(server.url))
    assert response.status_code == 303, response.status_code
    return http


async def watch(http: httpx.AsyncClient, run, events: list[int]) -> None:
    """What a person looking does: the run page once, then its live stream for the whole map."""
    path = f"/ui/runs/{run.play}/{run.run_id}?org={run.scope.org_id}"
    await trio.sleep(0.2)  # the map has rows by then
    server_ms(await http.get(path))
    live = f"/ui/live/runs/{run.play}/{run.run_id}?org={run.scope.org_id}"
    async with http.stream("GET", live) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events[0] += 1


async def one_map(run, table: str, rows: int, http: httpx.AsyncClient | None) -> tuple[float, int]:
    events = [0]
    async with trio.open_nursery() as nursery:
        if http is not None:
            nursery.start_soon(watch, http, run, events)
        began = time.perf_counter()
        result = await run.map(table, stream(rows), noop, contract=CONTRACT, concurrency=16)
        elapsed = time.perf_counter() - began
        nursery.cancel_scope.cancel()
    assert result.completed == rows, result
    return rows / elapsed, events[0]


async def streaming(dsn: str, rows: int, rounds: int) -> None:
    schema = f"bench_console_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            async with open_console(dsn=dsn, schema=schema, bind="127.0.0.1:0") as server:
                http = await logged_in(server)
                without, with_console, ratios, events = [], [], [], 0
                for r in range(rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    got = {}
                    for looking in order:  # each side: a new run of its own play, one map
                        async with open_run(tenant, f"bench_{r}_{int(looking)}") as run:
                            got[looking] = await one_map(run, "t", rows,
                                                         http if looking else None)
                    without.append(got[False][0])
                    with_console.append(got[True][0])
                    events += got[True][1]
                    ratios.append(got[True][0] / got[False][0])
                await http.aclose()
            print(f"run.map, no-op fn, {rows:,} rows: {statistics.median(without):,.0f} rows/s "
                  f"without the console, {statistics.median(with_console):,.0f} rows/s with it "
                  f"streaming ({events} live events read)")
            print(f"ratio with/without: {statistics.median(ratios):.3f} (median of {rounds}; "
                  f"each {', '.join(f'{x:.3f}' for x in ratios)}; target >= 0.95)")
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


_MORE_RUNS = """
INSERT INTO {s}.runs (org_id, play, run_id, epoch, created_at)
SELECT 'bench', 'play_' || (g % {plays}), 'extra-' || g, nextval('{s}.run_epochs'),
       now() - ($1 - g) * interval '1 second'
  FROM generate_series(1, $1::int) AS g
"""

_OUTBOX = """
INSERT INTO {s}.terminal_outbox (org_id, play, run_id, state, updated_at)
SELECT org_id, play, run_id, CASE WHEN epoch % 25 = 0 THEN 'open' ELSE 'done' END,
       created_at + interval '42 seconds'
  FROM {s}.runs ON CONFLICT DO NOTHING
"""


async def runs_page(dsn: str, total_runs: int) -> None:
    schema = f"bench_console_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            for p in range(PLAYS):
                async with open_run(tenant, f"play_{p}") as run:
                    await run.map("t", stream(PLAY_ROWS), noop, contract=CONTRACT)
            async with tenant.connection("sheet") as conn:
                await conn.execute(_MORE_RUNS.format(s=f'"{schema}"', plays=PLAYS),
                                   total_runs - PLAYS)
                await conn.execute(_OUTBOX.format(s=f'"{schema}"'))
                await conn.execute(f'ANALYZE "{schema}".runs; ANALYZE "{schema}".terminal_outbox')
                count = await conn.fetchval(f'SELECT count(*) FROM "{schema}".runs')
            async with open_console(dsn=dsn, schema=schema, bind="127.0.0.1:0") as server:
                http = await logged_in(server)
                server_ms(await http.get("/ui/?org=bench"))  # warm: the pool's first connection
                times = []
                for _ in range(20):
                    response = await http.get("/ui/?org=bench")
                    times.append(server_ms(response))
                shown = response.text.count("<tr>") - 1
                await http.aclose()
            print(f"runs page over {count:,} runs ({shown} shown, rows by status from "
                  f"{PLAYS} plays' {PLAY_ROWS:,}-row tables): median "
                  f"{statistics.median(times):.1f} ms, worst {max(times):.1f} ms server time "
                  f"(target <= 50 ms)")
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--parts", default="streaming,runs")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    dsn = bench_dsn()

    async def run_all() -> None:
        if "streaming" in parts:
            await streaming(dsn, args.rows, args.rounds)
        if "runs" in parts:
            await runs_page(dsn, args.runs)

    trio.run(run_all)


if __name__ == "__main__":
    main()
