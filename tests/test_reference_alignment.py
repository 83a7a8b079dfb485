"""Where runplane used to differ from the reference, aligned: a failed rollback is never
retried (one that failed because the connection was lost is an outage: the server rolled back), `read_rows` clamps its limit to 1..10,000, a manifest with no run guard reads as
staging."""

from __future__ import annotations

import pytest

from runplane.actors.retry import OutageWatch, retry_transient
from runplane.engine import array_input as A
from runplane.engine.errors import (
    RollbackFailedError, TransactionStateUnknownError,
)
from runplane.engine import open_tenant
from runplane.engine.ports import table
from runplane.engine.sheets import SheetContract, admit, read_rows
from tests.array_input_support import occurrences, stage
from tests.conftest import fresh_schema
from tests.pg_proxy import open_pg_proxy
from tests.sheet_helpers import PLAY, new_run, play_scope
from tests.test_array_input import SCOPE


def failing(error: Exception, calls: list[int]):
    async def operation():
        calls.append(1)
        raise error
    return operation


async def test_a_failed_rollback_is_never_retried_a_lost_commit_outcome_is():
    rollback = RollbackFailedError("op failed, rollback failed", error=ValueError("op"),
                                   rollback_error=TimeoutError("rollback"))
    lost = TransactionStateUnknownError("commit reply lost", error=OSError("lost"),
                                        rollback_error=OSError("probe"))
    for watch in (None, OutageWatch(budget_s=0.05)):
        calls: list[int] = []
        with pytest.raises(RollbackFailedError):
            await retry_transient(failing(rollback, calls), delays=(0.001, 0.001), watch=watch)
        assert calls == [1]
    calls = []
    with pytest.raises(TransactionStateUnknownError):
        await retry_transient(failing(lost, calls), delays=(0.001, 0.001))
    assert len(calls) == 3


async def test_a_rollback_that_does_not_answer_raises_rollback_failed(dsn):
    async with open_pg_proxy(dsn) as proxy:
        async with open_tenant("org-rb", proxy.dsn, schema=fresh_schema()) as tenant:
            async with tenant.connection("sheet") as conn:
                with pytest.raises(RollbackFailedError) as info:
                    async with conn.transaction():
                        await conn.execute("SELECT 1")
                        proxy.set_blackhole(True)  # the ROLLBACK goes out, no answer comes
                        raise ValueError("operation failed")
            proxy.set_blackhole(False)
    assert isinstance(info.value, TransactionStateUnknownError)  # still that kind of error
    assert isinstance(info.value.error, ValueError)


async def test_read_rows_clamps_its_limit_to_one_through_ten_thousand(tenant):
    contract = SheetContract(inputs=("name",), outputs=("score",))
    run = await new_run(tenant, PLAY, "r1")
    await admit(tenant, run, "big", contract, [{"name": f"n{i}"} for i in range(10_005)])
    scope = play_scope(tenant)
    assert len(await read_rows(tenant, scope, "big", limit=1_000_000)) == 10_000
    assert len(await read_rows(tenant, scope, "big", limit=0)) == 1
    assert len(await read_rows(tenant, scope, "big", limit=10_000, offset=10_000)) == 5
    assert len(await read_rows(tenant, scope, "big", run_id="r1", limit=50_000)) == 10_000


async def test_a_manifest_with_no_run_guard_reads_as_staging(tenant):
    from runplane.engine.array_input.facts import guard_key

    fingerprint, _ = await stage(tenant, SCOPE, occurrences(3), seal=True)
    assert (await A.get_manifest(tenant, SCOPE)).state == "sealed"
    async with tenant.connection("receipts") as conn:
        await conn.execute(f"DELETE FROM {table(tenant, 'work_receipts')} WHERE k = $1",
                           guard_key(SCOPE))
    manifest = await A.get_manifest(tenant, SCOPE)
    assert manifest.state == "staging" and manifest.source_fingerprint == fingerprint
