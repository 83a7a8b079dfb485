"""Shared maps: one map over many worker processes, PostgreSQL as the coordinator.

Every test checks exact outcomes: each row enriched once (one call, `_attempts` = 1), the
coordinator's `MapResult` against the sheet, counters against COUNT(*).
"""

from __future__ import annotations

import pytest
import trio

from runplane.actors import open_run
from runplane.engine.shared import maps as sm
from runplane.engine.shared import units as shared_units
from runplane.engine.errors import InvalidInputError, LeaseLostError
from runplane.engine.sheets import RowOutcome, SheetContract
from runplane.engine.sheets.layout import layout_for

from .plays.scale_play import meet_tag, tag_pid
from .sheet_helpers import counters_match, play_scope, raw_rows

PLAY = "scale"
CONTRACT = SheetContract(("n",), ("pid", "double"))


async def sheet_state(port, namespace: str):
    layout = layout_for(port, play_scope(port, PLAY), namespace)
    async with port.connection("sheet") as conn:
        return await conn.fetch(f"SELECT _status, _attempts FROM {layout.qualified}")


async def test_workers_spread_a_map_over_two_processes(tenant, tmp_path, monkeypatch):
    # Both workers join before the map opens, so each first claim is half the units; the rows
    # then wait until both processes run rows (a fast worker alone could otherwise finish its
    # half and take the rest before the other one's next poll).
    monkeypatch.setenv("RUNPLANE_TEST_MEET", str(tmp_path))
    rows = [{"n": i} for i in range(3000)]  # six units
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            result = await run.map("nums", rows, meet_tag, contract=CONTRACT, workers=2,
                                   concurrency=8)
    stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n", "pid", "double"))
    assert len(stored) == 3000
    assert all(row["_status"] == "enriched" and row["double"] == 2 * row["n"]
               for row in stored.values())
    pids = {row["pid"] for row in stored.values()}
    assert len(pids) == 2 and __import__("os").getpid() not in pids
    state = await sheet_state(tenant, "nums")
    assert [r["_attempts"] for r in state] == [1] * 3000  # each row called exactly once
    assert (result.completed, result.failed, result.cached, result.fenced) == (3000, 0, 0, 0)
    assert result.executed == 3000 and result.admitted == 3000
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why
    status = await sm.map_status(tenant, run.ref, result.map_invocation_id)
    assert (status.state, status.done, status.units) == ("done", 6, 6)


async def test_a_rerun_of_a_shared_map_is_all_cache_hits(tenant):
    rows = [{"n": i} for i in range(700)]
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            await run.map("nums", rows, tag_pid, contract=CONTRACT, workers=1)
        async with open_run(tenant, PLAY) as run:
            again = await run.map("nums", rows, tag_pid, contract=CONTRACT, workers=1)
    assert (again.completed, again.cached, again.executed) == (0, 700, 0)


def running_children() -> set[int]:
    """This process's live child processes (from /proc; zombies are not running)."""
    pid = __import__("os").getpid()
    out: set[int] = set()
    for task in __import__("os").listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            out.update(int(c) for c in handle.read().split())
    live = set()
    for child in out:
        try:
            with open(f"/proc/{child}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] != "Z":
                    live.add(child)
        except FileNotFoundError:
            pass
    return live


async def test_a_list_refused_while_staging_stops_the_workers_started_for_it(tenant):
    # The local workers start before the list is staged (their start-up overlaps it): a row
    # refused while staging must stop them, and nothing of the map is published.
    before = running_children()
    rows = [{"n": i} for i in range(10)] + [{"n": float("nan")}]
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            with pytest.raises(InvalidInputError):
                await run.map("nums", rows, tag_pid, contract=CONTRACT, workers=2)
    assert running_children() <= before
    async with tenant.connection("sheet") as conn:
        assert await conn.fetchval(
            f'SELECT count(*) FROM "{tenant.schema}".shared_maps') == 0


async def test_a_plain_function_runs_in_the_workers_threads(tenant):
    from .plays.scale_play import burn

    rows = [{"n": i} for i in range(600)]
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            result = await run.map("burnt", rows, burn, contract=SheetContract(("n",), ("burn",)),
                                   workers=1)
    assert (result.completed, result.failed) == (600, 0)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "burnt")
    assert ok, why


async def test_a_function_workers_cannot_find_is_refused_before_any_write(tenant):
    async def local(row):
        return {}

    async with open_run(tenant, PLAY) as run:
        try:
            await run.map("nums", [{"n": 1}], local, contract=CONTRACT, workers=1)
        except InvalidInputError as exc:
            assert "top level of a play file" in str(exc)
        else:
            raise AssertionError("a local function was accepted")
    async with tenant.connection("sheet") as conn:
        assert await conn.fetchval(
            f'SELECT count(*) FROM "{tenant.schema}".shared_maps') == 0


async def test_expired_holders_cannot_write_and_a_new_holder_runs_only_what_is_left(tenant):
    """A holder whose lease was taken over cannot write: its admission and its completion
    raise `LeaseLostError` and nothing of them lands. What a holder recorded before it lost
    the unit stays settled: the next holder admits and runs only the rest, and a replayed
    batch changes nothing."""
    from runplane.actors.map_state import MapPlan
    from runplane.actors.shared.coordinator import publish_map
    from runplane.engine.shared.leases import Settlement, claim_units, mask_text

    rows = [{"n": i} for i in range(10)]

    def outcomes_for(indexes, stored_keys, pid):
        return [RowOutcome(stored_keys[i], "completed", {"pid": pid, "double": 2 * i},
                           input_index=i) for i in indexes]

    async with open_run(tenant, PLAY) as run:
        mid = "map-x"
        plan = MapPlan(tenant, run.ref, None, "nums", CONTRACT, tag_pid)
        await publish_map(rows, plan, mid, lease_s=0.5)
        await sm.set_state(tenant, run.ref, mid, sm.OPEN, (sm.WAITING,))

        async def admit(lease, indexes):
            return await shared_units.admit_units(tenant, run.ref, mid, [lease], "nums",
                                                  CONTRACT, [rows[i] for i in indexes],
                                                  indexes)

        async def complete(lease, before, after, outcomes, tally=None):
            done = after == lease.full
            settlement = Settlement(lease, mask_text(before), mask_text(after), done,
                                    tally or {})
            return await shared_units.complete_units(tenant, run.ref, mid, "w", [settlement],
                                                     "nums", CONTRACT, outcomes)

        [first] = await claim_units(tenant, run.ref, mid, "first/1")
        assert await claim_units(tenant, run.ref, mid, "second/1") == []  # held
        admitted = await admit(first, list(range(10)))
        keys = {row.input_index: row.key for row in admitted.pending}
        assert len(keys) == 10
        # The first holder records rows 0-4 (the unit's rows counted with its first batch).
        await complete(first, 0, 0b11111, outcomes_for(range(5), keys, 1),
                       {"rows": 10, "executed": 5, "calls": 5})
        await trio.sleep(0.7)  # its lease expires
        [second] = await claim_units(tenant, run.ref, mid, "second/1")
        assert (second.holder, second.claims, second.settled) == ("second/1", 2, "1f")
        with pytest.raises(LeaseLostError):  # the old holder can neither admit nor complete
            await admit(first, [5, 6])
        with pytest.raises(LeaseLostError):
            await complete(first, 0b11111, 0b1111111, outcomes_for((5, 6), keys, 1))
        with pytest.raises(InvalidInputError):  # a settled row is not admitted again
            await admit(second, [0, 5])
        again = await admit(second, list(range(5, 10)))
        assert sorted(row.input_index for row in again.pending) == [5, 6, 7, 8, 9]
        batch = outcomes_for(range(5, 10), keys, 2)
        await complete(second, 0b11111, 0b1111111111, batch, {"executed": 5, "calls": 5})
        await complete(second, 0b11111, 0b1111111111, batch, {"executed": 5, "calls": 5})
        stored = await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("pid",))
        assert sorted((row["_input_index"], row["pid"], row["_attempt_id"])
                      for row in stored.values()) == (
            [(i, 1, "first/1") for i in range(5)] + [(i, 2, "second/1") for i in range(5, 10)])
        status = await sm.map_status(tenant, run.ref, mid, counters=True)
        assert status.done == 1
        assert {k: status.counters[k] for k in ("rows", "completed", "executed", "calls",
                                                 "fenced")} == {
            "rows": 10, "completed": 10, "executed": 10, "calls": 10, "fenced": 0}
        await sm.set_state(tenant, run.ref, mid, sm.DONE, sm.LIVE)
    assert [r["_attempts"] for r in await sheet_state(tenant, "nums")] == [1] * 10
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why


def test_a_retry_policy_naming_an_exception_of_the_play_file_decodes_for_workers(tmp_path):
    """`runplane run play.py` loads the play under a module name no import finds; a shared
    map's `retry_on` type defined in that file is found in the worker's load of the file (it
    failed to decode before: the workers could not join)."""
    from runplane.actors.shared.config import PlayFile, _type_name, decode_config
    from runplane.cli.run_commands import load_play

    play_file = tmp_path / "flaky_play.py"
    play_file.write_text("class Flaky(Exception):\n    pass\n\n\n"
                         "async def enrich(row):\n    return {'x': 1}\n\n\n"
                         "async def play(run, rows):\n    pass\n")
    flaky = load_play(str(play_file)).play.__globals__["Flaky"]  # as `runplane run` has it
    config = {"contract": {"inputs": ["n"], "outputs": ["x"]}, "cell_policies": {},
              "retry": {"max_attempts": 3, "initial_s": 0.1, "backoff": 2.0,
                        "max_interval_s": 1.0, "jitter": False,
                        "retry_on": [_type_name(flaky)], "give_up_on": []},
              "play_file": str(play_file)}
    worker = PlayFile.load(str(play_file))
    decoded = decode_config(config, worker).retry
    assert decoded.retry_on == (worker.module.Flaky,)
    assert decoded.retries(worker.module.Flaky("again"), 1)
    # without the worker's load (a retry command): the play file the map was published from
    assert decode_config(config).retry.retry_on[0].__name__ == "Flaky"
