"""Scoped database sessions: what a minted login can do, and everything it must not be able to.

Every test here uses the real minted URL against the real server; break-out attempts are plain
hand-written SQL, as an attacker holding the URL would write them.
"""

from __future__ import annotations

import pytest
import trio

from runplane.engine import array_input as A
from runplane.engine import receipts, sessions
from runplane.engine.array_input import facts as F
from runplane.engine.errors import (
    DatabaseError,
    InsufficientPrivilegeError,
    InvalidInputError,
    ScopeError,
    TenantUnavailableError,
)
from runplane.engine.values.scopes import PlayScope
from runplane.engine.sheets import RowOutcome, admit, complete, read_rows, summary
from runplane.engine.sql import qualified, quote_ident

from .array_input_support import occurrences, stage
from .session_helpers import CONTRACT, NAMESPACE, admin_tenant, seed, session_tenant, unique

ALL_OPERATIONS = list(sessions.OPERATIONS)

_USER_TABLES = """
SELECT n.nspname::text AS schema, c.relname::text AS name,
       (SELECT attname::text FROM pg_attribute WHERE attrelid = c.oid AND attnum = 1) AS first_column
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE c.relkind IN ('r', 'p')
   AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%'
 ORDER BY 1, 2
"""


def mentions(text: str, marker: str) -> bool:
    """Does a row (as PostgreSQL prints it) mention `marker`, as text or inside a bytea?"""
    return marker in text or marker.encode().hex() in text


async def victim_rows(admin, marker: str) -> dict[str, list[str]]:
    """Every row of every user table that mentions `marker`, as the admin sees it."""
    out: dict[str, list[str]] = {}
    async with admin.login_connection() as conn:
        for table in await conn.fetch(_USER_TABLES):
            name = qualified(table["schema"], table["name"])
            texts = await conn.fetchval(f"SELECT coalesce(array_agg(t::text), '{{}}') FROM {name} AS t")
            out[name] = sorted(t for t in texts if mentions(t, marker))
    return out


async def attempt(conn, sql: str, *args):
    """Run one statement as the session: its rows, or None when the server refused it."""
    try:
        return await conn.fetch(sql, *args)
    except InsufficientPrivilegeError:
        return None


async def try_to_break_out(session, marker: str) -> set[str]:
    """Read, update and delete every table of the database as `session`; assert nothing that
    mentions `marker` is ever returned or touched. Returns the tables it could read."""
    readable = set()
    async with session.connection("receipts") as conn:
        tables = await conn.fetch(_USER_TABLES)
        for table in tables:
            name = qualified(table["schema"], table["name"])
            col = quote_ident(table["first_column"])
            read = await attempt(conn, f"SELECT t::text AS row FROM {name} AS t")
            if read is not None:
                readable.add(table["name"])
                assert not [r for r in read if mentions(r["row"], marker)], name
            for sql in (f"UPDATE {name} AS t SET {col} = {col} RETURNING t::text AS row",
                        f"DELETE FROM {name} AS t RETURNING t::text AS row"):
                touched = await attempt(conn, sql)
                assert not [r for r in touched or [] if mentions(r["row"], marker)], sql
    return readable


# -- isolation --------------------------------------------------------------------------------
async def test_another_orgs_session_reads_and_deletes_nothing_of_the_seeded_org(dsn):
    victim_org, victim_play = unique("victim-org"), unique("victim-play")
    async with admin_tenant(dsn, victim_org) as victim:
        await seed(victim, victim_play)
        async with admin_tenant(dsn, unique("attacker-org"), schema=victim.schema) as attacker_admin:
            # The attacker's org uses the very same play and namespace names.
            await seed(attacker_admin, victim_play)
            before = await victim_rows(victim, victim_org)
            assert sum(map(len, before.values())) > 10
            minted = await sessions.mint(attacker_admin, PlayScope(attacker_admin.org_id, victim_play),
                                         NAMESPACE, ALL_OPERATIONS)
            async with session_tenant(dsn, minted) as session:
                readable = await try_to_break_out(session, victim_org)
            # The session did see its own data (the walk is not vacuous) and nothing else.
            assert {"work_receipts", "sheet_summary", "sheet_column_summary", "sheet_columns"} <= readable
            assert "runs" not in readable and "terminal_outbox" not in readable
            assert await victim_rows(victim, victim_org) == before


async def test_a_session_of_one_play_cannot_touch_another_play_of_its_org(dsn):
    org, victim_play = unique("org"), unique("victim-play")
    async with admin_tenant(dsn, org) as admin:
        await seed(admin, victim_play)
        await seed(admin, "other-play")
        before = await victim_rows(admin, victim_play)
        minted = await sessions.mint(admin, PlayScope(org, "other-play"), NAMESPACE, ALL_OPERATIONS)
        async with session_tenant(dsn, minted) as session:
            await try_to_break_out(session, victim_play)
        assert await victim_rows(admin, victim_play) == before


async def test_a_session_writes_only_inside_its_key_ranges_and_never_deletes_receipts(dsn):
    from runplane.engine.values.keys import fact_key, receipt_key

    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        t = qualified(admin.schema, "work_receipts")
        receipts_only = await sessions.mint(admin, seeded["scope"], NAMESPACE, ["receipts"])
        async with session_tenant(dsn, receipts_only) as session:
            async with session.connection("receipts") as conn:
                foreign = receipt_key(PlayScope("other-org", "play"), "x")
                fact = fact_key(seeded["scope"], F.GUARD_KIND, "run-1")
                for key in (foreign, fact):
                    with pytest.raises(InsufficientPrivilegeError):
                        await conn.execute(f"INSERT INTO {t} (k, status) VALUES ($1, 0)", key)
                # Its own receipts are readable, but no session deletes a receipt.
                assert await conn.fetchval(f"SELECT count(*) FROM {t}") == 1
                with pytest.raises(InsufficientPrivilegeError):
                    await conn.execute(f"DELETE FROM {t}")
                # An update cannot move a row out of the session's range either.
                with pytest.raises(InsufficientPrivilegeError):
                    await conn.execute(f"UPDATE {t} SET k = $1", foreign)
        both = await sessions.mint(admin, seeded["scope"], NAMESPACE, ["receipts", "array_input"])
        async with session_tenant(dsn, both) as session:
            async with session.connection("receipts") as conn:
                # No session holds DELETE (it would let it LOCK the shared table).
                for key in (receipt_key(seeded["scope"], "receipt-1"), fact):
                    with pytest.raises(InsufficientPrivilegeError):
                        await conn.fetchval(f"DELETE FROM {t} WHERE k = $1 RETURNING 1", key)
        async with admin.login_connection() as conn:
            assert await conn.fetchval(f"SELECT count(*) FROM {t} WHERE k = $1",
                                       receipt_key(seeded["scope"], "receipt-1")) == 1


async def test_a_session_cannot_create_roles_schemas_tables_or_change_its_role(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        scope = PlayScope(org, "play")
        minted = await sessions.mint(admin, scope, NAMESPACE, ALL_OPERATIONS)
        other = await sessions.mint(admin, scope, NAMESPACE, ["rows.read"])
        async with admin.login_connection() as conn:
            admin_user = await conn.fetchval("SELECT current_user")
            valid_until = await conn.fetchval(
                "SELECT rolvaliduntil FROM pg_roles WHERE rolname = $1", minted.role)
        me = quote_ident(minted.role)
        refused = [
            "CREATE ROLE runplane_intruder LOGIN",
            "CREATE SCHEMA runplane_intruder",
            f"CREATE TABLE {qualified(admin.schema, 'intruder')} (x int)",
            "CREATE TABLE public.runplane_intruder (x int)",
            f"SET ROLE {quote_ident(sessions.GROUP)}",
            f"SET ROLE {quote_ident(admin_user)}",
            f"SET ROLE {quote_ident(other.role)}",
            f"ALTER ROLE {me} VALID UNTIL 'infinity'",
            f"ALTER ROLE {me} CONNECTION LIMIT 1000",
            f"ALTER ROLE {me} CREATEROLE",
            f"GRANT {quote_ident(sessions.GROUP)} TO {me}",
            f"GRANT SELECT ON {qualified(admin.schema, 'runs')} TO {me}",
            f"INSERT INTO {qualified(admin.schema, 'session_scopes')} (role_name, org_id, play,"
            f" table_namespace, operations, expires_at) VALUES ('x', 'o', 'p', 'n', '{{}}', now())",
            f"UPDATE {qualified(admin.schema, 'session_scopes')} SET org_id = 'other'",
            f"ALTER TABLE {qualified(admin.schema, 'work_receipts')} DISABLE ROW LEVEL SECURITY",
            f"DROP POLICY runplane_session_scope ON {qualified(admin.schema, 'work_receipts')}",
        ]
        async with session_tenant(dsn, minted) as session:
            async with session.connection("receipts") as conn:
                for sql in refused:
                    with pytest.raises(DatabaseError) as caught:
                        await conn.execute(sql)
                    assert caught.value.sqlstate == "42501", (sql, caught.value)
                assert await conn.fetchval("SELECT current_user") == minted.role
        async with admin.login_connection() as conn:
            assert await conn.fetchval(
                "SELECT rolvaliduntil FROM pg_roles WHERE rolname = $1", minted.role) == valid_until
            assert not await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runplane_intruder')")


async def test_an_expired_session_cannot_log_in_and_no_session_logs_in_without_its_password(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        minted = await sessions.mint(admin, PlayScope(org, "play"), NAMESPACE, ["receipts"])
        async with session_tenant(dsn, minted):
            pass  # the URL works while the session is valid
        with pytest.raises(TenantUnavailableError) as caught:
            async with session_tenant(dsn, attrs_evolve_password(minted, "wrong")):
                pass
        assert "wrong" not in str(caught.value)
        with pytest.raises(TenantUnavailableError):
            async with open_without_password(dsn, minted):
                pass
        async with admin.login_connection() as conn:
            await conn.execute(f"ALTER ROLE {quote_ident(minted.role)} VALID UNTIL '2000-01-01'")
        with pytest.raises(TenantUnavailableError) as caught:
            async with session_tenant(dsn, minted):
                pass
        assert minted.password not in str(caught.value)


def attrs_evolve_password(minted, password):
    import attrs

    return attrs.evolve(minted, password=password)


def open_without_password(dsn, minted):
    from runplane.engine import open_tenant

    return open_tenant(minted.scope.org_id, sessions.session_url(dsn, minted.role, None),
                       schema=minted.schema)


# -- the operations a session covers ----------------------------------------------------------
async def test_engine_operations_work_through_a_session_exactly_as_granted(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        run = seeded["run"]
        minted = await sessions.mint(admin, seeded["scope"], NAMESPACE, ALL_OPERATIONS)
        assert minted.scope.operations == tuple(sessions.OPERATIONS)
        async with session_tenant(dsn, minted) as session:
            # receipts
            claim = await receipts.claim(session, run, "receipt-2")
            assert claim.disposition == "claimed"
            done = await receipts.complete(session, run, "receipt-2", {"ok": 1})
            assert done.status == "completed"
            assert (await receipts.get(session, seeded["scope"], "receipt-1")).output == {"done": "play"}
            # array inputs: stage, read and retire a second map
            map_scope = run.scope.map(NAMESPACE, "map-2")
            await stage(session, map_scope, occurrences(5))
            page = await A.read_page(session, map_scope, 0)
            assert [row.data["i"] for row in page.rows] == list(range(5))
            # sheets: admit and complete new rows, read them and the counters back
            admission = await admit(session, run, NAMESPACE, CONTRACT, [{"name": "new"}])
            assert admission.inserted == 1
            completion = await complete(session, run, NAMESPACE, CONTRACT, [
                RowOutcome(key=admission.pending[0].key, status="completed", data={"score": 9})])
            assert completion.updated == 1
            rows = await read_rows(session, seeded["scope"], NAMESPACE)
            assert sorted(r["name"] for r in rows) == ["new", "play-0", "play-1", "play-2"]
            assert (await summary(session, seeded["scope"], NAMESPACE)).completed == 4
            # Retiring deletes facts, which no session may: it goes over the gateway.
            with pytest.raises(InsufficientPrivilegeError):
                await A.retire(session, run.scope)
            while not (await A.retire(admin, run.scope)).done:
                pass
        assert (await summary(admin, seeded["scope"], NAMESPACE)).completed == 4


async def test_a_read_only_session_reads_rows_but_cannot_write_them(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        minted = await sessions.mint(admin, seeded["scope"], NAMESPACE, ["rows.read"])
        async with session_tenant(dsn, minted) as session:
            assert len(await read_rows(session, seeded["scope"], NAMESPACE)) == 3
            with pytest.raises(InsufficientPrivilegeError):
                await admit(session, seeded["run"], NAMESPACE, CONTRACT, [{"name": "x"}])
            with pytest.raises(InsufficientPrivilegeError):
                await receipts.get(session, seeded["scope"], "receipt-1")


async def test_a_missing_relation_or_column_a_session_may_not_create_is_a_clear_error(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        minted = await sessions.mint(admin, seeded["scope"], NAMESPACE, ALL_OPERATIONS)
        async with session_tenant(dsn, minted) as session:
            with trio.fail_after(30):  # never a loop
                with pytest.raises(InsufficientPrivilegeError, match="may not create"):
                    await complete(session, seeded["run"], NAMESPACE, CONTRACT, [
                        RowOutcome(key=seeded["keys"][0], status="completed",
                                   data={"score": 1, "brand_new_field": 2})])
        # An older schema needs an upgrade a session may not run: a clear error, not a loop.
        async with admin.login_connection() as conn:
            await conn.execute(
                f"UPDATE {qualified(admin.schema, 'meta')} SET value = '1' WHERE key = 'schema_version'")
        with trio.fail_after(30):
            with pytest.raises(InsufficientPrivilegeError, match="needs DDL"):
                async with session_tenant(dsn, minted):
                    pass


async def test_minting_checks_its_input_before_any_query(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        scope = PlayScope(org, "play")
        for bad in ([], ["rows.delete"], "receipts"):
            with pytest.raises(InvalidInputError, match="operations"):
                await sessions.mint(admin, scope, NAMESPACE, bad)
        for ttl in (0, -1, 10**9, True):
            with pytest.raises(InvalidInputError, match="ttl_s"):
                await sessions.mint(admin, scope, NAMESPACE, ["receipts"], ttl_s=ttl)
        with pytest.raises(ScopeError):
            await sessions.mint(admin, PlayScope("other-org", "play"), NAMESPACE, ["receipts"])
        async with admin.login_connection() as conn:
            assert await conn.fetchval(
                f"SELECT count(*) FROM {qualified(admin.schema, 'session_scopes')}") == 0


def test_array_facts_and_receipts_fall_in_their_own_key_ranges_and_no_one_elses():
    from runplane.engine.values.keys import fact_key, receipt_key

    ranges = sessions.key_ranges(sessions.SessionScope("o", "p", "n", ["receipts", "array_input"]))

    def within(key: bytes, which: str) -> bool:
        return ranges[f"{which}_low"] <= key < ranges[f"{which}_high"]

    scope = PlayScope("o", "p")
    for kind in (F.GUARD_KIND, *F.FACT_KINDS):
        key = fact_key(scope, kind, "run", "ns", "map", 3)
        assert within(key, "facts") and not within(key, "receipts")
    for key in (receipt_key(scope, "k"), receipt_key(scope, "array_input_x")):
        assert within(key, "receipts") and not within(key, "facts")
    for other in (PlayScope("o", "p2"), PlayScope("o2", "p"), PlayScope("o", 'p"'), PlayScope("o,", "p")):
        assert not within(receipt_key(other, "k"), "receipts")
        assert not within(fact_key(other, F.GUARD_KIND, "run"), "facts")
