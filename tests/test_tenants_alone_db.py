"""Tenants alone, round two, in the database: advisory keys, the server's connection budget and
the vacuum horizon (docs/guide/operations.md, "A database session").

Each attack is plain SQL run over a real minted session URL against the real server.
"""

from __future__ import annotations

import contextlib
import functools
import os

import httpx
import pytest
import trio

from runplane.actors import open_run
from runplane.engine import open_tenant, sessions
from runplane.engine import lock_keys
from runplane.engine.errors import StoreUnavailableError
from runplane.engine.gateway import mint_token
from runplane.engine.sessions.limits import ConnectionPlan, SessionTimeouts
from runplane.engine.sessions.sweep import end_overdue
from runplane.engine.values.scopes import PlayScope
from runplane.engine.sheets import SheetContract
from runplane.engine.sql import qualified

from .conftest import fresh_schema
from .gateway_support import SECRET, serving
from .session_helpers import (
    NAMESPACE, admin_tenant, seed, session_roles, session_tenant, unique,
)

CONTRACT = SheetContract(inputs=("name",), outputs=("upper",))

_ADVISORY_KEYS = """
SELECT coalesce(array_agg(DISTINCT ((classid::bigint << 32) | objid::bigint)), '{}')
  FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND pid <> pg_catalog.pg_backend_pid()
"""


async def _upper(row):
    await trio.sleep(0)
    return {"upper": row["name"].upper()}


# -- advisory keys ------------------------------------------------------------------------------
async def test_a_session_holding_every_advisory_key_it_sees_stalls_no_other_orgs_map(dsn):
    """The probe: read held keys from `pg_locks` with a `rows.read` session, take each with
    `pg_advisory_lock`, hold them. Another org's 4,000-row map must finish regardless, and no
    key of runplane's is ever there to see."""
    victim_org, attacker_org = unique("victim"), unique("attacker")
    async with admin_tenant(dsn, victim_org) as victim:
        await seed(victim, "play")
        async with open_tenant(attacker_org, dsn, schema=victim.schema) as attacker_admin:
            scope = PlayScope(attacker_org, "play")
            await seed(attacker_admin, "play")
            minted = await sessions.mint(attacker_admin, scope, NAMESPACE, ["rows.read"])
        seen: set[int] = set()

        async def hold(session, key: int) -> None:
            async with session.login_connection() as conn:
                await conn.fetchval("SELECT pg_advisory_lock($1::bigint)", key)
                await trio.sleep_forever()

        async with session_tenant(dsn, minted, max_connections=8) as session:
            async with trio.open_nursery() as attacks:
                async def watch() -> None:
                    async with session.login_connection() as conn:
                        while len(seen) < 6:
                            for key in await conn.fetchval(_ADVISORY_KEYS):
                                if key not in seen:
                                    seen.add(key)
                                    attacks.start_soon(hold, session, key)
                            await trio.sleep(0.001)

                attacks.start_soon(watch)
                with trio.fail_after(120):  # a stall holds the map for as long as the session likes
                    async with open_run(victim, "play") as run:
                        result = await run.map("t", [{"name": f"r{i}"} for i in range(4_000)],
                                               _upper, contract=CONTRACT, concurrency=16)
                attacks.cancel_scope.cancel()
        assert result.completed == 4_000
        assert seen == set(), "runplane's own statements held advisory keys a session could see"


async def test_a_session_holding_the_bootstraps_former_keys_holds_no_open_off(dsn):
    """The schema's bootstrap (every open under an execution role, every repair) once took an
    advisory key a session could see in `pg_locks`; it now locks the `meta` table, which a
    session cannot lock in a conflicting mode."""
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        minted = await sessions.mint(admin, seeded["scope"], NAMESPACE, ["rows.read"])
        async with admin.login_connection() as conn:
            secret = await conn.fetchval(
                f"SELECT secret FROM {qualified(admin.schema, lock_keys.LOCK_SECRET_TABLE)}")
        keys = [lock_keys.derive_lock_key(secret, "runplane.bootstrap", admin.schema)]
        async with session_tenant(dsn, minted) as session:
            async with session.login_connection() as conn:
                await conn.fetchval("SELECT hashtextextended($1, 0)", "x")  # a live login
                for key in keys:
                    await conn.fetchval("SELECT pg_advisory_lock($1::bigint)", key)
                with trio.fail_after(60):
                    await admin.repair_schema()
                    async with open_tenant(unique("other"), dsn, schema=admin.schema) as other:
                        await seed(other, "play")
                await conn.fetchval("SELECT pg_advisory_unlock_all()")


async def test_runplane_takes_no_advisory_lock_while_it_writes_or_bootstraps(dsn):
    """Watched from a connection of its own: a map, a rerun and a schema repair hold no
    advisory lock at any moment (whatever a session could see, it could take)."""
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seen: set[int] = set()
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                async with admin.login_connection() as conn:
                    while True:
                        seen.update(await conn.fetchval(_ADVISORY_KEYS))
                        await trio.sleep(0)

            nursery.start_soon(watch)
            rows = [{"name": f"r{i}"} for i in range(2_000)]
            for _ in range(2):
                async with open_run(admin, "play") as run:
                    await run.map("t", rows, _upper, contract=CONTRACT, force=True)
            await admin.repair_schema()
            nursery.cancel_scope.cancel()
        assert seen == set()


# -- the vacuum horizon -------------------------------------------------------------------------
SHORT = SessionTimeouts(statement_s=2.0, lock_s=1.0, idle_s=1.0)  # the roles' 60 s, shortened


async def _sweeping(admin):
    """The sweep as the gateway runs it, with short limits and intervals."""
    return functools.partial(sessions.sweep_expired, admin, interval_s=60.0,
                             overdue_interval_s=0.1, timeouts=SHORT)


async def _backends_of(admin, role: str) -> int:
    async with admin.login_connection() as conn:
        return await conn.fetchval(
            "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE usename = $1", role)


@pytest.mark.parametrize("keep_alive", [False, True], ids=["idle", "statement-now-and-then"])
async def test_a_session_that_lifts_its_own_limits_still_loses_its_snapshot(dsn, keep_alive):
    """The probe: `SET idle_in_transaction_session_timeout = 0`, a REPEATABLE READ snapshot,
    then hold it (or keep it alive with a statement now and then): the sweep ends the backend
    past the role's limits, so other orgs' dead rows become removable again."""
    victim_org, attacker_org = unique("victim"), unique("attacker")
    async with admin_tenant(dsn, victim_org) as victim:
        await seed(victim, "play")
        async with open_tenant(attacker_org, dsn, schema=victim.schema) as attacker_admin:
            scope = PlayScope(attacker_org, "play")
            await seed(attacker_admin, "play")
            minted = await sessions.mint(attacker_admin, scope, NAMESPACE, ["rows.read"])
        async with session_tenant(dsn, minted) as session:
            with pytest.raises(StoreUnavailableError):
                async with session.login_connection() as conn:
                    for name in ("idle_in_transaction_session_timeout", "statement_timeout",
                                 "lock_timeout"):
                        await conn.execute(f"SET {name} = 0")
                    await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                    await conn.fetch(f"SELECT * FROM {qualified(victim.schema, 'sheet_summary')}")
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(await _sweeping(victim))
                        with trio.fail_after(30):
                            while await _backends_of(victim, minted.role):
                                if keep_alive:
                                    await conn.fetchval("SELECT 1")
                                await trio.sleep(0.3)
                        nursery.cancel_scope.cancel()
                    await conn.fetchval("SELECT 1")  # the connection is gone
        async with victim.login_connection() as conn:
            assert await conn.fetchval(
                "SELECT count(*) FROM pg_catalog.pg_stat_activity"
                " WHERE usename = $1 AND backend_xmin IS NOT NULL", minted.role) == 0


async def test_the_overdue_sweep_leaves_sessions_within_their_limits_alone(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        minted = await sessions.mint(admin, seeded["scope"], NAMESPACE, ["rows.read"])
        async with session_tenant(dsn, minted) as session:
            async with session.login_connection() as conn:
                for _ in range(3):
                    async with conn.transaction():
                        await conn.fetchval("SELECT 1")
                    assert await end_overdue(admin, SHORT) == 0
                    await trio.sleep(0.5)  # idle (not in a transaction) past the idle limit
                assert await conn.fetchval("SELECT 1") == 1


# -- the server's connection budget -------------------------------------------------------------
async def test_the_embedded_server_keeps_room_for_sessions_runplane_and_owner_logins(dsn):
    """Sessions at the server-wide budget, runplane's own processes and a superuser reserve all
    fit in the embedded server's connections (was: 100, which three orgs' sessions filled)."""
    if os.environ.get("RUNPLANE_TEST_DSN"):
        pytest.skip("sizes only the embedded server; RUNPLANE_TEST_DSN points elsewhere")
    plan = ConnectionPlan.from_environment()
    assert plan.max_connections >= plan.sessions * sessions.DEFAULT_CONNECTION_LIMIT + plan.reserve
    async with open_tenant(unique("org"), dsn, schema=fresh_schema()) as tenant:
        async with tenant.login_connection() as conn:
            assert int(await conn.fetchval("SHOW max_connections")) >= plan.max_connections
            assert int(await conn.fetchval("SHOW superuser_reserved_connections")) >= plan.reserve
            await conn.execute(f'DROP SCHEMA IF EXISTS "{tenant.schema}" CASCADE')


async def test_minting_past_the_server_wide_session_budget_answers_429_and_the_gateway_serves_on(
        dsn, monkeypatch):
    orgs = [unique(f"org{i}") for i in range(4)]
    async with admin_tenant(dsn, orgs[0]) as admin:
        async with admin.login_connection() as conn:
            live = await conn.fetchval(
                "SELECT count(*) FROM pg_catalog.pg_auth_members AS am"
                " JOIN pg_catalog.pg_roles AS g ON g.oid = am.roleid AND g.rolname = $1"
                " JOIN pg_catalog.pg_roles AS r ON r.oid = am.member"
                " WHERE r.rolvaliduntil > clock_timestamp()", sessions.GROUP)
        monkeypatch.setenv("RUNPLANE_SESSIONS_PER_SERVER", str(live + 3))
        for org in orgs:
            async with open_tenant(org, dsn, schema=admin.schema) as tenant:
                await seed(tenant, "play")
        body = {"play": "play", "table_namespace": NAMESPACE, "operations": ["rows.read"]}
        async with serving(admin) as server, httpx.AsyncClient(timeout=30) as client:
            def post(org, action, payload):
                return client.post(f"{server.url}/v1/actions/{action}", json=payload,
                                   headers={"authorization": f"Bearer {mint_token(SECRET, org)}"})

            minted = []
            for org in orgs[:3]:  # one session each: three orgs, well under their own caps
                answer = await post(org, "db_sessions.create", body)
                assert answer.status_code == 200, answer.text
                minted.append((org, answer.json()["result"]["postgres_url"]))
            refused = await post(orgs[3], "db_sessions.create", body)
            assert refused.status_code == 429, refused.text
            assert refused.json()["code"] == "too_many_sessions"
            assert "the server already holds" in refused.text
            assert len(await session_roles(admin)) == 3  # nothing was minted
            # Every minted session at its connection limit: the gateway still serves the fourth.
            async with contextlib.AsyncExitStack() as held:
                for org, url in minted:
                    session = await held.enter_async_context(open_tenant(
                        org, url, schema=admin.schema,
                        max_connections=sessions.DEFAULT_CONNECTION_LIMIT))
                    for _ in range(sessions.DEFAULT_CONNECTION_LIMIT):
                        conn = await held.enter_async_context(session.login_connection())
                        assert await conn.fetchval("SELECT 1") == 1
                answer = await post(orgs[3], "sheets.summary", {
                    "scope": {"org_id": orgs[3], "play": "play"}, "table_namespace": NAMESPACE})
                assert answer.status_code == 200, answer.text
