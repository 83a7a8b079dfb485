"""Many servers, processes that follow their org (docs/guide/operations.md, "Many servers"): a
tenant placed by the tenants file, `runplane run --tenants` and `runplane console --tenants` on
direct connections, and a runner over database sessions, each across a move of its org from
one real embedded server to another, without a restart."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import PlayScope, open_tenant, sheets
from runplane.engine.errors import StoreUnavailableError
from runplane.engine.gateway import ServerOptions, mint_token, open_gateway, open_server
from runplane.engine.placement import load_tenants_file
from runplane.engine.placement.control import MoveStep
from runplane.engine.placement.move import MoveRequest, move_org
from runplane.engine.placement.router import open_router

from .cli_helpers import RUNPLANE, ROOT, cli_env
from .conftest import fresh_schema
from .gateway_support import FAST_RETRY, SECRET
from .many_servers_support import assert_moved_rows, drain, read_until, tenants_toml
from .sheet_helpers import counters_match

CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("upper",))


async def _server_id(tenant) -> str:
    async with tenant.connection("receipts") as conn:
        return await conn.fetchval("SELECT current_setting('data_directory')")


async def test_a_placed_tenant_follows_its_org_connection_by_connection(dsn, second_dsn,
                                                                       tmp_path):
    """A tenant opened under `placed`: after the move (once its router polled), its pooled
    connection to server 1 is closed, new ones reach server 2, it reads server 2's lock
    material, and a lost COMMIT's fate is never read on the other server."""
    from runplane.engine.placement.following import placed

    schema, org = fresh_schema(), f"p{uuid.uuid4().hex[:10]}"
    path = tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn}, {org: "s1"}, schema)
    async with open_tenant(org, second_dsn, schema=schema) as on_s2:  # its own lock secret
        there, secret_there = await _server_id(on_s2), on_s2.lock_secret
    async with open_router(path, poll_s=0.05) as router:
        with placed(router, org):
            async with open_tenant(org, schema=schema) as tenant:
                here, opened_on = await _server_id(tenant), tenant.dsn
                assert opened_on == dsn and here != there and len(tenant._idle) == 1
                # local workers (`run --workers N`) are given the file, so they follow it too
                from runplane.actors.shared.coordinator import worker_environment
                assert tenant.settings.tenants_file == os.path.abspath(path)
                assert worker_environment(tenant)["RUNPLANE_TENANTS"] == os.path.abspath(path)
                assert tenant.lock_secret not in (None, secret_there)  # each server its own
                await move_org(router.file, MoveRequest(org, to="s2"))
                await router.wait_for_poll()
                assert await _server_id(tenant) == there and tenant.dsn == second_dsn
                assert len(tenant._idle) == 1 and tenant.lock_secret == secret_there
                assert tenant.route.moves == 1
                with pytest.raises(StoreUnavailableError):  # its xid means nothing on s2
                    await tenant.commit_status("1234", on=opened_on)
                async with tenant.connection("receipts") as conn:
                    xid = await conn.fetchval("SELECT txid_current()::text")
                assert await tenant.commit_status(xid, on=second_dsn) == "committed"


# A play whose row 150 is in its call across a whole move: it says "midway" and waits for a
# line on stdin (the test sends it once the org is fenced).
HELD_PLAY = """
import sys

import trio

from runplane.engine.sheets import SheetContract

PLAY = "p"
CONTRACT = SheetContract(inputs=("name", "n"), outputs=("upper",))


async def enrich(row):
    if row["n"] == 150:
        print("midway", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
    return {"upper": row["name"].upper()}


async def play(run, rows):
    return await run.map("things", [{"name": f"r{i}", "n": i} for i in range(300)], enrich,
                         contract=CONTRACT, concurrency=8)
"""


async def test_a_direct_run_follows_its_org_to_another_server_while_it_runs(dsn, second_dsn,
                                                                            tmp_path):
    """`runplane run --tenants F --org A` on a direct connection: A moves from server 1 to 2
    while a row is in its call; the run's writes meet the fence, ride it, and land on server 2,
    where the same process finishes the run (no restart)."""
    schema, org = fresh_schema(), f"f{uuid.uuid4().hex[:10]}"
    path = tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn}, {org: "s1"}, schema)
    play = tmp_path / "held_play.py"
    play.write_text(HELD_PLAY)
    env = {k: v for k, v in cli_env().items() if not k.startswith("RUNPLANE_")}
    env["RUNPLANE_OUTAGE_BUDGET_S"] = "20"  # without following, the run would end after it
    out, err = bytearray(), bytearray()
    proc = await trio.lowlevel.open_process(
        [*RUNPLANE, "run", str(play), "--no-input", "--tenants", path, "--org", org],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        async with trio.open_nursery() as tasks:
            tasks.start_soon(drain, proc.stderr, err)
            await read_until(proc.stdout, b"midway", out)

            async def release_when_fenced(step: MoveStep) -> None:
                if step is MoveStep.COPY:  # fenced: row 150's completion meets the fence
                    await proc.stdin.send_all(b"go\n")

            report = await move_org(load_tenants_file(path), MoveRequest(org, to="s2"),
                                    on_step=release_when_fenced)
            tasks.start_soon(drain, proc.stdout, out)
            assert await proc.wait() == 0, (bytes(out), bytes(err))
    finally:
        if proc.returncode is None:
            proc.kill()
    assert report.rows["runs"] == 1 and b"admitted 300" in out, bytes(out)
    async with open_tenant(org, second_dsn, schema=schema) as moved:
        await assert_moved_rows(moved, org)
        async with moved.connection("receipts") as conn:  # one run: the process never restarted
            assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".runs'
                                       " WHERE org_id = $1", org) == 1
    async with open_tenant(org, dsn, schema=schema) as source:  # the fence kept server 1 as
        left = await sheets.summary(source, PlayScope(org, "p"), "things")  # it was copied
        assert left.total == 300 and left.completed < 300


async def _one_run(dsn: str, schema: str, org: str) -> str:
    async with open_tenant(org, dsn, schema=schema) as tenant:
        async with open_run(tenant, "p") as run:
            await run.map("things", [{"name": "x", "n": 1}], _upper, contract=CONTRACT)
            return run.run_id


async def _upper(row: dict) -> dict:
    return {"upper": row["name"].upper()}


async def test_the_local_console_follows_its_org_to_another_server(dsn, second_dsn, tmp_path):
    """`runplane console --tenants F --org A` serves A's server, and after A moves, the same
    process shows what A writes on the new one (its pooled connections to the old closed)."""
    import httpx

    schema, org = fresh_schema(), f"k{uuid.uuid4().hex[:10]}"
    path = tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn}, {org: "s1"}, schema)
    before = await _one_run(dsn, schema, org)
    env = {k: v for k, v in cli_env().items() if not k.startswith("RUNPLANE_")}
    proc = await trio.lowlevel.open_process(
        [*RUNPLANE, "console", "--tenants", path, "--org", org, "--bind", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        out = bytearray()
        await read_until(proc.stdout, b"once=", out)
        await read_until(proc.stdout, b"\n", out)  # the whole link line
        link = out.decode().split()[-1]
        async with httpx.AsyncClient(base_url=link.split("/ui/")[0], trust_env=False) as http:
            assert (await http.get(link)).status_code == 303
            assert before in (await http.get("/ui/")).text
            await move_org(load_tenants_file(path), MoveRequest(org, to="s2"))
            after = await _one_run(second_dsn, schema, org)  # on server 2 only
            with trio.fail_after(30):
                while after not in (page := (await http.get("/ui/")).text):
                    await trio.sleep(0.1)  # polls the page until its router polled
            assert before in page  # copied with the org
    finally:
        proc.kill()
        await proc.wait()


async def test_a_session_runner_mints_its_sessions_again_on_the_target(dsn, second_dsn,
                                                                      tmp_path):
    """A runner over database sessions (`db_sessions=True`): the move ends A's sessions on
    server 1; the runner mints new ones, through the routed gateway, on server 2, and its map
    finishes there over them."""
    from .session_helpers import drop_all_sessions, session_roles

    schema, org = fresh_schema(), f"s{uuid.uuid4().hex[:10]}"
    path = tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn}, {org: "s1"}, schema)
    midway, go = trio.Event(), trio.Event()

    async def enrich(row: dict) -> dict:
        if row["n"] == 150:
            midway.set()
            await go.wait()
        return {"upper": row["name"].upper()}

    async def at_step(step: MoveStep) -> None:
        if step is MoveStep.COPY:  # fenced, its sessions ended: the held row completes now
            go.set()

    try:
        await _map_over_sessions_across_a_move(path, org, enrich, at_step, midway)
        async with open_tenant(org, second_dsn, schema=schema) as moved:
            assert await session_roles(moved)  # minted on server 2
            summary = await sheets.summary(moved, PlayScope(org, "p"), "things")
            assert (summary.total, summary.completed) == (300, 300)
            assert (await counters_match(moved, PlayScope(org, "p"), "things"))[0]
    finally:
        for server_dsn in (dsn, second_dsn):
            async with open_tenant(org, server_dsn, schema=schema) as tenant:
                await drop_all_sessions(tenant)


async def _map_over_sessions_across_a_move(path, org, enrich, at_step, midway) -> None:
    async with open_router(path, poll_s=0.1) as router:
        async with open_server(secret=SECRET, options=ServerOptions(), router=router) as server:
            async with open_gateway(server.url, mint_token(SECRET, org), retry=FAST_RETRY,
                                    db_sessions=True) as gateway:
                results: list = []

                async def run_map() -> None:
                    async with open_run(gateway, "p") as run:
                        results.append(await run.map(
                            "things", [{"name": f"r{i}", "n": i} for i in range(300)],
                            enrich, contract=CONTRACT, concurrency=8))

                async with trio.open_nursery() as tasks:
                    tasks.start_soon(run_map)
                    await midway.wait()
                    minted_before = gateway.db_sessions.mints
                    await move_org(router.file, MoveRequest(org, to="s2"), on_step=at_step)
                sessions_router = gateway.db_sessions
                assert sessions_router.disabled is None, sessions_router.disabled
                assert sessions_router.mints > minted_before >= 1
    (result,) = results
    assert (result.admitted, result.completed, result.failed) == (300, 300, 0)
