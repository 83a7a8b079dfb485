"""Database sessions: limits (checked before any write, recorded with the session, enforced by
the runner's router, which sends work past a limit over HTTP), the write-mode operations
`rows.append` and `rows.replace`, and reads by run over a session (the reuse membership, never
another org's)."""

from __future__ import annotations

import pytest

from runplane.engine import sessions, sheets
from runplane.engine.errors import InsufficientPrivilegeError, InvalidInputError
from runplane.engine.gateway import create_db_session, open_gateway
from runplane.engine.values.scopes import PlayScope
from runplane.engine.sessions.limits import SessionLimits, recorded_limits
from runplane.engine.sheets import RowOutcome, SheetContract
from runplane.engine.sql import qualified

from .gateway_support import FAST_RETRY, serving, token_for
from .session_helpers import admin_tenant, drop_all_sessions, session_roles, session_tenant, unique
from .sheet_helpers import new_run, play_scope

CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
NS = "limited"


@pytest.fixture
async def org(tenant):
    try:
        yield tenant
    finally:
        await drop_all_sessions(tenant)


@pytest.fixture
async def server(org):
    async with serving(org) as server:
        yield server


def sessions_gateway(server, tenant, limits=None):
    return open_gateway(server.url, token_for(tenant), retry=FAST_RETRY, db_sessions=True,
                        session_limits=limits)


async def sheet_of(tenant, rows: int, run_id: str = "r1"):
    """A sheet of `rows` rows (all enriched) written directly; its run."""
    run = await new_run(tenant, "play", run_id)
    await sheets.ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    for start in range(0, rows, 5_000):
        admitted = await sheets.admit(tenant, run, NS, CONTRACT, [
            {"name": f"n{i}"} for i in range(start, min(rows, start + 5_000))], input_offset=start)
        await sheets.complete(tenant, run, NS, CONTRACT, [
            RowOutcome(row.key, "completed", {"score": 1}) for row in admitted.pending])
    return run


# -- limits: checked, recorded, answered --------------------------------------------------------
BAD_LIMITS = [({"max_rows": 9_999}, "max_rows"), ({"max_rows": True}, "max_rows"),
              ({"max_requests": 0}, "max_requests"), ({"max_bytes": -1}, "max_bytes"),
              ({"rows": 10_000}, "unknown"), ("10000", "limits must be an object")]


async def test_limits_are_checked_before_any_write(org, server):
    scope = PlayScope(org.org_id, "play")
    for bad, word in BAD_LIMITS:
        with pytest.raises(InvalidInputError, match=word):
            await sessions.mint(org, scope, NS, ["rows.read"], limits=bad)
        with pytest.raises(InvalidInputError, match=word):
            async with sessions_gateway(server, org, bad):
                pass
    async with open_gateway(server.url, token_for(org), retry=FAST_RETRY) as gateway:
        for bad, word in BAD_LIMITS[:5]:  # refused by the gateway too (sent as they are)
            with pytest.raises(InvalidInputError, match=word):
                await sessions.create(gateway, "play", NS, ["rows.read"], limits=bad)
    assert await session_roles(org) == []
    async with org.login_connection() as conn:  # not even the sheet a mint would create
        assert await conn.fetchval(
            f"SELECT count(*) FROM {qualified(org.schema, 'sheet_summary')}") == 0


async def test_limits_are_recorded_with_the_session_and_answered(org, server):
    scope = PlayScope(org.org_id, "play")
    minted = await sessions.mint(org, scope, NS, ["rows.read"],
                                 limits={"max_rows": 10_000, "max_requests": 7})
    assert minted.limits == SessionLimits(max_rows=10_000, max_requests=7)
    plain = await sessions.mint(org, scope, NS, ["rows.read"])
    async with org.login_connection() as conn:
        assert await recorded_limits(conn, minted.role) == minted.limits
        assert await recorded_limits(conn, plain.role) is None
    async with open_gateway(server.url, token_for(org), retry=FAST_RETRY) as gateway:
        session = await create_db_session(gateway, "play", NS, ["rows.read"],
                                          limits={"max_bytes": 5_000_000})
    assert session.limits == SessionLimits(max_bytes=5_000_000)
    async with org.login_connection() as conn:
        roles = await session_roles(org)
        recorded = [await recorded_limits(conn, role) for role in roles]
    assert sorted(map(repr, recorded)) == sorted(map(repr, [minted.limits, None, session.limits]))
    await drop_all_sessions(org)
    async with org.login_connection() as conn:  # dropped with the role
        assert await recorded_limits(conn, minted.role) is None


# -- limits: enforced by the router -------------------------------------------------------------
async def test_past_its_request_limit_a_sessions_work_goes_over_http(org, server):
    await sheet_of(org, 5)
    scope = play_scope(org)
    expected = await sheets.read_rows(org, scope, NS)
    async with sessions_gateway(server, org, {"max_requests": 2}) as gateway:
        for _ in range(4):
            assert await sheets.read_rows(gateway, scope, NS) == expected
        assert gateway.db_sessions.disabled is None
    assert server.requests["sheets.read_rows"] == 2  # the first two ran over the session
    async with sessions_gateway(server, org) as gateway:  # no limits: all four over a session
        for _ in range(4):
            assert await sheets.read_rows(gateway, scope, NS) == expected
    assert server.requests["sheets.read_rows"] == 2


async def test_past_its_row_limit_reads_and_writes_go_over_http(org, server):
    run = await sheet_of(org, 10_000)
    scope = play_scope(org)
    async with sessions_gateway(server, org, {"max_rows": 10_000}) as gateway:
        assert len(await sheets.read_rows(gateway, scope, NS, limit=10_000)) == 10_000
        assert server.requests["sheets.read_rows"] == 0
        assert len(await sheets.read_rows(gateway, scope, NS, limit=5)) == 5  # limit reached
        assert server.requests["sheets.read_rows"] == 1
        admitted = await sheets.admit(gateway, run, NS, CONTRACT, [{"name": "more"}])
        assert admitted.inserted == 1 and server.requests["sheets.admit"] == 1
    async with sessions_gateway(server, org, {"max_bytes": 100}) as gateway:
        big = [{"name": "x" * 200}]  # its row alone passes the byte limit
        assert (await sheets.admit(gateway, run, NS, CONTRACT, big)).inserted == 1
        assert server.requests["sheets.admit"] == 2
        small = [{"name": "y"}]
        assert (await sheets.admit(gateway, run, NS, CONTRACT, small)).inserted == 1
        assert server.requests["sheets.admit"] == 2  # over the session
    assert (await sheets.summary(org, scope, NS)).total == 10_003


# -- write modes as session operations ----------------------------------------------------------
async def test_a_session_with_rows_append_appends_but_cannot_replace(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        scope = PlayScope(org, "play")
        run = await new_run(admin, "play", "r1")
        await sheets.ensure_sheet(admin, scope, NS, CONTRACT)
        await sheets.admit(admin, run, NS, CONTRACT, [{"name": "a"}])
        appender = await sessions.mint(admin, scope, NS, ["rows.append"])
        replacer = await sessions.mint(admin, scope, NS, ["rows.replace"])
        reader = await sessions.mint(admin, scope, NS, ["rows.read"])
        async with session_tenant(dsn, appender) as session:
            appended = await sheets.append_rows(session, run, NS, CONTRACT, [{"name": "b"}],
                                                idempotency_key="k1")
            assert appended.inserted == 1
            with pytest.raises(InsufficientPrivilegeError):
                await sheets.replace_rows(session, run, NS, CONTRACT, [{"name": "c"}])
        async with session_tenant(dsn, reader) as session:
            with pytest.raises(InsufficientPrivilegeError):
                await sheets.append_rows(session, run, NS, CONTRACT, [{"name": "d"}],
                                         idempotency_key="k2")
            with pytest.raises(InsufficientPrivilegeError):
                await sheets.replace_rows(session, run, NS, CONTRACT, [{"name": "d"}])
        assert (await sheets.summary(admin, scope, NS)).total == 2
        async with session_tenant(dsn, replacer) as session:
            replaced = await sheets.replace_rows(session, run, NS, CONTRACT, [{"name": "z"}])
            assert replaced.inserted == 1
        assert [r["name"] for r in await sheets.read_rows(admin, scope, NS)] == ["z"]
    assert sessions.operation_actions()["rows.append"] == ("sheets.append_rows",)
    assert sessions.operation_actions()["rows.replace"] == ("sheets.replace_rows",)


async def test_the_router_appends_and_replaces_over_sessions(org, server):
    run = await sheet_of(org, 3)
    scope = play_scope(org)
    async with sessions_gateway(server, org) as gateway:
        appended = await sheets.append_rows(gateway, run, NS, CONTRACT, [{"name": "x"}],
                                            idempotency_key="k")
        assert appended.inserted == 1
        assert (await sheets.replace_rows(gateway, run, NS, CONTRACT, [{"name": "y"}])).inserted == 1
    assert not {"sheets.append_rows", "sheets.replace_rows"} & set(server.requests)
    assert [r["name"] for r in await sheets.read_rows(org, scope, NS)] == ["y"]


# -- reads by run over a session ----------------------------------------------------------------
async def test_a_reading_session_reads_a_runs_reused_rows_and_no_other_membership(dsn):
    org, other = unique("org"), unique("other")
    async with admin_tenant(dsn, org) as admin:
        async with admin_tenant(dsn, other, schema=admin.schema) as intruder:
            for port in (admin, intruder):
                first = await sheet_of(port, 20, "first")
                rerun = await new_run(port, "play", "rerun")
                keys = [r["_key"] for r in await sheets.read_rows(port, play_scope(port), NS)]
                await sheets.record_reuse(port, rerun, NS, keys)
                await sheets.record_reuse(port, rerun, "elsewhere", keys[:3])
                assert first.epoch < rerun.epoch
            scope = PlayScope(org, "play")
            minted = await sessions.mint(admin, scope, NS, ["rows.read"])
            expected = await sheets.read_rows(admin, scope, NS, run_id="rerun")
            assert len(expected) == 20
            async with session_tenant(dsn, minted) as session:
                assert await sheets.read_rows(session, scope, NS, run_id="rerun") == expected
                ds = sheets.dataset(session, scope, NS, run_id="rerun")
                assert await ds.count() == 20 and await ds.materialize() == expected
                async with session.connection("sheet") as conn:
                    seen = await conn.fetch(
                        f"SELECT org_id, play, table_namespace FROM "
                        f"{qualified(admin.schema, 'sheet_reuse')}")
            assert [tuple(r) for r in seen] == [(org, "play", NS)]  # its own sheet's only


async def test_a_schema_bootstrapped_before_the_reuse_policy_gets_it_at_its_next_mint(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        reuse = qualified(admin.schema, "sheet_reuse")
        async with admin.login_connection() as conn:  # as a schema of the previous release
            await conn.execute(f"DROP POLICY runplane_session_scope ON {reuse}")
            await conn.execute(f"DROP POLICY runplane_everyone ON {reuse}")
            await conn.execute(f"ALTER TABLE {reuse} DISABLE ROW LEVEL SECURITY")
        minted = await sessions.mint(admin, PlayScope(org, "play"), NS, ["rows.read"])
        async with admin.login_connection() as conn:
            assert await conn.fetchval(
                "SELECT relrowsecurity FROM pg_class WHERE oid = $1::regclass", reuse)
            assert await conn.fetchval(
                "SELECT count(*) FROM pg_policy WHERE polrelid = $1::regclass", reuse) == 2
        async with session_tenant(dsn, minted) as session:
            async with session.connection("sheet") as conn:
                assert await conn.fetch(f"SELECT * FROM {reuse}") == []
