"""Test fixtures: one real PostgreSQL per session, a fresh schema per test.

`RUNPLANE_TEST_DSN` points the suite at an existing server; otherwise one embedded server is
started in a temporary directory for the session and deleted afterwards.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest

from runplane.engine import open_tenant
from runplane.engine.embedded import start_embedded


@pytest.fixture(scope="session")
def admin_dsn() -> str:
    """The test server as its superuser (or as `RUNPLANE_TEST_DSN`'s login): for what a test
    does to the server itself, never for runplane."""
    given = os.environ.get("RUNPLANE_TEST_DSN")
    if given:
        return given
    root = Path(tempfile.mkdtemp(prefix="runplane-test-"))
    return start_embedded(root / "pg", temporary=True)


@pytest.fixture(scope="session")
def second_dsn() -> str:
    """A second embedded PostgreSQL server (its own data directory), started by the first test
    that asks for it (many servers: tests/test_many_servers*.py)."""
    root = Path(tempfile.mkdtemp(prefix="runplane-test-2-"))
    return start_embedded(root / "pg", temporary=True)


@pytest.fixture(scope="session")
def dsn(admin_dsn) -> str:
    """Where runplane connects in the tests: the admin DSN, or with
    `RUNPLANE_TEST_OWNER_ROLE=1` an owner role with only CREATEROLE and CREATE on the database
    (as on a managed service) and `pg_signal_backend` (see docs/guide/production.md)."""
    if os.environ.get("RUNPLANE_TEST_OWNER_ROLE") != "1":
        return admin_dsn
    return owner_role_dsn(admin_dsn)


OWNER_ROLE = "runplane_test_owner"
OWNER_PASSWORD = "owner-" + uuid.uuid4().hex  # the role lives as long as the test server


def owner_role_dsn(admin_dsn: str) -> str:
    """Create (once) the owner role a managed service would give runplane, and its DSN."""
    import asyncpg
    import urllib.parse

    async def create() -> None:
        conn = await asyncpg.connect(admin_dsn)
        try:
            exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", OWNER_ROLE)
            if not exists:
                await conn.execute(f"CREATE ROLE \"{OWNER_ROLE}\" LOGIN CREATEROLE "
                                   f"PASSWORD '{OWNER_PASSWORD}'")
            database = await conn.fetchval("SELECT current_database()")
            await conn.execute(f'GRANT CREATE ON DATABASE "{database}" TO "{OWNER_ROLE}"')
            # What ends expired sessions' connections (docs/guide/production.md lists it).
            await conn.execute(f'GRANT pg_signal_backend TO "{OWNER_ROLE}"')
        finally:
            await conn.close()

    import asyncio

    asyncio.run(create())
    url = urllib.parse.urlsplit(admin_dsn)
    netloc = (f"{OWNER_ROLE}:{OWNER_PASSWORD}@{url.hostname or ''}"
              + (f":{url.port}" if url.port else ""))
    return urllib.parse.urlunsplit(url._replace(netloc=netloc))


def fresh_schema() -> str:
    return f"t_{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def tenant(dsn):
    schema = fresh_schema()
    async with open_tenant("org-test", dsn, schema=schema) as tenant:
        try:
            yield tenant
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
async def role_tenant(dsn):
    """A tenant whose every checkout runs inside a transaction as a fresh NOLOGIN execution
    role (`outer_transaction` is true); the role and its schemas are dropped afterwards."""
    schema = fresh_schema()
    role = f"rp_exec_{uuid.uuid4().hex[:12]}"
    async with open_tenant("org-test", dsn, schema=f"{schema}_admin") as admin:
        async with admin.connection("sheet") as conn:
            await conn.execute(f'CREATE ROLE "{role}" NOLOGIN')
            # The login must be a member to SET ROLE: a superuser is; an owner role with
            # CREATEROLE grants it to itself (PostgreSQL 16 gives the creator ADMIN only).
            await conn.execute(f'GRANT "{role}" TO CURRENT_USER')
        try:
            async with open_tenant("org-test", dsn, schema=schema, execution_role=role) as tenant:
                yield tenant
        finally:
            async with admin.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}_admin" CASCADE')
                await conn.execute(f'DROP OWNED BY "{role}"')
                await conn.execute(f'DROP ROLE "{role}"')
