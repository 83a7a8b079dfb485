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
def dsn() -> str:
    given = os.environ.get("RUNPLANE_TEST_DSN")
    if given:
        return given
    root = Path(tempfile.mkdtemp(prefix="runplane-test-"))
    return start_embedded(root / "pg", temporary=True)


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
        try:
            async with open_tenant("org-test", dsn, schema=schema, execution_role=role) as tenant:
                yield tenant
        finally:
            async with admin.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}_admin" CASCADE')
                await conn.execute(f'DROP OWNED BY "{role}"')
                await conn.execute(f'DROP ROLE "{role}"')
