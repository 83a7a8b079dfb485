"""The array sealer and the retirement guard: stage, replay on a wake, retire, fence a zombie."""

from __future__ import annotations

import pytest
import trio

from runplane.actors import open_run
from runplane.engine.array_input import Occurrence
from runplane.engine.errors import InvalidInputError, RetiredError
from runplane.engine.runs import new_run_id
from runplane.simulations.ports import GatedPort

from .run_helpers import fact_kinds, guard_retired, occurrences, outbox_state


async def read_all(staged) -> list[Occurrence]:
    rows = []
    async for page in staged.pages():
        assert page.offset == len(rows)
        rows.extend(page.rows)
    return rows


async def test_stage_replay_and_retire_on_exit(tenant):
    source = occurrences(2500)
    async with open_run(tenant, "play") as run:
        staged = await run.stage_array("Companies", "map-0", source)
        assert staged.manifest.state == "sealed"
        assert staged.manifest.page_count == 3 and staged.manifest.source_rows == 2500
        assert await read_all(staged) == source
        assert sorted(set(await fact_kinds(tenant, run.run_id))) == [
            "array_input_begin", "array_input_guard", "array_input_page", "array_input_seal"]
        assert await outbox_state(tenant, run.run_id) == "open"
    assert await fact_kinds(tenant, run.run_id) == ["array_input_guard"]
    assert await guard_retired(tenant, run.run_id) is True
    assert await outbox_state(tenant, run.run_id) == "done"


async def test_a_failing_body_is_terminal_and_retired(tenant):
    with pytest.raises(KeyError):
        async with open_run(tenant, "play") as run:
            await run.stage_array("t", "m", occurrences(10))
            raise KeyError("boom")
    assert await fact_kinds(tenant, run.run_id) == ["array_input_guard"]
    assert await outbox_state(tenant, run.run_id) == "done"


async def test_a_wake_replays_the_sealed_input(tenant):
    """The wake passes the same list (a different one is a ConflictError: see
    test_map_invocations) and reads the staged pages back."""
    run_id = new_run_id()
    source = occurrences(1200, tag="first")
    with trio.move_on_after(5) as crash:
        async with open_run(tenant, "play", run_id) as run:
            await run.stage_array("t", "m", source)
            crash.cancel()  # the run crashes after staging
            await trio.sleep_forever()
    assert crash.cancelled_caught
    assert await outbox_state(tenant, run_id) == "open"  # kept for the wake
    async with open_run(tenant, "play", run_id) as woken:
        staged = await woken.stage_array("t", "m", occurrences(1200, tag="first"))
        assert await read_all(staged) == source
    assert await fact_kinds(tenant, run_id) == ["array_input_guard"]


async def test_a_wake_resumes_staging_that_was_cancelled_midway(tenant):
    run_id = new_run_id()
    source = occurrences(5000)
    port = GatedPort(tenant)
    # manifest, begin, then page puts: park the third put and cancel the run there.
    gate = port.gate_checkout(5)
    async with trio.open_nursery() as nursery:
        crash = trio.CancelScope()

        async def crashing_run():
            with crash:
                async with open_run(port, "play", run_id) as run:
                    await run.stage_array("t", "m", source)

        nursery.start_soon(crashing_run)
        with trio.fail_after(10):
            await gate.wait_reached()
        crash.cancel()
    assert await outbox_state(tenant, run_id) == "open"
    kinds = await fact_kinds(tenant, run_id)
    assert "array_input_seal" not in kinds and "array_input_begin" in kinds
    async with open_run(tenant, "play", run_id) as woken:
        staged = await woken.stage_array("t", "m", source)
        assert staged.manifest.page_count == 5
        assert await read_all(staged) == source
    assert await fact_kinds(tenant, run_id) == ["array_input_guard"]


def nth_scan_batch(n: int):
    seen = [0]

    def matches(boundary) -> bool:
        if boundary.kind == "query" and boundary.sql and "WITH ORDINALITY" in boundary.sql:
            seen[0] += 1
            return seen[0] == n
        return False

    return matches


async def test_a_sealer_still_scanning_when_the_run_retires_is_fenced_by_the_guard(tenant):
    """A zombie incarnation of the run is parked in the middle of its seal scan while the woken
    incarnation ends terminally and retires: the zombie's seal must refuse (the guard row), and
    nothing but the retained guard may be left behind."""
    run_id = new_run_id()
    zombie_port = GatedPort(tenant)
    gate = zombie_port.gate(nth_scan_batch(2))
    outcome: list[BaseException] = []

    async def zombie():
        try:
            async with open_run(zombie_port, "play", run_id, retire_on_exit=False) as run:
                await run.stage_array("t", "m", occurrences(6000))
        except RetiredError as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(zombie)
        with trio.fail_after(20):
            await gate.wait_reached()
        async with open_run(tenant, "play", run_id):
            pass  # the wake ends terminally: its guard retires the run
        assert await guard_retired(tenant, run_id) is True
        gate.release()
    assert len(outcome) == 1 and isinstance(outcome[0], RetiredError)
    assert await fact_kinds(tenant, run_id) == ["array_input_guard"]
    assert await outbox_state(tenant, run_id) == "done"


async def test_bad_occurrences_raise_before_any_write(tenant):
    async with open_run(tenant, "play", retire_on_exit=False) as run:
        with pytest.raises(InvalidInputError):
            await run.stage_array("t", "m", [{"ok": 1}, "not a row"])
        with pytest.raises(InvalidInputError):
            await run.stage_array("t", "m", [{"bad": float("nan")}])
    assert await fact_kinds(tenant, run.run_id) == []


async def test_putters_take_a_permit_per_page_and_only_a_few_at_once(tenant):
    import attrs

    from runplane.actors.sealer import PUT_TASKS
    from runplane.simulations.ports import HookedPort

    @attrs.define(eq=False)
    class Watch:
        checkouts: int = 0
        peak: int = 0

        async def at_boundary(self, boundary) -> None:
            if boundary.kind == "checkout":
                self.checkouts += 1
            else:
                self.peak = max(self.peak, tenant.permits()["receipts"].in_use)
            await trio.sleep(0.001)  # let the other putters reach their checkouts

    watch = Watch()
    async with open_run(HookedPort(tenant, watch), "play") as run:
        staged = await run.stage_array("t", "m", occurrences(9000))
    assert staged.manifest.page_count == 9
    assert watch.checkouts >= 9 + 2  # a checkout per page put, plus begin and seal
    assert 2 <= watch.peak <= PUT_TASKS  # several putters at once, never more than PUT_TASKS
