"""`runplane doctor` shows the server's connection headroom, connections by role, database
sessions' connections by org, and the privileges an owner role lacks (docs/guide/production.md)."""

from __future__ import annotations

import re
import urllib.parse
import uuid

import trio

from runplane.engine import PlayScope, open_tenant, sessions

from .cli_helpers import cli_env, run_cli
from .conftest import fresh_schema
from .session_helpers import admin_tenant, session_tenant, unique


def doctor(dsn: str, schema: str):
    return run_cli("doctor", "--schema", schema, env=cli_env(RUNPLANE_DSN=dsn))


async def test_doctor_shows_headroom_roles_and_sessions_by_org(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        minted = await sessions.mint(admin, PlayScope(org, "play"), "t", ["receipts"])
        async with session_tenant(dsn, minted) as session:
            async with session.connection("receipts") as conn:
                await conn.fetchval("SELECT 1")
                done = await trio.to_thread.run_sync(doctor, dsn, admin.schema)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^connections \d+ of \d+ in use \(\d+ reserved\): headroom \d+$",
                     done.stdout, re.MULTILINE), done.stdout
    assert re.search(rf"^ +by role: .*{re.escape(minted.role)} 1", done.stdout, re.MULTILINE), done.stdout
    assert re.search(rf"^ +database sessions by org: {re.escape(org)} 1$", done.stdout,
                     re.MULTILINE), done.stdout


async def test_doctor_names_the_privileges_an_owner_role_lacks(admin_dsn, tenant):
    role, password = f"rp_doctor_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    async with open_tenant("org-admin", admin_dsn, schema=tenant.schema) as admin:
        async with admin.login_connection() as conn:
            await conn.execute(f"CREATE ROLE {role} LOGIN CREATEROLE PASSWORD '{password}'")
            await conn.execute(f"GRANT CREATE ON DATABASE postgres TO {role}")
        try:
            url = urllib.parse.urlsplit(admin_dsn)
            owner = urllib.parse.urlunsplit(url._replace(
                netloc=f"{role}:{password}@{url.hostname or ''}"
                + (f":{url.port}" if url.port else "")))
            done = await trio.to_thread.run_sync(doctor, owner, fresh_schema())
            assert done.returncode == 0, done.stderr
            assert "privileges  missing pg_signal_backend" in done.stdout, done.stdout
            assert f"(GRANT pg_signal_backend TO {role})" in done.stdout
        finally:
            async with admin.login_connection() as conn:
                await conn.execute(f"DROP OWNED BY {role}")
                await conn.execute(f"DROP ROLE {role}")
