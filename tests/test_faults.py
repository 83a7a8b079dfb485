"""The simulation harness itself: counting, gating and fault-injecting ports on a real tenant."""

from __future__ import annotations

import trio
import pytest
from hypothesis import given, settings, HealthCheck

from runplane.engine.errors import StoreUnavailableError
from runplane.simulations.faults import Fault, FaultPlan, FaultyPort, fault_plans
from runplane.simulations.ports import CountingPort, GatedPort


async def test_counting_port_sees_every_statement_including_transaction_control(tenant):
    port = CountingPort(tenant)
    async with port.connection("receipts") as conn:
        async with conn.transaction():
            assert await conn.fetchval("SELECT 1") == 1
    assert port.statements == ["BEGIN", "SELECT 1", "COMMIT"]
    assert port.round_trips == 3
    assert port.checkout_count == 1
    port.reset()
    assert port.round_trips == 0


async def test_unavailable_fault_drops_the_connection_and_the_tenant_recovers(tenant):
    async with tenant.connection("receipts") as conn:
        pid_before = conn.backend_pid
    # step 1: the checkout (none), step 2: BEGIN (none), step 3: the SELECT fails.
    port = FaultyPort(tenant, FaultPlan([Fault("none"), Fault("none"), Fault("unavailable")]))
    with pytest.raises(StoreUnavailableError):
        async with port.connection("receipts") as conn:
            async with conn.transaction():
                await conn.fetchval("SELECT 1")
    assert port.injected == 1 and port.by_kind == {"unavailable": 1}
    assert tenant.permits()["receipts"].in_use == 0
    async with tenant.connection("receipts") as conn:
        assert conn.backend_pid != pid_before  # the dropped connection was not pooled
        assert await conn.fetchval("SELECT 2") == 2


async def test_cancel_fault_cancels_only_the_cancellable_scope(tenant):
    port = FaultyPort(tenant, FaultPlan([Fault("none"), Fault("cancel")]))
    reached_after = False
    with port.cancellable() as scope:
        async with port.connection("receipts") as conn:
            await conn.fetchval("SELECT 1")
            reached_after = True
    assert scope.cancelled_caught and not reached_after
    assert port.injected == 1 and port.by_kind == {"cancel": 1}
    # Plan exhausted: later calls get through untouched.
    async with port.connection("receipts") as conn:
        assert await conn.fetchval("SELECT 3") == 3
    assert port.injected == 1


async def test_cancel_without_a_cancellable_scope_is_a_checkpoint(tenant):
    port = FaultyPort(tenant, FaultPlan([Fault("cancel"), Fault("delay", 0.001)]))
    async with port.connection("receipts") as conn:
        assert await conn.fetchval("SELECT 1") == 1
    assert port.by_kind == {"delay": 1}


async def test_a_fault_at_commit_is_deferred_to_the_next_boundary(tenant):
    plan = FaultPlan([Fault("none"), Fault("none"), Fault("none"), Fault("unavailable")])
    port = FaultyPort(tenant, plan)
    async with port.connection("receipts") as conn:
        async with conn.transaction():
            await conn.fetchval("SELECT 1")
    assert port.injected == 0
    # Deferred to the port's next boundary: it fails the next checkout instead.
    with pytest.raises(StoreUnavailableError):
        async with port.connection("receipts"):
            pass
    assert port.by_kind == {"unavailable": 1} and port.neutralized == 0


async def test_gated_port_parks_the_chosen_checkout_until_released(tenant):
    port = GatedPort(tenant)
    gate = port.gate_checkout(2)
    done = []

    async def two_checkouts():
        for i in range(2):
            async with port.connection("receipts") as conn:
                done.append(await conn.fetchval("SELECT $1::int", i))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(two_checkouts)
            boundary = await gate.wait_reached()
            assert boundary.kind == "checkout" and boundary.checkout == 2
            assert done == [0]
            gate.release()
    assert done == [0, 1]


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=fault_plans(max_steps=6))
def test_any_drawn_plan_leaves_the_tenant_usable(dsn, plan):
    from runplane.engine import open_tenant

    async def example():
        async with open_tenant("org-test", dsn, schema="faults_probe") as tenant:
            port = FaultyPort(tenant, plan)
            for _ in range(3):
                with port.cancellable():
                    try:
                        async with port.connection("receipts") as conn:
                            async with conn.transaction():
                                await conn.fetchval("SELECT 1")
                    except StoreUnavailableError:
                        pass
            assert port.injected <= len(plan.steps)
            async with tenant.connection("receipts") as conn:
                assert await conn.fetchval("SELECT 1") == 1
            assert all(stats.in_use == 0 for stats in tenant.permits().values())

    trio.run(example)


async def test_wrappers_compose_a_gate_around_a_counter(tenant):
    counter = CountingPort(tenant)
    port = GatedPort(counter)
    gate = port.gate_query(2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async def work():
                async with port.connection("receipts") as conn:
                    async with conn.transaction():
                        await conn.fetchval("SELECT 1")

            nursery.start_soon(work)
            boundary = await gate.wait_reached()
            assert boundary.sql == "SELECT 1"
            assert counter.statements == ["BEGIN"]
            gate.release()
    assert counter.statements == ["BEGIN", "SELECT 1", "COMMIT"]


async def test_lost_reply_applies_the_statement_but_the_caller_sees_a_transient_error(tenant):
    from runplane.engine.ports import table

    port = FaultyPort(tenant, FaultPlan([Fault("lost_reply"), Fault("lost_reply")]))
    with pytest.raises(StoreUnavailableError):
        async with port.connection("receipts") as conn:  # step 1 (checkout): not applicable
            await conn.execute(  # step 2: runs, then the reply is lost
                f"INSERT INTO {table(tenant, 'meta')} (key, value) VALUES ('probe', 'applied')"
            )
    assert port.by_kind == {"lost_reply": 1}
    async with tenant.connection("receipts") as conn:
        assert await conn.fetchval(
            f"SELECT value FROM {table(tenant, 'meta')} WHERE key = 'probe'") == "applied"
    assert tenant.permits()["receipts"].in_use == 0


def test_lost_reply_is_opt_in():
    from hypothesis import find

    from runplane.simulations.faults import ALL_FAULT_KINDS, FAULT_KINDS

    assert "lost_reply" not in FAULT_KINDS and "lost_reply" in ALL_FAULT_KINDS
    plan = find(fault_plans(kinds=ALL_FAULT_KINDS), lambda p: any(f.kind == "lost_reply" for f in p.steps))
    assert plan.steps[-1].kind == "lost_reply"
