"""The completer's batches: a map's tail waits for the rest of its rows, its middle does not.

Each test holds some rows inside the function on an event, so which outcomes can share a
batch is decided by the test, not by the machine's speed; completions are counted where the
map writes them (`actors.map_state.complete_write`).
"""

from __future__ import annotations

import collections

import pytest
import trio

from runplane.actors import map_state, open_run
from runplane.engine import sheets
from runplane.engine.values.scopes import PlayScope

CONTRACT = sheets.SheetContract(inputs=("n",), outputs=("out",))


@pytest.fixture
def completions(monkeypatch) -> list[int]:
    """The rows of each completion the maps write, in order."""
    written: list[int] = []
    original = map_state.complete_write

    async def counted(port, write, outcomes):
        written.append(len(outcomes))
        return await original(port, write, outcomes)

    monkeypatch.setattr(map_state, "complete_write", counted)
    return written


class Held:
    """A row function for rows `0 .. split - 1` (the first part) and `split ..` (the rest):
    every call waits until all `calls` calls are inside the function (with as many calls as
    rows, every row of the list has gone through admission: its admission is over, whenever
    its actor gets round to ending), then the first part waits for `first`, the rest for
    `rest`."""

    def __init__(self, split: int, calls: int) -> None:
        self.split, self.calls, self.inside = split, calls, 0
        self.all_in, self.first, self.rest = trio.Event(), trio.Event(), trio.Event()

    async def __call__(self, row):
        self.inside += 1
        if self.inside == self.calls:
            self.all_in.set()
        await self.all_in.wait()
        await (self.first if row["n"] < self.split else self.rest).wait()
        return {"out": row["n"]}

    async def let_first_go(self) -> None:
        await self.all_in.wait()
        self.first.set()


async def completed_rows(tenant) -> int:
    found = await sheets.read_rows(tenant, PlayScope(tenant.org_id, "play"), "t", limit=10_000)
    return collections.Counter(row["_status"] for row in found)["enriched"]


async def wait_for_completed(tenant, rows: int) -> None:
    with trio.fail_after(30):
        while await completed_rows(tenant) < rows:
            await trio.sleep(0.02)


async def map_held(tenant, fn: Held, rows: int, rest_after, *, source=None, first_after=None,
                   **options) -> None:
    """Map `rows` rows with `fn` (every row completed) — a list of them, or `source` yielding
    them: the first part goes once every call is inside the function (and `first_after()`
    returned, given one), the rest once `rest_after()` returns."""
    async def let_go():
        if first_after is not None:
            await first_after()
        await fn.let_first_go()
        await rest_after()
        fn.rest.set()

    if source is None:
        source = [{"n": i} for i in range(rows)]
    async with trio.open_nursery() as nursery, open_run(tenant, "play") as run:
        nursery.start_soon(let_go)
        result = await run.map("t", source, fn, contract=CONTRACT, linger_s=0.01, **options)
    assert result.completed == rows


async def test_a_small_maps_rows_complete_in_one_statement(tenant, completions):
    """Twenty rows, all admitted at once: ten finish, their batch passes its linger while the
    other ten are still in the function, and still waits for them: one completion (two before,
    the first ten at the linger and the rest at the map's end)."""
    await map_held(tenant, Held(10, 20), 20, lambda: trio.sleep(0.2),  # many lingers
                   concurrency=20, tail_hold_s=3600)
    assert completions == [20]


async def test_a_streamed_maps_tail_waits_once_its_admission_ended(tenant, completions,
                                                                  monkeypatch):
    """An async iterable's length is known only once it ends: the first ten rows are let go
    once every call is inside the function *and* its admission has ended (seen where the map
    ends it, `MapState.end_admission`), and their batch still waits for the other ten past
    many lingers: one completion."""
    ended = trio.Event()
    original = map_state.MapState.end_admission

    def end_admission(self) -> None:
        original(self)
        ended.set()

    monkeypatch.setattr(map_state.MapState, "end_admission", end_admission)

    async def rows():
        for i in range(20):
            yield {"n": i}

    await map_held(tenant, Held(10, 20), 20, lambda: trio.sleep(0.2),  # many lingers
                   source=rows(), first_after=ended.wait, concurrency=20, tail_hold_s=3600)
    assert completions == [20]


async def test_a_tail_waits_no_longer_than_its_hold(tenant, completions):
    """The same map with a short hold: the first ten rows are written while the other ten are
    still held in the function (the test lets them go only once it reads the ten written)."""
    await map_held(tenant, Held(10, 20), 20, lambda: wait_for_completed(tenant, 10),
                   concurrency=20, tail_hold_s=0.1)
    assert completions == [10, 10]


async def test_a_maps_middle_goes_at_its_linger(tenant, completions):
    """More rows left than a tail (`TAIL_ROWS`): the hundred rows that finished are written at
    their linger, however long the hold, while the others wait (116 in the function)."""
    total = map_state.TAIL_ROWS + 200
    written_first: list[int] = []

    async def hundred_written() -> None:  # gives up after 30 s: the map would never end
        await wait_for_completed(tenant, 100)
        written_first.append(sum(completions))

    await map_held(tenant, Held(100, 116), total, hundred_written,
                   concurrency=116, tail_hold_s=3600, page_rows=total)
    assert written_first == [100] and sum(completions) == total
