"""Database sessions through the gateway: `db_sessions.create` bounded by the token, the URL
encrypted to the runner's key, and `open_gateway(..., db_sessions=True)` running engine
operations straight against the database (one mint shared, renewal, HTTP for what a session does
not cover, HTTP for everything when the database is out of reach)."""

from __future__ import annotations

import datetime
import logging
import os
import re
import subprocess
import sys

import httpx
import pytest
import trio

from runplane.engine import PlayScope, RunScope, open_tenant, receipts, runs, sheets
from runplane.engine.sessions import jwe
from runplane.engine.errors import InvalidInputError, ScopeError
from runplane.engine.gateway import create_db_session, mint_token, open_gateway
from runplane.engine.sheets import RowOutcome

from .conftest import fresh_schema
from .gateway_support import FAST_RETRY, SECRET, serving, token_for
from .run_helpers import fact_kinds, outbox_state
from .session_helpers import drop_all_sessions, session_roles
from .sheet_helpers import counters_match
from .test_cli import demo_line
from .test_gateway_cli import runner
from .test_gateway_map import comparable, rows, run_map

# Retiring array inputs deletes facts, which no session may (a DELETE grant would let it LOCK
# the shared table): `array_input.retire` goes over HTTP.
SESSION_ACTIONS = {"sheets.admit", "sheets.complete", "sheets.probe", "array_input.begin",
                   "array_input.put_page", "array_input.put_encoded_page",
                   "array_input.seal", "array_input.read_page", "array_input.get_manifest",
                   "receipts.claim", "receipts.complete"}


@pytest.fixture
async def org(tenant):
    """The test tenant; every session minted on its schema is dropped afterwards."""
    try:
        yield tenant
    finally:
        await drop_all_sessions(tenant)


@pytest.fixture
async def server(org):
    async with serving(org) as server:
        yield server


def sessions_gateway(server, tenant, **claims):
    return open_gateway(server.url, token_for(tenant, **claims), retry=FAST_RETRY, db_sessions=True)


def remaining_s(expires_at: datetime.datetime) -> float:
    return (expires_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()


async def test_create_db_session_answers_a_url_encrypted_to_the_runner_that_works(org, server):
    async with open_gateway(server.url, token_for(org), retry=FAST_RETRY) as gateway:
        session = await create_db_session(gateway, "play", "Things", ["receipts", "rows.read"])
    assert (session.org, session.play, session.table_namespace, session.operations, session.schema) \
        == (org.org_id, "play", "things", ("rows.read", "receipts"), org.schema)
    assert 540 < remaining_s(session.expires_at) <= 600
    run = await runs.register(org, RunScope(org.org_id, "play", "r"))
    async with open_tenant(org.org_id, session.postgres_url, schema=session.schema) as direct:
        assert (await receipts.claim(direct, run, "k")).disposition == "claimed"
    # On the wire: with a public key only the JWE travels, and only that key opens it.
    private, public = jwe.generate_key()
    headers = {"authorization": f"Bearer {token_for(org)}"}
    body = {"play": "play", "table_namespace": "things", "operations": ["receipts"]}
    async with httpx.AsyncClient() as client:
        sealed = (await client.post(f"{server.url}/v1/actions/db_sessions.create",
                                    json={**body, "public_key": public}, headers=headers)).json()["result"]
        plain = (await client.post(f"{server.url}/v1/actions/db_sessions.create",
                                   json=body, headers=headers)).json()["result"]
    assert "postgres_url" not in sealed and plain["postgres_url"].startswith("postgresql://")
    header, url = jwe.decrypt(sealed["encrypted_postgres_url"], private)
    assert header["org"] == org.org_id and header["play"] == "play"
    assert header["expires_at"] == sealed["expires_at"] and url.decode().startswith("postgresql://")
    with pytest.raises(InvalidInputError):
        jwe.decrypt(sealed["encrypted_postgres_url"], jwe.generate_key()[0])


async def test_a_tokens_claims_bound_what_a_session_may_get(org, server):
    async def create(play="play", operations=("receipts",), **claims):
        async with open_gateway(server.url, token_for(org, **claims), retry=FAST_RETRY) as gateway:
            return await create_db_session(gateway, play, "things", operations)

    refused = [
        ({"play": "other", "plays": ["play"]}, "plays claim does not allow play 'other'"),
        ({"operations": ["rows.upsert"], "actions": ["db_sessions.create", "receipts.*"]},
         "actions claim does not allow sheets.admit"),
        ({"actions": ["receipts.*"]}, "actions claim does not allow db_sessions.create"),
    ]
    for options, message in refused:
        with pytest.raises(ScopeError, match=message):
            await create(**options)
    assert await session_roles(org) == []
    allowed = await create(actions=["db_sessions.create", "receipts.*"], plays=["play"], ttl_s=100)
    assert remaining_s(allowed.expires_at) <= 100  # never longer than the token lives
    assert len(await session_roles(org)) == 1


async def test_a_map_over_db_sessions_sends_no_admission_completion_or_page_over_http(org, server):
    source = rows(300)
    direct_run, direct = await run_map(org, "direct", source)
    async with sessions_gateway(server, org) as gateway:
        remote_run, remote = await run_map(gateway, "remote", source)
        assert gateway.db_sessions.disabled is None
    assert not SESSION_ACTIONS & set(server.requests), server.requests
    assert server.requests["db_sessions.create"] >= 1
    for result in (direct, remote):
        assert (result.admitted, result.cached, result.completed, result.failed) == (300, 0, 257, 43)
    stored = {}
    for play, run in (("direct", direct_run), ("remote", remote_run)):
        scope = PlayScope(org.org_id, play)
        stored[play] = await sheets.read_rows(org, scope, "things")
        assert (await counters_match(org, scope, "things"))[0]
        assert await fact_kinds(org, run.run_id) == ["array_input_guard"]
        assert await outbox_state(org, run.run_id) == "done"
    assert comparable(stored["remote"]) == comparable(stored["direct"])
    # A rerun over sessions finds the cache: only the failed rows run again.
    async with sessions_gateway(server, org) as gateway:
        _, again = await run_map(gateway, "remote", source)
    assert (again.cached, again.completed, again.failed) == (257, 0, 43)
    assert not SESSION_ACTIONS & set(server.requests), server.requests


async def test_concurrent_callers_share_one_mint(org, server):
    async with sessions_gateway(server, org) as gateway:
        run = await runs.register(gateway, RunScope(org.org_id, "play", "r"))
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(receipts.claim, gateway, run, f"k{i}")
    assert server.requests["db_sessions.create"] == 1 and "receipts.claim" not in server.requests
    assert len(await receipts.get_many(org, run.scope.play_scope, [f"k{i}" for i in range(10)])) == 10


async def test_a_session_is_renewed_inside_its_last_minute_and_its_old_pool_closed(org, server):
    async with sessions_gateway(server, org) as gateway:
        gateway.db_sessions.ttl_s = 30.0  # every session is inside the renewal window at once
        run = await runs.register(gateway, RunScope(org.org_id, "play", "r"))
        await receipts.claim(gateway, run, "a")
        first = await session_roles(org)
        await receipts.claim(gateway, run, "b")
        assert server.requests["db_sessions.create"] == 2
        old = first[0]
        with trio.fail_after(20):  # the replaced pool is closed: its server processes go away
            while await connections_of(org, old):
                await trio.sleep(0.05)
    assert (await receipts.get(org, run.scope.play_scope, "b")).status == "running"


async def connections_of(tenant, role: str) -> int:
    async with tenant.login_connection() as conn:
        return await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE usename = $1", role)


async def test_a_call_a_session_may_not_run_goes_over_http_and_the_rest_stays_direct(org, server):
    contract = sheets.SheetContract(inputs=("name",), outputs=("score",))
    async with sessions_gateway(server, org) as gateway:
        run = await runs.register(gateway, RunScope(org.org_id, "play", "r"))
        await sheets.ensure_sheet(gateway, run.scope.play_scope, "things", contract)
        admission = await sheets.admit(gateway, run, "things", contract, [{"name": "a"}, {"name": "b"}])
        first, second = (row.key for row in admission.pending)
        # A new output field needs a new column: DDL a session never runs; the gateway does it.
        done = await sheets.complete(gateway, run, "things", contract, [
            RowOutcome(key=first, status="completed", data={"score": 1, "brand_new": 2})])
        assert done.updated == 1 and server.requests["sheets.complete"] == 1
        done = await sheets.complete(gateway, run, "things", contract, [
            RowOutcome(key=second, status="completed", data={"score": 3, "brand_new": 4})])
        assert done.updated == 1 and server.requests["sheets.complete"] == 1
    assert "sheets.admit" not in server.requests
    stored = {row["name"]: row for row in await sheets.read_rows(org, run.scope.play_scope, "things")}
    assert (stored["a"]["brand_new"], stored["b"]["brand_new"]) == (2, 4)


async def test_when_the_database_is_out_of_reach_everything_goes_over_http_with_one_warning(org, caplog):
    caplog.set_level(logging.WARNING, logger="runplane.gateway")
    async with serving(org, session_dsn="postgresql://nobody@127.0.0.1:9/nowhere") as server:
        async with sessions_gateway(server, org) as gateway:
            _, result = await run_map(gateway, "remote", rows(40))
            assert gateway.db_sessions.disabled is not None
    assert (result.admitted, result.completed + result.failed) == (40, 40)
    assert server.requests["sheets.admit"] >= 1 and server.requests["db_sessions.create"] == 1
    warnings = [r for r in caplog.records if "database sessions off" in r.getMessage()]
    assert len(warnings) == 1 and "127.0.0.1:9" in warnings[0].getMessage()


@pytest.fixture
def serve_process(dsn):
    """`runplane serve` in a child process over a fresh schema; yields (URL, schema). Its
    sessions and schema are dropped afterwards."""
    schema = fresh_schema()
    env = {**os.environ, "RUNPLANE_GATEWAY_SECRET": SECRET, "RUNPLANE_DSN": dsn}
    child = subprocess.Popen(
        [sys.executable, "-m", "runplane.cli", "serve", "--bind", "127.0.0.1:0", "--schema", schema],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + child.stderr.read()
        yield match.group(1), schema
    finally:
        child.terminate()
        child.wait(timeout=30)

        async def drop():
            async with open_tenant("local", dsn, schema=schema) as tenant:
                await drop_all_sessions(tenant)
                async with tenant.login_connection() as conn:
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

        trio.run(drop)


def test_the_main_job_runs_over_db_sessions_from_the_command_line(serve_process, tmp_path, dsn):
    url, schema = serve_process
    token = mint_token(SECRET, "local", plays=["demo"])
    args = ["demo", "--rows", "300", "--fail-rate", "0.05", "--latency-ms", "0", "--db-sessions"]
    first = runner(args, url, token, tmp_path)
    assert first.returncode == 0, first.stderr
    done = demo_line(first.stdout)
    assert done["admitted"] == 300 and done["completed"] + done["failed"] == 300
    second = runner(args, url, token, tmp_path)
    assert second.returncode == 0, second.stderr
    assert demo_line(second.stdout)["cached"] == done["completed"]
    assert "database sessions off" not in first.stderr + second.stderr

    async def minted() -> list:
        async with open_tenant("local", dsn, schema=schema) as tenant:
            async with tenant.login_connection() as conn:
                return list(await conn.fetch(
                    f'SELECT play, table_namespace FROM "{schema}".session_scopes'))

    assert {tuple(row) for row in trio.run(minted)} == {("demo", "companies")}
    refused = runner(["status", "demo", "--db-sessions"], "", token, tmp_path)
    assert refused.returncode == 2 and "--db-sessions needs --gateway" in refused.stderr
