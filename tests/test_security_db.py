"""Tenants cannot hurt each other through the database: what a session role plants, locks or
keeps open never reaches runplane's own statements or another org.

Every attack here is plain SQL run with a real minted session URL against the real server.
"""

from __future__ import annotations

import functools
import hashlib
import urllib.parse

import httpx
import pytest
import trio

from runplane.engine import open_tenant, receipts, sessions
from runplane.engine import schema as schema_ddl
from runplane.engine.gateway import open_gateway
from runplane.engine.sessions.jwe import b64url
from runplane.engine.errors import (
    InsufficientPrivilegeError, LockTimeoutError, StoreUnavailableError,
)
from runplane.engine.runs import register
from runplane.engine.values.scopes import PlayScope, RunScope
from runplane.engine.sheets import RowOutcome, admit, complete, read_rows, summary
from runplane.engine.sheets.layout import layout_for, sheet_lock_key
from runplane.engine.sql import qualified, quote_ident

from .gateway_support import FAST_RETRY, serving, token_for
from .session_helpers import (
    CONTRACT, NAMESPACE, admin_tenant, drop_all_sessions, seed, session_roles, session_tenant,
    unique,
)

# -- search-path capture -----------------------------------------------------------------------
# Functions named like builtins runplane's statements call, with argument types that match a
# call better than pg_catalog's polymorphic or wider versions do (so, on a search path that
# reaches the planting schema, PostgreSQL would pick them), plus same-signature ones and views
# named like runplane's tables. Each one records that it ran in `captured`.
_PLANTS = """
CREATE TABLE {p}.captured (what text);
GRANT ALL ON {p}.captured TO PUBLIC;
CREATE FUNCTION {p}.runplane_capture(what text) RETURNS boolean LANGUAGE sql VOLATILE
    AS $$ INSERT INTO {p}.captured VALUES (what) RETURNING true $$;
CREATE FUNCTION {p}.unnest(text[]) RETURNS SETOF text LANGUAGE sql
    AS $$ SELECT x FROM pg_catalog.unnest($1) AS x WHERE {p}.runplane_capture('unnest(text[])') $$;
CREATE FUNCTION {p}.unnest(bytea[]) RETURNS SETOF bytea LANGUAGE sql
    AS $$ SELECT x FROM pg_catalog.unnest($1) AS x WHERE {p}.runplane_capture('unnest(bytea[])') $$;
CREATE FUNCTION {p}.unnest(bigint[]) RETURNS SETOF bigint LANGUAGE sql
    AS $$ SELECT x FROM pg_catalog.unnest($1) AS x WHERE {p}.runplane_capture('unnest(bigint[])') $$;
CREATE FUNCTION {p}.unnest(integer[]) RETURNS SETOF integer LANGUAGE sql
    AS $$ SELECT x FROM pg_catalog.unnest($1) AS x WHERE {p}.runplane_capture('unnest(int[])') $$;
CREATE FUNCTION {p}.unnest(jsonb[]) RETURNS SETOF jsonb LANGUAGE sql
    AS $$ SELECT x FROM pg_catalog.unnest($1) AS x WHERE {p}.runplane_capture('unnest(jsonb[])') $$;
CREATE FUNCTION {p}.unnest(text[], text[]) RETURNS TABLE (a text, b text) LANGUAGE sql
    AS $$ SELECT * FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($2)) WHERE {p}.runplane_capture('unnest(text[],text[])') $$;
CREATE FUNCTION {p}.cardinality(text[]) RETURNS integer LANGUAGE sql
    AS $$ SELECT pg_catalog.cardinality($1) WHERE {p}.runplane_capture('cardinality') $$;
CREATE FUNCTION {p}.to_jsonb(bigint) RETURNS jsonb LANGUAGE sql
    AS $$ SELECT pg_catalog.to_jsonb($1) WHERE {p}.runplane_capture('to_jsonb(bigint)') $$;
CREATE FUNCTION {p}.to_jsonb(integer) RETURNS jsonb LANGUAGE sql
    AS $$ SELECT pg_catalog.to_jsonb($1) WHERE {p}.runplane_capture('to_jsonb(int)') $$;
CREATE FUNCTION {p}.to_jsonb(boolean) RETURNS jsonb LANGUAGE sql
    AS $$ SELECT pg_catalog.to_jsonb($1) WHERE {p}.runplane_capture('to_jsonb(bool)') $$;
CREATE FUNCTION {p}.hashtextextended(text, integer) RETURNS bigint LANGUAGE sql
    AS $$ SELECT pg_catalog.hashtextextended($1, $2) WHERE {p}.runplane_capture('hashtextextended') $$;
CREATE FUNCTION {p}.jsonb_array_elements(text) RETURNS SETOF jsonb LANGUAGE sql
    AS $$ SELECT x FROM pg_catalog.jsonb_array_elements($1::jsonb) AS x
          WHERE {p}.runplane_capture('jsonb_array_elements') $$;
CREATE FUNCTION {p}.jsonb_typeof(text) RETURNS text LANGUAGE sql
    AS $$ SELECT pg_catalog.jsonb_typeof($1::jsonb) WHERE {p}.runplane_capture('jsonb_typeof') $$;
CREATE FUNCTION {p}.now() RETURNS timestamptz LANGUAGE sql
    AS $$ SELECT pg_catalog.now() WHERE {p}.runplane_capture('now') $$;
CREATE FUNCTION {p}.lower(text) RETURNS text LANGUAGE sql
    AS $$ SELECT pg_catalog.lower($1) WHERE {p}.runplane_capture('lower') $$;
CREATE FUNCTION {p}.txid_status(integer) RETURNS text LANGUAGE sql
    AS $$ SELECT pg_catalog.txid_status($1) WHERE {p}.runplane_capture('txid_status') $$;
CREATE FUNCTION {p}.runplane_capture_append(bigint[], bigint) RETURNS bigint[] LANGUAGE sql
    AS $$ SELECT pg_catalog.array_append($1, $2) WHERE {p}.runplane_capture('array_agg(bigint)') $$;
CREATE AGGREGATE {p}.array_agg(bigint) (sfunc = {p}.runplane_capture_append, stype = bigint[]);
CREATE FUNCTION {p}.runplane_capture_text(text[], text) RETURNS text[] LANGUAGE sql
    AS $$ SELECT pg_catalog.array_append($1, $2) WHERE {p}.runplane_capture('array_agg(text)') $$;
CREATE AGGREGATE {p}.array_agg(text) (sfunc = {p}.runplane_capture_text, stype = text[]);
CREATE FUNCTION {p}.runplane_capture_eq(bytea, text) RETURNS boolean LANGUAGE sql
    AS $$ SELECT {p}.runplane_capture('=(bytea,text)') $$;
CREATE OPERATOR {p}.= (leftarg = bytea, rightarg = text, function = {p}.runplane_capture_eq);
"""

# Views named like runplane's tables (only where no such table exists: in `public`).
_PLANTED_VIEWS = """
CREATE VIEW {p}.meta AS SELECT 'schema_version'::text AS key, '0'::text AS value
    WHERE {p}.runplane_capture('view meta');
CREATE VIEW {p}.session_scopes AS SELECT ''::text AS role_name
    WHERE {p}.runplane_capture('view session_scopes');
"""


async def captured(admin, where: str) -> list[str]:
    async with admin.login_connection() as conn:
        return list(await conn.fetchval(
            f"SELECT coalesce(pg_catalog.array_agg(DISTINCT what ORDER BY what), '{{}}') FROM {where}.captured"))


@pytest.mark.parametrize("plant_in", ["public", "tenant schema"])
async def test_functions_a_session_plants_never_run_in_runplanes_statements(dsn, plant_in):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        scope = PlayScope(org, "play")
        await seed(admin, "play")  # the sheet exists before the session plants anything
        minted = await sessions.mint(admin, scope, NAMESPACE, ["rows.read"])
        where = "public" if plant_in == "public" else quote_ident(admin.schema)
        async with admin.login_connection() as conn:
            # As on PostgreSQL 14 and older, where `public` is writable by everyone; the tenant
            # schema stands for any schema on runplane's path a session could write.
            await conn.execute(f"GRANT CREATE ON SCHEMA {where} TO {quote_ident(minted.role)}")
        try:
            async with session_tenant(dsn, minted) as session:
                async with session.login_connection() as conn:
                    await conn.execute(_PLANTS.format(p=where))
                    if plant_in == "public":
                        await conn.execute(_PLANTED_VIEWS.format(p=where))
            assert await captured(admin, where) == []
            # The owner's work: a fresh login, the bootstrap, admission and completion (seed
            # again, as a new run), reads, minting and dropping sessions.
            async with open_tenant(org, dsn, schema=admin.schema) as fresh:
                await fresh.repair_schema()
                await seed(fresh, "other-play")
                run = await register(fresh, RunScope(org, "play", "run-2"))
                admission = await admit(fresh, run, NAMESPACE, CONTRACT, [{"name": "new"}])
                await complete(fresh, run, NAMESPACE, CONTRACT, [
                    RowOutcome(key=admission.pending[0].key, status="completed", data={"score": 1})])
                assert len(await read_rows(fresh, scope, NAMESPACE)) == 4
                assert (await summary(fresh, scope, NAMESPACE)).completed == 4
                other = await sessions.mint(fresh, scope, NAMESPACE, sessions.OPERATIONS)
                async with session_tenant(dsn, other) as session:
                    assert len(await read_rows(session, scope, NAMESPACE)) == 4
            assert await captured(admin, where) == []
        finally:
            async with admin.login_connection() as conn:
                await conn.execute(f"DROP OWNED BY {quote_ident(minted.role)}")
                await conn.execute(f"REVOKE CREATE ON SCHEMA {where} FROM {quote_ident(minted.role)}")


# -- expiry is real ----------------------------------------------------------------------------
async def expire(admin, role: str) -> None:
    """Move `role`'s VALID UNTIL into the past, as time would."""
    async with admin.login_connection() as conn:
        await conn.execute(f"ALTER ROLE {quote_ident(role)} VALID UNTIL '2000-01-01'")


async def test_the_sweep_cuts_a_connection_opened_before_expiry_then_drops_the_role(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        scope = PlayScope(org, "play")
        await seed(admin, "play")
        minted = await sessions.mint(admin, scope, NAMESPACE, ["rows.read"])
        async with session_tenant(dsn, minted) as session:
            with pytest.raises(StoreUnavailableError):
                async with session.connection("sheet") as conn:
                    assert await conn.fetchval("SELECT 1") == 1
                    await expire(admin, minted.role)
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(functools.partial(
                            sessions.sweep_expired, admin, interval_s=0.05))
                        with trio.fail_after(20):
                            while minted.role in await session_roles(admin):
                                await trio.sleep(0.05)
                        nursery.cancel_scope.cancel()
                    await conn.fetch(f"SELECT * FROM {qualified(admin.schema, 'sheet_summary')}")
        assert await session_roles(admin) == []


# -- bounded sessions ------------------------------------------------------------------------
async def test_an_org_holds_at_most_four_live_sessions_and_the_fifth_mint_gets_429(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        async with serving(admin) as server:
            headers = {"authorization": f"Bearer {token_for(admin)}"}
            body = {"play": "play", "table_namespace": NAMESPACE, "operations": ["rows.read"]}
            url = f"{server.url}/v1/actions/db_sessions.create"
            async with httpx.AsyncClient() as client:
                for _ in range(sessions.DEFAULT_SESSIONS_PER_ORG):
                    assert (await client.post(url, json=body, headers=headers)).status_code == 200
                refused = await client.post(url, json=body, headers=headers)
                assert refused.status_code == 429, refused.text
                assert refused.json()["code"] == "too_many_sessions"
                assert 0 < refused.json()["retry_after_ms"] <= 600_000
                roles = await session_roles(admin)
                assert len(roles) == sessions.DEFAULT_SESSIONS_PER_ORG  # nothing was minted
                async with open_tenant(unique("other"), dsn, schema=admin.schema) as other:
                    await sessions.mint(other, PlayScope(other.org_id, "play"), NAMESPACE,
                                        ["rows.read"])  # another org is not affected
                await expire(admin, roles[0])
                assert (await client.post(url, json=body, headers=headers)).status_code == 200
                assert (await client.post(url, json=body, headers=headers)).status_code == 429
                await sessions.drop_expired(admin)
                await expire(admin, roles[1])
                await sessions.drop_expired(admin)
                assert (await client.post(url, json=body, headers=headers)).status_code == 200


async def test_a_session_role_has_a_connection_limit_and_timeouts_of_its_own(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        minted = await sessions.mint(admin, PlayScope(org, "play"), NAMESPACE, ["rows.read"])
        async with admin.login_connection() as conn:
            row = await conn.fetchrow(
                "SELECT rolconnlimit, rolconfig FROM pg_catalog.pg_roles WHERE rolname = $1",
                minted.role)
        assert row["rolconnlimit"] == sessions.DEFAULT_CONNECTION_LIMIT
        assert {"statement_timeout=60s", "lock_timeout=10s",
                "idle_in_transaction_session_timeout=60s"} <= set(row["rolconfig"])
        async with session_tenant(dsn, minted) as session:
            async with session.login_connection() as conn:
                assert await conn.fetchval("SHOW lock_timeout") == "10s"


@pytest.mark.parametrize("bits", [16_384])
async def test_an_oversized_public_key_is_refused_with_400_before_a_role_is_minted(dsn, bits):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        members = await group_members(admin)
        async with serving(admin) as server:
            headers = {"authorization": f"Bearer {token_for(admin)}"}
            n = (1 << (bits - 1)) + 1  # an odd modulus of `bits` bits
            bad_keys = [
                {"kty": "RSA", "n": b64url(n.to_bytes(bits // 8, "big")), "e": "AQAB"},
                {"kty": "RSA", "n": "!!", "e": "AQAB"},
                {"kty": "RSA", "e": "AQAB"},
                {"kty": "RSA", "n": b64url((1 << 2047 | 1).to_bytes(256, "big")), "e": "AA"},
            ]
            async with httpx.AsyncClient() as client:
                for key in bad_keys:
                    body = {"play": "play", "table_namespace": NAMESPACE,
                            "operations": ["rows.read"], "public_key": key}
                    answer = await client.post(f"{server.url}/v1/actions/db_sessions.create",
                                               json=body, headers=headers)
                    assert answer.status_code == 400, answer.text
            assert await session_roles(admin) == []
            assert await group_members(admin) == members


async def group_members(admin) -> int:
    """How many roles of the cluster are session roles (members of the group)."""
    async with admin.login_connection() as conn:
        return await conn.fetchval(
            "SELECT count(*) FROM pg_catalog.pg_auth_members m"
            " JOIN pg_catalog.pg_roles g ON g.oid = m.roleid WHERE g.rolname = $1", sessions.GROUP)


# -- what a session URL carries ----------------------------------------------------------------
def test_a_session_url_keeps_only_where_the_server_is_and_its_tls_mode():
    dsn = ("postgresql://gateway:secret@db.example:6432,db2.example:6433/prod"
           "?sslmode=verify-full&sslrootcert=/etc/ca.pem&sslpassword=keypass&passfile=/home/g/.pgpass"
           "&options=-c%20search_path%3Devil&sslcert=/g/cert&sslkey=/g/key&application_name=gw")
    url = sessions.session_url(dsn, "runplane_s_1", "pw")
    parts = urllib.parse.urlsplit(url)
    assert parts.netloc == "runplane_s_1:pw@db.example:6432,db2.example:6433"
    assert parts.path == "/prod"
    assert dict(urllib.parse.parse_qsl(parts.query)) == {
        "sslmode": "verify-full", "sslrootcert": "/etc/ca.pem"}
    assert "secret" not in url and "keypass" not in url


# -- lock-outs ---------------------------------------------------------------------------------
SHARED = ("meta", "session_scopes", "work_receipts", "sheet_summary", "sheet_column_summary",
          "sheet_columns", "sheet_counter_deltas", "sheet_column_deltas", "shared_maps", "runs",
          "terminal_outbox", "rate_limits", "lock_secret")


async def test_no_session_can_lock_a_shared_table_or_read_the_lock_secret(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        await seed(admin, "play")
        scope = PlayScope(org, "play")
        for operations in (["rows.read"], ["rows.upsert"], ["receipts"], ["array_input"]):
            minted = await sessions.mint(admin, scope, NAMESPACE, operations)
            async with session_tenant(dsn, minted) as session:
                async with session.login_connection() as conn:
                    for name in SHARED:
                        for mode in ("ACCESS SHARE", "ROW EXCLUSIVE", "ACCESS EXCLUSIVE"):
                            with pytest.raises(InsufficientPrivilegeError):
                                async with conn.transaction():
                                    await conn.execute(
                                        f"LOCK TABLE {qualified(admin.schema, name)} IN {mode} MODE")
                    with pytest.raises(InsufficientPrivilegeError):
                        await conn.fetch(f"SELECT * FROM {qualified(admin.schema, 'lock_secret')}")
            await drop_all_sessions(admin)


async def test_a_session_holding_the_lock_keys_it_can_compute_stalls_no_other_org(dsn):
    victim_org, attacker_org = unique("victim"), unique("attacker")
    async with admin_tenant(dsn, victim_org) as victim:
        seeded = await seed(victim, "play")
        victim_layout = layout_for(victim, seeded["scope"], NAMESPACE)
        async with open_tenant(attacker_org, dsn, schema=victim.schema) as attacker_admin:
            attacker_scope = PlayScope(attacker_org, "play")
            await seed(attacker_admin, "play")
            minted = await sessions.mint(attacker_admin, attacker_scope, NAMESPACE, sessions.OPERATIONS)
        # Every key a session could derive from public names: the historical derivation, and
        # hashes of the names it can see.
        names = f"runplane.sheet\x00{victim.schema}\x00{victim_layout.table}"
        guesses = [int.from_bytes(hashlib.sha256(names.encode()).digest()[:8], "big", signed=True)]
        async with session_tenant(dsn, minted) as session:
            # Its own sheet's key is the one runplane uses (its writes coordinate with others').
            own = layout_for(session, attacker_scope, NAMESPACE)
            assert sheet_lock_key(session, own) == sheet_lock_key(victim, own)
            assert sheet_lock_key(victim, victim_layout) not in guesses
            async with session.login_connection() as conn:
                guesses.append(await conn.fetchval(
                    "SELECT hashtextextended($1, 0)", f"{victim.schema}.{victim_layout.table}"))
                for key in guesses:
                    await conn.fetchval("SELECT pg_advisory_lock($1::bigint)", key)
                with trio.fail_after(60):  # a stall would hit the lock timeout and fail below
                    run = await register(victim, RunScope(victim_org, "play", "run-2"))
                    admission = await admit(victim, run, NAMESPACE, CONTRACT, [{"name": "late"}])
                    await complete(victim, run, NAMESPACE, CONTRACT, [RowOutcome(
                        key=admission.pending[0].key, status="completed", data={"score": 1})])
                await conn.fetchval("SELECT pg_advisory_unlock_all()")
        assert (await summary(victim, seeded["scope"], NAMESPACE)).completed == 4


async def test_a_transaction_a_session_leaves_open_costs_the_bootstrap_a_bounded_retryable_wait(
        dsn, monkeypatch):
    monkeypatch.setattr(schema_ddl, "BOOTSTRAP_LOCK_TIMEOUT", "200ms")
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        minted = await sessions.mint(admin, seeded["scope"], NAMESPACE, ["rows.read"])
        async with session_tenant(dsn, minted) as session:
            async with session.login_connection() as conn:
                async with conn.transaction():  # holds its read lock on the shared counters
                    await conn.fetch(f"SELECT * FROM {qualified(admin.schema, 'sheet_summary')}")
                    with trio.fail_after(60), pytest.raises(LockTimeoutError) as raised:
                        await admin.repair_schema()  # ALTER TABLE waits for the session...
                    assert isinstance(raised.value, StoreUnavailableError)  # (retryable)
                    # ...and gave up, so another org's writes do not queue behind it.
                    async with open_tenant(unique("other"), dsn, schema=admin.schema) as other:
                        with trio.fail_after(60):
                            await seed(other, "play")
                        assert (await summary(other, PlayScope(other.org_id, "play"),
                                              NAMESPACE)).completed == 3


async def test_a_session_holds_no_bootstrap_off_and_claims_no_other_sheets_table_name(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        minted = await sessions.mint(admin, seeded["scope"], NAMESPACE, ["rows.upsert"])
        victim = layout_for(admin, PlayScope(unique("victim"), "play"), NAMESPACE)
        summary_table = qualified(admin.schema, "sheet_summary")
        async with session_tenant(dsn, minted) as session:
            async with session.login_connection() as conn:
                await conn.fetchval("SELECT pg_advisory_lock(hashtextextended($1, 0))",
                                    f"runplane.bootstrap:{admin.schema}")
                with trio.fail_after(60):
                    await admin.repair_schema()  # the bootstrap, not held off
                for sql in (f"UPDATE {summary_table} SET table_name = $1",
                            f"INSERT INTO {summary_table} (org_id, play, table_namespace, table_name)"
                            f" VALUES ('{org}', 'play', 'other', $1)"):
                    with pytest.raises(InsufficientPrivilegeError):
                        await conn.execute(sql, victim.table)
                await conn.fetchval("SELECT pg_advisory_unlock_all()")
        async with admin.login_connection() as conn:
            assert await conn.fetchval(
                f"SELECT count(*) FROM {summary_table} WHERE table_name = $1", victim.table) == 0


# -- statistics --------------------------------------------------------------------------------
async def test_a_session_reads_no_per_table_statistics_of_other_orgs_sheets(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        sheet = layout_for(admin, seeded["scope"], NAMESPACE)
        minted = await sessions.mint(admin, PlayScope(org, "other-play"), NAMESPACE, ["rows.read"])
        async with session_tenant(dsn, minted) as session:
            async with session.login_connection() as conn:
                for sql in ("SELECT n_live_tup FROM pg_catalog.pg_stat_user_tables",
                            "SELECT n_tup_ins FROM pg_catalog.pg_stat_all_tables",
                            "SELECT heap_blks_read FROM pg_catalog.pg_statio_user_tables",
                            "SELECT idx_scan FROM pg_catalog.pg_stat_user_indexes",
                            "SELECT n_tup_ins FROM pg_catalog.pg_stat_xact_user_tables"):
                    with pytest.raises(InsufficientPrivilegeError):
                        await conn.fetch(sql)
                for fn in ("pg_stat_get_live_tuples", "pg_stat_get_tuples_inserted",
                           "pg_stat_get_xact_tuples_inserted", "pg_stat_get_numscans"):
                    with pytest.raises(InsufficientPrivilegeError):
                        await conn.fetchval(f"SELECT pg_catalog.{fn}($1::regclass)", sheet.qualified)
                # What stays open: the server's own activity view, and the catalog.
                assert await conn.fetchval("SELECT count(*) FROM pg_catalog.pg_stat_activity") >= 1
        async with admin.login_connection() as conn:  # the owner and pg_monitor keep them
            assert await conn.fetchval(
                "SELECT n_live_tup FROM pg_catalog.pg_stat_user_tables"
                " WHERE schemaname = $1 AND relname = $2", admin.schema, sheet.table) is not None
            assert await conn.fetchval(
                "SELECT has_table_privilege('pg_monitor', 'pg_catalog.pg_stat_user_tables', 'SELECT')"
                " AND has_function_privilege('pg_monitor', 'pg_catalog.pg_stat_get_live_tuples(oid)',"
                " 'EXECUTE')")


async def test_a_runner_refused_a_session_sends_that_work_over_http(dsn, monkeypatch):
    monkeypatch.setenv(sessions.SESSIONS_PER_ORG_ENV, "1")
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        await sessions.mint(admin, PlayScope(org, "play"), NAMESPACE, ["receipts"])  # the one
        async with serving(admin) as server:
            async with open_gateway(server.url, token_for(admin), retry=FAST_RETRY,
                                    db_sessions=True) as gateway:
                run = await register(gateway, RunScope(org, "play", "run-1"))
                claim = await receipts.claim(gateway, run, "k")
                assert claim.disposition == "claimed"
                assert gateway.db_sessions.disabled is None  # refused for now, not switched off
            assert server.errors["too_many_sessions"] == 1
            assert server.requests["receipts.claim"] == 1  # it went over HTTP
        assert len(await session_roles(admin)) == 1
