"""Through a real transaction-mode PgBouncer (`tests/pooler_support.py`): every capability works
with `RUNPLANE_POOLER=transaction` (here `?pooler=transaction` in the DSN), a pooler restarted
mid-map is ridden out, and without the setting the pooler's symptom is one line naming it."""

from __future__ import annotations

import re

import httpx
import pytest
import trio

from runplane.actors import open_run
from runplane.engine import open_tenant
from runplane.engine.console.serve import open_console
from runplane.engine.gateway import open_gateway, open_server
from runplane.engine.sheets import SheetContract

from .cli_helpers import cli_env, run_cli, start_cli, wait_for_text, write_play
from .conftest import fresh_schema
from .gateway_support import FAST_RETRY, SECRET, token_for
from .plays.scale_play import tag_pid
from .pooler_support import bouncer  # noqa: F401  (a fixture)
from .sheet_helpers import counters_match, play_scope


async def exact(tenant, namespace: str) -> None:
    ok, detail = await counters_match(tenant, play_scope(tenant, "play"), namespace)
    assert ok, detail

pytestmark = pytest.mark.pooler

CONTRACT = SheetContract(inputs=("n",), outputs=("double",))
SHARED = SheetContract(inputs=("n",), outputs=("pid", "double"))


async def double(row):
    await trio.sleep(0)
    return {"double": row["n"] * 2}


async def _drop(dsn, schema):
    async with open_tenant("org-test", dsn, schema=schema) as tenant:
        async with tenant.connection("sheet") as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_without_the_setting_the_pooler_is_named_in_one_line(bouncer):
    done = run_cli("demo", "--rows", "50", "--schema", fresh_schema(),
                   env=cli_env(RUNPLANE_DSN=bouncer.plain_dsn))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "RUNPLANE_POOLER=transaction" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and "Future exception" not in done.stderr


def test_the_demo_its_rerun_and_export_through_the_pooler(bouncer, dsn):
    schema = fresh_schema()
    env = cli_env(RUNPLANE_DSN=bouncer.dsn)
    try:
        first = run_cli("demo", "--rows", "2000", "--schema", schema, env=env)
        assert first.returncode == 0, first.stderr
        done = re.search(r"admitted 2000 cached 0 executed 2000 completed (\d+) failed (\d+)",
                         first.stdout)
        assert done, first.stdout
        again = run_cli("demo", "--rows", "2000", "--schema", schema, env=env)
        assert again.returncode == 0, again.stderr
        # The rerun reuses every completed row and calls the failed ones again.
        assert f"admitted 2000 cached {done[1]} executed {done[2]}" in again.stdout, again.stdout
        exported = run_cli("export", "demo", "companies", "--schema", schema, "--format", "jsonl",
                           env=env)
        assert exported.returncode == 0, exported.stderr
        assert len(exported.stdout.splitlines()) == 2000
        assert "Future exception" not in first.stderr + again.stderr + exported.stderr
    finally:
        trio.run(_drop, dsn, schema)


def test_a_run_killed_through_the_pooler_resumes_and_finishes(bouncer, dsn, tmp_path):
    schema = fresh_schema()
    play, rows = write_play(tmp_path, ["a", "bb", "ccc", "dddd"])
    log = tmp_path / "run.log"
    proc = start_cli("run", str(play), "--input", str(rows), "--schema", schema,
                     stdout_path=log, env=cli_env(RUNPLANE_DSN=bouncer.dsn, PLAY_HOLD="1"))
    try:
        content = wait_for_text(log, "held", proc)
    finally:
        proc.kill()
        proc.wait()
    try:
        run_id = re.search(r"--run-id (\S+)", content).group(1)
        resumed = run_cli("run", str(play), "--input", str(rows), "--schema", schema,
                          "--run-id", run_id, env=cli_env(RUNPLANE_DSN=bouncer.dsn))
        assert resumed.returncode == 0, resumed.stderr
        assert "admitted 4, cached 4, completed 0, failed 0" in resumed.stdout, resumed.stdout
    finally:
        trio.run(_drop, dsn, schema)


async def test_maps_reruns_and_two_local_workers_through_the_pooler(bouncer, dsn):
    schema = fresh_schema()
    rows = [{"n": i} for i in range(3000)]
    try:
        async with open_tenant("org-test", bouncer.dsn, schema=schema) as tenant:
            assert tenant.outer_transaction
            async with open_run(tenant, "play") as run:
                result = await run.map("nums", rows, double, contract=CONTRACT, concurrency=16)
            assert (result.completed, result.failed) == (3000, 0)
            async with open_run(tenant, "play") as run:
                again = await run.map("nums", rows, double, contract=CONTRACT)
            assert (again.cached, again.executed) == (3000, 0)
            await exact(tenant, "nums")
            async with open_run(tenant, "play") as run:  # workers find `tag_pid` by name
                shared = await run.map("shared", rows[:1000], tag_pid, contract=SHARED,
                                       workers=2)
            assert (shared.completed, shared.failed) == (1000, 0)
            await exact(tenant, "shared")
    finally:
        await _drop(dsn, schema)


async def test_a_pooler_restarted_mid_map_is_ridden_out(bouncer, dsn):
    schema = fresh_schema()
    rows = [{"n": i} for i in range(3000)]
    calls: dict[int, int] = {}
    restarted = trio.Event()

    async def slow(row):
        calls[row["n"]] = calls.get(row["n"], 0) + 1
        await trio.sleep(0.002)
        return {"double": row["n"] * 2}

    async def restart_when_started():
        while len(calls) < 500:
            await trio.sleep(0.01)
        await trio.to_thread.run_sync(bouncer.restart)
        restarted.set()

    try:
        async with open_tenant("org-test", bouncer.dsn, schema=schema) as tenant:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(restart_when_started)
                async with open_run(tenant, "play") as run:
                    result = await run.map("nums", rows, slow, contract=CONTRACT, concurrency=8)
            assert restarted.is_set()
            assert (result.completed + result.cached, result.failed) == (3000, 0)
            await exact(tenant, "nums")
            # Every row was computed; a call whose write the restart lost runs again, no more.
            assert len(calls) == 3000 and sum(calls.values()) - 3000 <= 8 * 2
    finally:
        await _drop(dsn, schema)


async def test_the_gateway_and_the_console_over_the_pooler(bouncer, dsn):
    schema = fresh_schema()
    try:
        async with open_server(secret=SECRET, dsn=bouncer.dsn, schema=schema) as server:
            async with open_tenant("org-test", dsn, schema=schema) as direct:
                token = token_for(direct)
            async with open_gateway(server.url, token, retry=FAST_RETRY) as gateway:
                async with open_run(gateway, "play") as run:
                    result = await run.map("nums", [{"n": i} for i in range(500)], double,
                                           contract=CONTRACT)
            assert result.completed == 500
        async with open_console(dsn=bouncer.dsn, schema=schema, bind="127.0.0.1:0") as console:
            async with httpx.AsyncClient(base_url=console.url, follow_redirects=True) as client:
                login = await client.get(console.login_url())
                assert login.status_code == 200, login.text
                page = await client.get("/ui/")
                assert page.status_code == 200, page.text[:500]
                runs = (await client.get("/ui/api/runs")).json()["runs"]
                assert [run["play"] for run in runs] == ["play"], runs
    finally:
        await _drop(dsn, schema)
