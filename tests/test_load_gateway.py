"""Load: one gateway (`runplane serve`, a child process) serves a hundred orgs at once inside
the server's connection budget (issue 43, SPEC §35): 100 orgs × 500 rows, each org's runner
a trio task here with its own token; every runner finishes, every row is accounted for, and
nothing anywhere says `too many clients`.

The embedded test server keeps its default `max_connections` (238 with the default session
budget: `engine.sessions.limits.ConnectionPlan`), so the gateway's default budget is 50
connections, or 6 a core of this machine when that is fewer (the server is local): far fewer
than 100 orgs, which wait in its line. Marked `load` (long: run once)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import PlayScope, open_tenant, sheets
from runplane.engine.gateway import RetryPolicy, mint_token, open_gateway

pytestmark = pytest.mark.load

SECRET = "load-gateway-secret-" + "x" * 24
ORGS, ROWS, PLAY, TABLE = 100, 500, "load", "rows"
CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))
RETRY = RetryPolicy(unreachable_budget_s=120.0, completion_total_s=180.0)


async def upper(row: dict) -> dict:
    return {"upper": row["name"].upper()}


async def one_org(url: str, org: str, results: dict) -> None:
    async with open_gateway(url, mint_token(SECRET, org), retry=RETRY) as gateway:
        async with open_run(gateway, PLAY, f"run-{org}") as run:
            rows = [{"name": f"{org}-{i}"} for i in range(ROWS)]
            result = await run.map(TABLE, rows, upper, contract=CONTRACT, concurrency=16)
    results[org] = result.completed


async def test_a_hundred_orgs_through_one_gateway_within_its_connection_budget(dsn, tenant):
    env = {**os.environ, "RUNPLANE_GATEWAY_SECRET": SECRET, "RUNPLANE_DSN": dsn}
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "runplane.cli", "serve", "--bind", "127.0.0.1:0",
             "--schema", tenant.schema, "--log-interval", "2"],
            env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line = await trio.to_thread.run_sync(child.stdout.readline)
            match = re.search(r"listening on (http://\S+)", line)
            assert match, line
            results: dict[str, int] = {}
            with trio.fail_after(240):
                async with trio.open_nursery() as nursery:
                    for i in range(ORGS):
                        nursery.start_soon(one_org, match.group(1), f"org-{i:03d}", results)
        finally:
            child.terminate()
            await trio.to_thread.run_sync(child.wait, 30)
        log.seek(0)
        stderr = log.read()
    assert results == {f"org-{i:03d}": ROWS for i in range(ORGS)}
    for i in range(0, ORGS, 9):  # every row accounted for, in the database itself
        async with open_tenant(f"org-{i:03d}", dsn, schema=tenant.schema) as org:
            summary = await sheets.summary(org, PlayScope(org.org_id, PLAY), TABLE)
        assert (summary.total, summary.completed) == (ROWS, ROWS), summary
    assert "too many clients" not in stderr and "53300" not in stderr, stderr[-3000:]
    budget = re.search(r"connection budget for \S+: (\d+)", stderr)
    assert budget and int(budget.group(1)) < ORGS, stderr[-3000:]  # so orgs had to queue
    in_use = [int(n) for n in re.findall(r"connections (\d+)/\d+, \d+ orgs waiting", stderr)]
    assert in_use and max(in_use) <= int(budget.group(1)), stderr[-3000:]
    print("\n".join(line for line in stderr.splitlines() if "connections" in line))
