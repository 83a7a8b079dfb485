"""The embedded supervisor and the terminal outbox: leases, draining, backoff, restarts."""

from __future__ import annotations

import random

import attrs
import trio

from runplane.actors import open_run, open_supervisor
from runplane.actors import retirement
from runplane.engine.runs import outbox
from runplane.actors.retry import RETRY_DELAYS
from runplane.actors.backoff_delays import half_jittered_s
from runplane.engine.errors import StoreUnavailableError
from runplane.engine.runs import new_run_id
from runplane.engine.values.scopes import PlayScope, RunScope
from runplane.simulations.ports import GatedPort, HookedPort

from .run_helpers import fact_kinds, occurrences, outbox_state


def nth(predicate, n: int):
    """A gate predicate matching the n-th boundary that satisfies `predicate`."""
    seen = [0]

    def matches(boundary) -> bool:
        if predicate(boundary):
            seen[0] += 1
            return seen[0] == n
        return False

    return matches


def retirement_checkout(boundary) -> bool:
    return boundary.kind == "checkout" and boundary.lane == "retirement"


def retirement_statement(boundary) -> bool:
    return boundary.kind == "query" and boundary.lane == "retirement"


async def staged_run(tenant, *, rows: int = 1500) -> RunScope:
    """A run that staged an array input and ended without retiring (entry left `open`)."""
    async with open_run(tenant, "play", retire_on_exit=False) as run:
        await run.stage_array("t", "m", occurrences(rows))
    return run.scope


async def make_pending(tenant, scope: RunScope) -> None:
    async with tenant.connection("receipts") as conn:
        await conn.execute(
            f'UPDATE "{tenant.schema}".terminal_outbox SET state = \'pending\' WHERE run_id = $1',
            scope.run_id,
        )


async def test_backoff_is_capped_exponential_with_jitter():
    rng = random.Random(7)
    for attempts in range(1, 12):
        ceiling = min(8.0, 0.5 * 2 ** (attempts - 1))
        for _ in range(20):
            delay = half_jittered_s(attempts, initial=0.5, cap=8.0, rng=rng)
            assert ceiling / 2 <= delay <= ceiling
    assert len({half_jittered_s(3, initial=1, cap=60, rng=rng) for _ in range(10)}) > 1


async def test_supervisor_finishes_a_retirement_a_cancelled_run_left_pending(tenant, monkeypatch):
    # The run's guard records the entry and retires a first batch in one shielded request,
    # within RECORD_DEADLINE_S: a store that hangs in that batch (the gate) leaves it pending.
    monkeypatch.setattr(retirement, "RECORD_DEADLINE_S", 0.5)
    port = GatedPort(tenant)
    # retirement-lane statements, on one checkout: mark_pending, then the first retire batch.
    gate = port.gate(nth(retirement_statement, 2))
    crash = trio.CancelScope()
    scope_box = []

    async def run_then_cancelled_in_retirement():
        with crash:
            async with open_run(port, "play") as run:
                scope_box.append(run.scope)
                await run.stage_array("t", "m", occurrences(1500))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_then_cancelled_in_retirement)
        with trio.fail_after(10):
            await gate.wait_reached()
        crash.cancel()
    (scope,) = scope_box
    assert await outbox_state(tenant, scope.run_id) == "pending"
    entry = await outbox.get(tenant, scope)
    assert "array_input_page" in await fact_kinds(tenant, scope.run_id)
    async with open_supervisor(tenant, poll_interval=0.05) as sup:
        with trio.fail_after(10):
            await sup.wait_retired(scope)
    assert entry.state == "pending"
    assert await fact_kinds(tenant, scope.run_id) == ["array_input_guard"]
    assert await outbox_state(tenant, scope.run_id) == "done"


async def test_open_entries_are_not_drained_unless_abandoned(tenant):
    scope = await staged_run(tenant)
    async with open_supervisor(tenant, drain=False) as sup:
        assert await sup.drain_once() == []
    assert await outbox_state(tenant, scope.run_id) == "open"
    async with open_supervisor(tenant, drain=False, abandon_after_s=0.0) as sup:
        assert await sup.drain_once() == [scope]
    assert await fact_kinds(tenant, scope.run_id) == ["array_input_guard"]
    assert await outbox_state(tenant, scope.run_id) == "done"


async def test_pending_entries_resume_after_a_drainer_died_holding_the_lease(tenant):
    scope = await staged_run(tenant)
    await make_pending(tenant, scope)
    # A drainer leases the entry and dies without settling it.
    claimed = await outbox.claim_due(tenant, "dead-drainer", limit=10, lease_s=0.3)
    assert [entry.scope for entry in claimed] == [scope]
    async with open_supervisor(tenant, drain=False) as sup:
        assert await sup.drain_once() == []  # the lease still holds
    async with open_supervisor(tenant, poll_interval=0.05) as sup:  # a restarted process
        with trio.fail_after(10):
            await sup.wait_retired(scope)
    assert await fact_kinds(tenant, scope.run_id) == ["array_input_guard"]
    entry = await outbox.get(tenant, scope)
    assert entry.state == "done" and entry.attempts == 2


async def test_two_supervisors_drain_one_outbox_each_entry_once(tenant):
    scopes = [await staged_run(tenant, rows=300) for _ in range(6)]
    for scope in scopes:
        await make_pending(tenant, scope)
    slow = GatedPort(tenant)
    # Supervisor A leases three entries, then parks before its first retirement batch.
    gate = slow.gate(nth(retirement_checkout, 2))
    async with open_supervisor(slow, drain=False, batch=3) as a, \
            open_supervisor(tenant, drain=False, batch=10) as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.drain_once)
            with trio.fail_after(10):
                await gate.wait_reached()
            # While A holds its leases, B drains everything it can: only the other three.
            b_done = await b.drain_once()
            assert len(b_done) == 3
            assert await b.drain_once() == []
            gate.release()
        assert await a.drain_once() == []
        assert await b.drain_once() == []
    assert set(a.retired).isdisjoint(b.retired)
    assert sorted(a.retired + b.retired, key=lambda s: s.run_id) == sorted(
        scopes, key=lambda s: s.run_id)
    for scope in scopes:
        assert await outbox_state(tenant, scope.run_id) == "done"
        assert await fact_kinds(tenant, scope.run_id) == ["array_input_guard"]


async def test_concurrent_supervisors_lose_no_entry(tenant):
    scopes = [await staged_run(tenant, rows=50) for _ in range(10)]
    for scope in scopes:
        await make_pending(tenant, scope)
    async with open_supervisor(tenant, drain=False, batch=2) as a, \
            open_supervisor(tenant, drain=False, batch=2) as b:

        async def drain(sup):
            while await sup.drain_once():
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, a)
            nursery.start_soon(drain, b)
    assert len(a.retired) + len(b.retired) == 10
    assert set(a.retired) | set(b.retired) == set(scopes)
    for scope in scopes:
        assert await outbox_state(tenant, scope.run_id) == "done"


async def test_a_holder_that_lost_its_lease_cannot_settle_the_entry(tenant):
    scope = await staged_run(tenant)
    await make_pending(tenant, scope)
    slow = GatedPort(tenant)
    gate = slow.gate(nth(retirement_checkout, 2))  # after the claim, before retiring
    async with open_supervisor(slow, drain=False, lease_s=0.2) as a, \
            open_supervisor(tenant, drain=False) as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.drain_once)
            with trio.fail_after(10):
                await gate.wait_reached()
            with trio.fail_after(10):
                while not await b.drain_once():  # B takes over once A's lease expired
                    await trio.sleep(0.05)
            gate.release()
    assert b.retired == [scope] and a.retired == []
    assert await outbox_state(tenant, scope.run_id) == "done"


@attrs.define(eq=False)
class FailRetirement:
    """Fails every statement that deletes facts on the retirement lane."""

    failures: int = 0

    async def at_boundary(self, boundary) -> None:
        if boundary.kind == "query" and boundary.lane == "retirement" and boundary.sql \
                and "DELETE" in boundary.sql:
            self.failures += 1
            raise StoreUnavailableError("injected: connection lost")


async def test_a_failed_retirement_is_retried_later_with_backoff(tenant):
    scope = await staged_run(tenant)
    await make_pending(tenant, scope)
    hook = FailRetirement()
    async with open_supervisor(HookedPort(tenant, hook), drain=False, backoff_base=30.0) as sup:
        assert await sup.drain_once() == []
        assert await sup.drain_once() == []  # not due again yet
    # The retirement call was retried through its transient-fault budget, then the entry
    # was put back with a backoff.
    assert hook.failures == len(RETRY_DELAYS) + 1 and sup.failures == 1
    async with tenant.connection("receipts") as conn:
        row = await conn.fetchrow(
            f'SELECT state, attempts, lease_owner, last_error, '
            f'next_attempt_at > now() + interval \'10 seconds\' AS later '
            f'FROM "{tenant.schema}".terminal_outbox WHERE run_id = $1', scope.run_id)
    assert row["state"] == "pending" and row["attempts"] == 1 and row["lease_owner"] is None
    assert "connection lost" in row["last_error"] and row["later"]
    assert "array_input_page" in await fact_kinds(tenant, scope.run_id)


async def test_sup_run_hosts_a_run_and_retires_it(tenant):
    async with open_supervisor(tenant, poll_interval=0.05) as sup:
        async def body(run):
            staged = await run.stage_array("t", "m", occurrences(20))
            return run.scope, staged.manifest.source_rows

        scope, rows = await sup.run("play", body)
        run_id = new_run_id()
        scope2, _ = await sup.run("play", body, run_id=run_id)
    assert rows == 20 and scope2.run_id == run_id
    for s in (scope, scope2):
        assert await outbox_state(tenant, s.run_id) == "done"
        assert await fact_kinds(tenant, s.run_id) == ["array_input_guard"]


@attrs.define(eq=False)
class OutboxDown:
    """The outbox query fails `times` times (the store is unreachable), then recovers."""

    times: int
    failures: int = 0

    async def at_boundary(self, boundary) -> None:
        if boundary.kind == "query" and boundary.sql and "SKIP LOCKED" in boundary.sql \
                and self.failures < self.times:
            self.failures += 1
            raise StoreUnavailableError("injected: store unreachable")


async def test_the_drainer_backs_off_while_the_store_is_down_then_drains(tenant):
    scope = await staged_run(tenant)
    await make_pending(tenant, scope)
    hook = OutboxDown(times=3)
    async with open_supervisor(HookedPort(tenant, hook), poll_interval=0.05,
                               backoff_base=0.01, backoff_cap=0.05) as sup:
        with trio.fail_after(10):
            await sup.wait_retired(scope)
    assert hook.failures == 3 and sup.failures == 3
    assert await outbox_state(tenant, scope.run_id) == "done"


async def test_a_run_cancelled_just_after_its_body_returned_is_still_recorded(tenant):
    # The guard's first request records the entry and retires a batch (shielded): a run that
    # staged less than a batch is recorded and retired before the cancellation lands.
    with trio.CancelScope() as outer:
        async with open_run(tenant, "play") as run:
            await run.stage_array("t", "m", occurrences(30))
            outer.cancel()  # lands in the guard, after the body returned (terminally)
    assert outer.cancelled_caught
    entry = await outbox.get(tenant, run.scope)
    assert entry.state == "done"
    assert await fact_kinds(tenant, run.run_id) == ["array_input_guard"]


async def test_bad_supervisor_options_raise_before_any_query(tenant):
    import pytest

    from runplane.engine.errors import InvalidInputError

    for options in ({"poll_interval": 0}, {"batch": 0}, {"lease_s": -1},
                    {"abandon_after_s": -5}, {"backoff_cap": "x"}):
        with pytest.raises(InvalidInputError):
            async with open_supervisor(tenant, **options):
                pass


async def test_get_many_reads_the_entries_of_a_plays_runs(tenant):
    opened, pending = RunScope(tenant.org_id, "play", "a"), RunScope(tenant.org_id, "play", "b")
    await outbox.record_open(tenant, opened)
    await outbox.mark_pending(tenant, pending, "me", 30.0)
    await outbox.record_open(tenant, RunScope(tenant.org_id, "other", "a"))
    entries = await outbox.get_many(tenant, PlayScope(tenant.org_id, "play"), ["b", "missing", "a", "b"])
    assert list(entries) == ["b", "a"]
    assert (entries["a"].scope, entries["a"].state) == (opened, "open")
    assert (entries["b"].scope, entries["b"].state) == (pending, "pending")
    assert await outbox.get_many(tenant, PlayScope(tenant.org_id, "play"), []) == {}
