"""Shared fixtures for the gateway tests: a real gateway server on a random port, over the
test tenant's schema, and a client with a short retry policy."""

from __future__ import annotations

import contextlib

import pytest

from runplane.engine.gateway import RetryPolicy, ServerOptions, mint_token, open_gateway, open_server

SECRET = "test-gateway-secret-" + "x" * 24
FAST_RETRY = RetryPolicy(answered_delays_s=(0.01, 0.02, 0.05), unreachable_budget_s=20.0,
                         request_timeout_s=30.0, completion_total_s=60.0, min_answered_wait_s=0.0)


@contextlib.asynccontextmanager
async def serving(tenant, **options):
    """A gateway over the tenant's database and schema (options go to `open_server`)."""
    async with open_server(secret=SECRET, dsn=tenant.dsn, schema=tenant.schema,
                           options=ServerOptions(**options)) as server:
        yield server


def token_for(tenant, **claims) -> str:
    return mint_token(SECRET, tenant.org_id, **claims)


@pytest.fixture
async def server(tenant):
    async with serving(tenant) as server:
        yield server


@pytest.fixture
async def gateway(tenant, server):
    async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
        yield gateway


async def count_rows(tenant, table: str) -> int:
    async with tenant.connection("receipts") as conn:
        return await conn.fetchval(f'SELECT count(*) FROM "{tenant.schema}"."{table}"')
