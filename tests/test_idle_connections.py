"""Pooled connections idle `RUNPLANE_IDLE_CLOSE_S` (15 s by default) are closed, so an idle
process holds none of the server's connections; a busy one keeps the ones it uses."""

from __future__ import annotations

import pytest
import trio

from runplane.engine import open_tenant
from runplane.engine.errors import InvalidInputError
from runplane.engine.tenant import IDLE_CLOSE_S


async def _alive(tenant, pids) -> int:
    async with tenant.connection("receipts") as conn:
        return await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])", sorted(pids))


async def test_idle_pooled_connections_are_closed_and_the_pool_goes_on(dsn, tenant, monkeypatch):
    monkeypatch.setenv("RUNPLANE_IDLE_CLOSE_S", "0.6")
    async with open_tenant("org-test", dsn, schema=tenant.schema) as idle:
        assert (idle.idle_close_s, IDLE_CLOSE_S) == (0.6, 15.0)
        async with idle.connection("sheet") as a, idle.connection("receipts") as b, \
                idle.connection("retirement") as c:
            pids = {a.backend_pid, b.backend_pid, c.backend_pid}
        assert await _alive(tenant, pids) == 3 and len(idle._idle) == 3
        with trio.fail_after(20):
            while await _alive(tenant, pids):
                await trio.sleep(0.1)
        assert idle._idle == []
        async with idle.connection("sheet") as conn:  # a new one, when asked for
            assert await conn.fetchval("SELECT 1") == 1 and conn.backend_pid not in pids


async def test_a_connection_in_use_is_not_closed_however_long_it_works(dsn, tenant, monkeypatch):
    monkeypatch.setenv("RUNPLANE_IDLE_CLOSE_S", "0.3")
    async with open_tenant("org-test", dsn, schema=tenant.schema) as busy:
        async with busy.connection("sheet") as conn:
            await trio.sleep(1.2)  # four reaper rounds pass while it is checked out
            assert await conn.fetchval("SELECT 2") == 2


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
async def test_a_bad_idle_close_setting_is_refused_before_connecting(dsn, monkeypatch, value):
    monkeypatch.setenv("RUNPLANE_IDLE_CLOSE_S", value)
    with pytest.raises(InvalidInputError, match="RUNPLANE_IDLE_CLOSE_S"):
        async with open_tenant("org-test", dsn, schema="never_created"):
            pass
