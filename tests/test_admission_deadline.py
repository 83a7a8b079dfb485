"""The gateway server's own admission deadline (30 s, as the reference's server): an admission
waiting on a sheet lock past it is cancelled and rolled back, answered 503 with
`retry_after_ms`; the client, which may wait 10 minutes for one admission, rides it."""

from __future__ import annotations

import httpx
import pytest
import trio

from runplane.engine import sheets
from runplane.engine.actions import actions
from runplane.engine.errors import InvalidInputError
from runplane.engine.gateway import ServerOptions, open_gateway, protocol
from runplane.engine.gateway.retry import RetryPolicy
from runplane.engine.gateway.transport import attempt_timeout
from runplane.engine.sheets.layout import layout_for

from .gateway_support import serving, token_for
from .sheet_helpers import new_run, play_scope

NS = "deadline"
CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("score",))
ADMIT = "sheets.admit"
SHORT = {ADMIT: 1.0}  # the test's deadline: the default is the registry's 30 s


def test_the_server_cuts_admission_at_30_s_and_the_client_waits_10_minutes():
    spec = actions()[ADMIT]
    assert ServerOptions().deadline_s(spec) == 30.0
    assert ServerOptions(deadlines_s=SHORT).deadline_s(spec) == 1.0
    assert attempt_timeout(RetryPolicy(), spec) == 600.0
    with pytest.raises(InvalidInputError, match="no action"):
        ServerOptions(deadlines_s={"sheets.nope": 1.0})
    with pytest.raises(InvalidInputError, match="seconds"):
        ServerOptions(deadlines_s={ADMIT: 0})


async def _sheet_rows(tenant) -> int:
    layout = layout_for(tenant, play_scope(tenant, "play"), NS)
    async with tenant.connection("receipts") as conn:
        return await conn.fetchval(f"SELECT count(*) FROM {layout.qualified}")


class _SheetLock:
    """The sheet lock (its summary row, `FOR UPDATE`) held by a test connection."""

    def __init__(self, tenant) -> None:
        self.tenant = tenant
        self.layout = layout_for(tenant, play_scope(tenant, "play"), NS)

    async def hold(self, conn) -> None:
        await conn.execute(
            f'SELECT 1 FROM "{self.tenant.schema}".sheet_summary WHERE org_id = $1 AND play = $2'
            " AND table_namespace = $3 FOR UPDATE", *self.layout.counter_args)


async def test_a_lock_held_past_the_deadline_is_a_503_with_retry_after_and_writes_nothing(tenant):
    run = await new_run(tenant, "play", "r1")
    await sheets.admit(tenant, run, NS, CONTRACT, [{"name": "first"}])  # the sheet exists
    before = await _sheet_rows(tenant)
    rows = [{"name": f"n{i}"} for i in range(2_500)]
    body = protocol.dumps(actions()[ADMIT].encode_input(
        {"run": run, "table_namespace": NS, "contract": CONTRACT, "rows": rows}))
    lock = _SheetLock(tenant)
    async with serving(tenant, deadlines_s=SHORT) as server:
        async with tenant.connection("retirement") as blocker:
            async with blocker.transaction():
                await lock.hold(blocker)
                async with httpx.AsyncClient() as client:
                    with trio.fail_after(20):
                        answer = await client.post(
                            server.url + protocol.ACTIONS_PATH + ADMIT, content=body,
                            headers={"authorization": f"Bearer {token_for(tenant)}",
                                     "content-type": "application/json"})
                assert answer.status_code == 503, answer.text
                payload = answer.json()
                assert payload["retry_after_ms"] > 0 and "deadline" in payload["error"]
                assert await _sheet_rows(tenant) == before
        # The cancelled request's connection is closed; its backend, if still queued for the
        # lock, gets it first, fails to answer and rolls back. A later writer queues behind it,
        # so once that writer is through, the cancelled admission's fate is settled.
        await sheets.admit(tenant, run, NS, CONTRACT, [{"name": "later"}])
        assert await _sheet_rows(tenant) == before + 1
        summary = await sheets.summary(tenant, play_scope(tenant, "play"), NS)
        assert summary.total == before + 1


async def test_the_client_rides_the_503_until_the_lock_is_released(tenant):
    run = await new_run(tenant, "play", "r1")
    await sheets.admit(tenant, run, NS, CONTRACT, [{"name": "first"}])
    rows = [{"name": f"n{i}"} for i in range(100)]
    lock = _SheetLock(tenant)
    policy = RetryPolicy(answered_delays_s=(0.05,) * 7, min_answered_wait_s=0.0)
    result = {}
    async with serving(tenant, deadlines_s={ADMIT: 0.5}) as server:
        async with open_gateway(server.url, token_for(tenant), retry=policy) as gateway:

            async def admit() -> None:
                result["admission"] = await sheets.admit(gateway, run, NS, CONTRACT, rows)

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    async with tenant.connection("retirement") as blocker:
                        async with blocker.transaction():
                            await lock.hold(blocker)
                            nursery.start_soon(admit)
                            while not sum(server.errors.values()):  # a 503 answered
                                await trio.sleep(0.05)
    assert sum(server.errors.values()) >= 1  # at least one attempt ran past the deadline
    assert result["admission"].inserted == 100
    assert await _sheet_rows(tenant) == 101
