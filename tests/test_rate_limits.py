"""Shared rate-limit buckets in the tenant database: one statement per lease, all or nothing,
never over-issued; existing tenants get the table with no manual step."""

from __future__ import annotations

import pytest

from runplane.engine import open_tenant
from runplane.engine.limits import rates as rate_limits
from runplane.engine.errors import InvalidInputError, ScopeError
from runplane.engine.schema import SCHEMA_VERSION
from runplane.simulations.ports import CountingPort


async def test_a_lease_is_one_statement_and_all_or_nothing(tenant):
    counting = CountingPort(tenant)
    lease = await rate_limits.lease(counting, tenant.org_id, "tool", per_second=10.0, burst=10.0,
                                    want=5)
    assert (lease.granted, lease.retry_after_s) == (5, 0.0)
    assert counting.round_trips == 1
    assert (await rate_limits.lease(tenant, tenant.org_id, "tool", per_second=10.0, burst=10.0,
                                    want=5)).granted == 5
    empty = await rate_limits.lease(tenant, tenant.org_id, "tool", per_second=10.0, burst=10.0,
                                    want=5)
    # The bucket is (nearly) empty: nothing is granted, and the wait is what 5 tokens take.
    assert empty.granted == 0 and 0 < empty.retry_after_s <= 0.5
    other = await rate_limits.lease(tenant, tenant.org_id, "other-tool", per_second=10.0,
                                    burst=10.0, want=5)
    assert other.granted == 5  # keys are separate buckets


async def test_tokens_granted_never_exceed_the_burst_plus_the_rate(tenant):
    """However fast leases come, the total granted by the server clock's elapsed time stays
    within burst + per_second × elapsed."""
    per_second, burst = 100.0, 20.0
    granted = 0
    async with tenant.connection("receipts") as conn:
        started = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
    for _ in range(60):
        lease = await rate_limits.lease(tenant, tenant.org_id, "burst", per_second=per_second,
                                        burst=burst, want=4)
        granted += lease.granted
    async with tenant.connection("receipts") as conn:
        ended = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
    assert granted <= burst + per_second * (ended - started)


@pytest.mark.parametrize("kwargs, error", [
    ({"key": ""}, InvalidInputError), ({"key": "x" * 257}, InvalidInputError),
    ({"per_second": 0.0}, InvalidInputError), ({"burst": float("nan")}, InvalidInputError),
    ({"want": 11}, InvalidInputError), ({"want": 0}, InvalidInputError),
    ({"org_id": "another-org"}, ScopeError),
])
async def test_bad_leases_are_refused_before_any_query(tenant, kwargs, error):
    counting = CountingPort(tenant)
    arguments = {"org_id": tenant.org_id, "key": "tool", "per_second": 10.0, "burst": 10.0,
                 "want": 5, **kwargs}
    org_id, key = arguments.pop("org_id"), arguments.pop("key")
    with pytest.raises(error):
        await rate_limits.lease(counting, org_id, key, **arguments)
    assert counting.round_trips == 0


async def test_an_existing_tenant_gets_the_table_when_it_opens(tenant, dsn):
    """A tenant bootstrapped before rate limits (schema version 1, no table) is upgraded by the
    next `open_tenant`: no manual step."""
    async with tenant.connection("sheet") as conn:
        await conn.execute(f'DROP TABLE "{tenant.schema}".rate_limits')
        await conn.execute(
            f"""UPDATE "{tenant.schema}".meta SET value = '1' WHERE key = 'schema_version'""")
    async with open_tenant(tenant.org_id, dsn, schema=tenant.schema) as reopened:
        lease = await rate_limits.lease(reopened, tenant.org_id, "tool", per_second=5.0,
                                        burst=5.0, want=1)
        async with reopened.connection("sheet") as conn:
            version = await conn.fetchval(
                f"""SELECT value FROM "{tenant.schema}".meta WHERE key = 'schema_version'""")
    assert lease.granted == 1 and version == SCHEMA_VERSION
