"""open_run: registration, epochs, receipts bound to the run, the nursery, the outbox entry."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from runplane.actors import open_run
from runplane.engine.runs import outbox
from runplane.engine import receipts
from runplane.engine.errors import InvalidInputError, ScopeError
from runplane.engine.runs import new_run_id
from runplane.engine.values.scopes import RunScope


async def outbox_rows(tenant) -> list[tuple[str, str]]:
    async with tenant.connection("receipts") as conn:
        rows = await conn.fetch(f'SELECT run_id, state FROM "{tenant.schema}".terminal_outbox ORDER BY run_id')
    return [(row["run_id"], row["state"]) for row in rows]


async def test_new_runs_get_time_ordered_ids_and_growing_epochs(tenant):
    async with open_run(tenant, "play", retire_on_exit=False) as first:
        pass
    async with open_run(tenant, "play", retire_on_exit=False) as second:
        pass
    assert first.run_id < second.run_id
    assert first.epoch < second.epoch
    assert first.scope == RunScope(tenant.org_id, "play", first.run_id)


async def test_reopening_a_run_keeps_its_epoch(tenant):
    run_id = new_run_id()
    async with open_run(tenant, "play", run_id, retire_on_exit=False) as first:
        pass
    async with open_run(tenant, "play", retire_on_exit=False) as newer:
        pass
    async with open_run(tenant, "play", run_id, retire_on_exit=False) as woken:
        pass
    assert woken.epoch == first.epoch < newer.epoch


async def test_claim_and_complete_are_fenced_by_the_run_epoch(tenant):
    run_id = new_run_id()
    async with open_run(tenant, "play", run_id, retire_on_exit=False) as old:
        assert (await old.claim("k")).disposition == "claimed"
    async with open_run(tenant, "play", retire_on_exit=False) as new:
        assert (await new.claim("k")).disposition == "running"  # the old run holds it
        assert (await new.claim("k", reclaim_running=True)).disposition == "claimed"
    async with open_run(tenant, "play", run_id, retire_on_exit=False) as woken:
        assert (await woken.claim("k")).disposition == "fenced"
        stored = await woken.complete("k", {"by": "old"})
        assert stored.run_id == new.run_id and stored.status == "running"
    async with open_run(tenant, "play", new.run_id, retire_on_exit=False) as again:
        stored = await again.complete("k", {"by": "new"})
    assert stored.status == "completed" and stored.output == {"by": "new"}
    got = await receipts.get(tenant, new.scope.play_scope, "k")
    assert got.output == {"by": "new"} and got.epoch == new.epoch


async def test_body_errors_come_out_unwrapped(tenant):
    with pytest.raises(ZeroDivisionError):
        async with open_run(tenant, "play", retire_on_exit=False):
            1 / 0


async def test_tasks_started_on_the_run_do_not_outlive_it(tenant):
    started = trio.Event()
    finished = []

    async def actor(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started("ready")
        started.set()
        await trio.sleep(0.01)
        finished.append(True)

    async with open_run(tenant, "play", retire_on_exit=False) as run:
        assert await run.start(actor) == "ready"
    assert finished == [True]  # the run waited for its actor

    with trio.move_on_after(0.2) as scope:  # a cancelled run cancels its actors
        async with open_run(tenant, "play", retire_on_exit=False) as run:
            run.start_soon(trio.sleep_forever)
            await trio.sleep_forever()
    assert scope.cancelled_caught


async def test_a_bad_play_name_raises_before_any_query(tenant):
    with pytest.raises(ScopeError):
        async with open_run(tenant, "  "):
            pass
    with pytest.raises(InvalidInputError):
        async with open_run(tenant, "play", attempt=("a1", 1)):
            pass
    assert await outbox_rows(tenant) == []


async def test_open_records_the_outbox_entry_and_cancellation_leaves_it_open(tenant):
    run_id = new_run_id()
    with trio.move_on_after(0.1):
        async with open_run(tenant, "play", run_id):
            await trio.sleep_forever()
    assert await outbox_rows(tenant) == [(run_id, "open")]
    entry = await outbox.get(tenant, RunScope(tenant.org_id, "play", run_id))
    assert entry.state == "open" and entry.attempts == 0
