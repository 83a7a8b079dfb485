"""Shared helpers for the database-session tests: an admin tenant that drops its sessions at
teardown, a seeded org, and a session tenant."""

from __future__ import annotations

import contextlib
import uuid

import trio

from runplane.engine import array_input as A
from runplane.engine import open_tenant, receipts, sessions
from runplane.engine.runs import register
from runplane.engine.values.scopes import PlayScope, RunScope
from runplane.engine.sheets import RowOutcome, SheetContract, admit, complete, ensure_sheet
from runplane.engine.sql import qualified

from .array_input_support import occurrences, stage
from .conftest import fresh_schema

CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
NAMESPACE = "companies"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def session_roles(tenant) -> list[str]:
    """The session roles recorded in the tenant's schema."""
    async with tenant.login_connection() as conn:
        return list(await conn.fetchval(
            f"SELECT coalesce(array_agg(role_name), '{{}}') FROM {qualified(tenant.schema, 'session_scopes')}"))


async def drop_all_sessions(tenant) -> None:
    """Drop every session of the schema. A closed session's server process exits a moment after
    the client closed it, and a role in use is never dropped: poll until all are gone."""
    with trio.fail_after(20):
        while True:
            await sessions.drop_expired(tenant, include_unexpired=True)
            if not await session_roles(tenant):
                return
            await trio.sleep(0.05)


@contextlib.asynccontextmanager
async def admin_tenant(dsn, org_id: str, schema: str | None = None):
    """A tenant on the login user (who may mint). Its sessions are dropped after; so is its
    schema when this call made it up."""
    owned = schema is None
    schema = schema or fresh_schema()
    async with open_tenant(org_id, dsn, schema=schema) as tenant:
        try:
            yield tenant
        finally:
            await drop_all_sessions(tenant)
            if owned:
                async with tenant.login_connection() as conn:
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextlib.asynccontextmanager
async def session_tenant(dsn, minted: sessions.MintedSession, *, max_connections: int = 2):
    async with open_tenant(minted.scope.org_id, minted.url(dsn), schema=minted.schema,
                           max_connections=max_connections) as tenant:
        yield tenant


async def seed(port, play: str, run_id: str = "run-1") -> dict:
    """Write one of everything a play owns: a run, a receipt, an array input, sheet rows, an
    outbox entry. Returns the run ref and map scope used."""
    scope = PlayScope(port.org_id, play)
    run = await register(port, RunScope(port.org_id, play, run_id))
    claim = await receipts.claim(port, run, "receipt-1")
    assert claim.disposition == "claimed"
    await receipts.complete(port, run, "receipt-1", {"done": play})
    map_scope = run.scope.map(NAMESPACE, "map-1")
    await stage(port, map_scope, occurrences(3))
    await ensure_sheet(port, scope, NAMESPACE, CONTRACT)
    rows = [{"name": f"{play}-{i}"} for i in range(3)]
    admission = await admit(port, run, NAMESPACE, CONTRACT, rows)
    await complete(port, run, NAMESPACE, CONTRACT, [
        RowOutcome(key=row.key, status="completed", data={"score": i})
        for i, row in enumerate(admission.pending)
    ])
    async with port.login_connection() as conn:
        await conn.execute(
            f"INSERT INTO {qualified(port.schema, 'terminal_outbox')} (org_id, play, run_id)"
            " VALUES ($1, $2, $3) ON CONFLICT DO NOTHING", port.org_id, play, run_id)
    return {"run": run, "map": map_scope, "scope": scope, "keys": [r.key for r in admission.pending]}


__all__ = ["A", "CONTRACT", "NAMESPACE", "admin_tenant", "session_tenant", "seed", "unique"]
