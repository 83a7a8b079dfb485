"""A sheet leaves room on each page for its rows' completed versions (`SHEET_FILLFACTOR`)."""

from __future__ import annotations

import uuid

import pytest
import trio

from runplane.engine import open_tenant
from runplane.engine import schema as schema_ddl
from runplane.engine.sheets import RowOutcome, admit, complete
from runplane.engine.sheets.layout import SHEET_FILLFACTOR, layout_for
from tests.sheet_helpers import CONTRACT, PLAY, new_run, play_scope, table_locked

NS = "fill"


async def pages(tenant) -> dict[str, int]:
    """Each row's heap page, by row key."""
    layout = layout_for(tenant, play_scope(tenant), NS)
    async with tenant.connection("sheet") as conn:
        rows = await conn.fetch(
            f"SELECT _key, (ctid::text::point)[0]::bigint AS page FROM {layout.qualified}")
    return {row["_key"]: row["page"] for row in rows}


async def fillfactor(tenant, schema: str, namespace: str = NS) -> list[str] | None:
    layout = layout_for(tenant, play_scope(tenant), namespace)
    async with tenant.connection("sheet") as conn:
        return await conn.fetchval("SELECT reloptions FROM pg_class WHERE oid = $1::regclass",
                                   layout.qualified)


async def test_a_completion_writes_its_rows_on_their_own_pages(tenant):
    """Every completed version fits on the page its admitted row is on (a HOT update: no index
    entry, no other page), for the smallest rows (one short input, one output with its cell
    meta: the completion more than doubles them). At the fillfactor before (70), three rows in
    four moved."""
    run = await new_run(tenant, PLAY, "r1")
    admitted = (await admit(tenant, run, NS, CONTRACT,
                            [{"name": f"row-{i}"} for i in range(2_000)])).pending
    before = await pages(tenant)
    assert len(set(before.values())) > 10  # many pages, not one
    await complete(tenant, run, NS, CONTRACT,
                   [RowOutcome(row.key, "completed", {"score": i}) for i, row in enumerate(admitted)])
    assert await pages(tenant) == before
    assert await fillfactor(tenant, tenant.schema) == [f"fillfactor={SHEET_FILLFACTOR}"]


async def test_the_upgrade_sets_an_older_sheet_to_the_fillfactor(tenant, dsn):
    """A sheet made by a release before schema version 16 (fillfactor 70) is set to
    `SHEET_FILLFACTOR` by the next `open_tenant`'s upgrade; its rows stay as they were."""
    run = await new_run(tenant, PLAY, "r1")
    await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    layout = layout_for(tenant, play_scope(tenant), NS)
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"ALTER TABLE {layout.qualified} SET (fillfactor = 70)")
        await conn.execute(
            f"""UPDATE "{tenant.schema}".meta SET value = '15' WHERE key = 'schema_version'""")
    before = await pages(tenant)
    async with open_tenant(tenant.org_id, dsn, schema=tenant.schema) as reopened:
        assert await fillfactor(reopened, tenant.schema) == [f"fillfactor={SHEET_FILLFACTOR}"]
        assert await pages(reopened) == before


async def older_sheets(tenant, other: str):
    """Two sheets (`NS` and `other`) made as before schema version 16 (fillfactor 70); the
    layout of `other`."""
    run = await new_run(tenant, PLAY, "r1")
    async with tenant.connection("sheet") as conn:
        for namespace in (NS, other):
            await admit(tenant, run, namespace, CONTRACT, [{"name": namespace}])
            layout = layout_for(tenant, play_scope(tenant), namespace)
            await conn.execute(f"ALTER TABLE {layout.qualified} SET (fillfactor = 70)")
    return layout_for(tenant, play_scope(tenant), other)


async def set_schema_version(tenant, version: str) -> None:
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"""UPDATE "{tenant.schema}".meta SET value = $1"""
                           " WHERE key = 'schema_version'", version)


async def assert_upgraded_but(tenant, dsn, other: str) -> None:
    """Opening the tenant upgrades the schema: `NS` is set to the fillfactor, `other` is not."""
    with trio.fail_after(60):
        async with open_tenant(tenant.org_id, dsn, schema=tenant.schema) as reopened:
            assert await fillfactor(reopened, tenant.schema) == [f"fillfactor={SHEET_FILLFACTOR}"]
            assert await fillfactor(reopened, tenant.schema, other) == ["fillfactor=70"]
            async with reopened.connection("sheet") as conn:
                assert await conn.fetchval(
                    f"""SELECT value FROM "{tenant.schema}".meta WHERE key = 'schema_version'"""
                ) == schema_ddl.SCHEMA_VERSION


async def test_the_upgrade_skips_a_sheet_it_cannot_lock_at_once(tenant, dsn, monkeypatch):
    """A sheet that another transaction holds while the upgrade runs keeps its fillfactor (the
    upgrade waits at most the bootstrap's lock timeout for it, then goes on); the other sheets
    are set and the schema reaches its version."""
    monkeypatch.setattr(schema_ddl, "BOOTSTRAP_LOCK_TIMEOUT", "200ms")
    held = await older_sheets(tenant, "held")
    await set_schema_version(tenant, "15")
    # the lock a change of storage settings needs
    async with table_locked(tenant, held.qualified, "SHARE UPDATE EXCLUSIVE"):
        await assert_upgraded_but(tenant, dsn, "held")


async def test_the_upgrade_skips_a_sheet_its_login_may_not_alter(tenant, dsn, admin_dsn):
    """A sheet owned by another role keeps its fillfactor (the upgrading login may not alter
    it); the other sheets are set and the schema reaches its version. A superuser may alter
    any table, so the owner-role pass (`RUNPLANE_TEST_OWNER_ROLE=1`) runs this."""
    async with tenant.connection("sheet") as conn:
        if await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
            pytest.skip("the login is a superuser; the owner-role pass runs this test")
        owner = await conn.fetchval("SELECT current_user")
    theirs = await older_sheets(tenant, "theirs")
    stranger = f"stranger_{uuid.uuid4().hex[:8]}"
    # opened while the schema is current (opening it older would upgrade it as a superuser)
    async with open_tenant("org-admin", admin_dsn, schema=tenant.schema) as admin:
        async with admin.connection("sheet") as conn:
            await conn.execute(f'CREATE ROLE "{stranger}" NOLOGIN')
            await conn.execute(f'ALTER TABLE {theirs.qualified} OWNER TO "{stranger}"')
        try:
            await set_schema_version(tenant, "15")
            await assert_upgraded_but(tenant, dsn, "theirs")
        finally:
            async with admin.connection("sheet") as conn:
                await conn.execute(f'ALTER TABLE {theirs.qualified} OWNER TO "{owner}"')
                await conn.execute(f'DROP ROLE "{stranger}"')
