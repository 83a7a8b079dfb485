"""A map's next page is sent while the one before is on its way (`actors.admission.
admit_in_order`): the races forced, for a stream's pages and a list's units. A page sent ahead
that is answered first is still handed to the workers after the page before it; a page holding
a row of the page on its way is not sent until that page is handed out, so the sheet ends as
one-at-a-time admission leaves it."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from runplane.actors import map_state, open_run
from runplane.engine import sheets
from runplane.engine.errors import ConflictError

from .sheet_helpers import play_scope, raw_rows

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))
PAGE = 5  # rows a streamed page (page_rows): pages at offsets 0, 5, 10, 15


async def stream(rows):
    for row in rows:
        yield row


class Gated:
    """`admit_write` with the admission of the page at `held` held until `release` is set;
    notes when each page's admission started and returned (by its first input index)."""

    def __init__(self, monkeypatch, held: int) -> None:
        self.real = map_state.admit_write
        self.held, self.release = held, trio.Event()
        self.started: list[int] = []
        self.returned: list[int] = []
        monkeypatch.setattr(map_state, "admit_write", self)

    async def release_once_returned(self, first: int) -> None:
        """Let the held page go once the page at `first` has returned (or raised)."""
        while first not in self.returned:
            await trio.sleep(0.01)
        self.release.set()

    async def release_unless_sent(self, not_sent: int) -> None:
        """Once the held page was sent and everything else is blocked, check that the page at
        `not_sent` was not sent meanwhile, then let the held page go."""
        while self.held not in self.started:
            await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        assert not_sent not in self.started, self.started
        self.release.set()

    async def __call__(self, port, write, batch, **kwargs):
        first = batch.input_indexes[0] if batch.input_indexes else batch.input_offset
        self.started.append(first)
        if first == self.held:
            await self.release.wait()
        try:
            return await self.real(port, write, batch, **kwargs)
        finally:
            self.returned.append(first)


async def test_a_page_answered_before_the_one_before_it_is_handed_out_after_it(tenant,
                                                                                monkeypatch):
    gated = Gated(monkeypatch, held=5)
    calls: list[str] = []

    async def upper(row):
        calls.append(row["name"])
        return {"upper": row["name"].upper()}

    names = [f"r{i:02d}" for i in range(20)]
    async with open_run(tenant, "play") as run:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gated.release_once_returned, 10)
            result = await run.map("t", stream([{"name": n} for n in names]), upper,
                                   contract=CONTRACT, page_rows=PAGE, concurrency=1)
    # the first page goes alone (probed, then admitted); from the second on, a page is sent
    # while the one before is on its way: the third was answered before the second
    assert gated.returned.index(10) < gated.returned.index(5), gated.returned
    assert calls == names  # handed to the (one) worker in the source's order all the same
    assert (result.admitted, result.completed, result.skipped) == (20, 20, 0)
    stored = await raw_rows(tenant, play_scope(tenant, "play"), "t")
    assert sorted(row["_input_index"] for row in stored.values()) == list(range(20))


@pytest.mark.parametrize("repeat", [12, 17], ids=["the-page-before", "two-pages-before"])
async def test_a_page_holding_a_row_of_a_page_on_its_way_waits_for_it(tenant, monkeypatch,
                                                                       repeat):
    """The third page, or the fourth (the third, sharing nothing, goes on its way meanwhile),
    repeats a row of the second."""
    names = [f"r{i:02d}" for i in range(20)]
    names[repeat] = names[7]
    not_sent = repeat - repeat % PAGE
    calls: list[str] = []

    async def upper(row):
        calls.append(row["name"])
        return {"upper": row["name"].upper()}

    source = [{"name": n} for n in names]
    async with open_run(tenant, "play") as run:  # the reference: one page at a time
        await run.map("one_at_a_time", stream(source), upper, contract=CONTRACT,
                      page_rows=PAGE, concurrency=1, fast_admission=False)
    reference = await raw_rows(tenant, play_scope(tenant, "play"), "one_at_a_time", ("name",))
    gated = Gated(monkeypatch, held=5)
    calls.clear()
    async with open_run(tenant, "play") as run:
        async with trio.open_nursery() as nursery:
            # the page repeating a row is not sent while the second is held
            nursery.start_soon(gated.release_unless_sent, not_sent)
            result = await run.map("t", stream(source), upper, contract=CONTRACT,
                                   page_rows=PAGE, concurrency=1)
    assert sorted(calls) == sorted(set(names))  # the repeated row ran once
    assert (result.admitted, result.skipped, result.completed) == (19, 1, 19), result
    stored = await raw_rows(tenant, play_scope(tenant, "play"), "t", ("name",))
    assert len(stored) == 19
    assert {row["name"]: row["_input_index"] for row in stored.values()} == \
        {row["name"]: row["_input_index"] for row in reference.values()}


async def test_two_pages_on_their_way_failing_raise_one_error_in_page_order(tenant, monkeypatch):
    """The page sent ahead fails first; the page before it fails after: the map raises the
    earlier page's error alone (as one-at-a-time admission would), not a group of both."""
    gated = Gated(monkeypatch, held=5)
    real = gated.real

    async def failing(port, write, batch, **kwargs):
        first = batch.input_indexes[0] if batch.input_indexes else batch.input_offset
        if first == 0:  # the first page goes through; every later one is refused
            return await real(port, write, batch, **kwargs)
        raise ConflictError(f"page at {first} refused")

    gated.real = failing

    async def upper(row):
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play") as run:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gated.release_once_returned, 10)  # once it raised
            with pytest.raises(ConflictError, match="page at 5 refused"):
                await run.map("t", stream([{"name": f"r{i:02d}"} for i in range(20)]), upper,
                              contract=CONTRACT, page_rows=PAGE, concurrency=1)


# A list's units (`actors.list_source.page_groups`), 2,500 rows at `page_rows=500` into an
# empty sheet: [0,100) and [100,300) (the ramp), [300,1000) (the rest of the first staged
# page), [1000,2000), [2000,2500).
LIST_ROWS, LIST_UNIT_ROWS = 2500, 500


async def test_a_list_into_an_empty_sheet_sends_its_next_unit_ahead_and_hands_out_in_order(
        tenant, monkeypatch):
    gated = Gated(monkeypatch, held=100)
    calls: list[str] = []

    async def upper(row):
        calls.append(row["name"])
        return {"upper": row["name"].upper()}

    names = [f"r{i:04d}" for i in range(LIST_ROWS)]
    async with open_run(tenant, "play") as run:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gated.release_once_returned, 300)
            result = await run.map("t", [{"name": n} for n in names], upper, contract=CONTRACT,
                                   page_rows=LIST_UNIT_ROWS, concurrency=1)
    assert gated.returned.index(300) < gated.returned.index(100), gated.returned
    assert calls == names
    assert (result.admitted, result.completed, result.skipped) == (LIST_ROWS, LIST_ROWS, 0)
    stored = await raw_rows(tenant, play_scope(tenant, "play"), "t")
    assert sorted(row["_input_index"] for row in stored.values()) == list(range(LIST_ROWS))


async def test_a_list_unit_holding_a_row_of_the_unit_on_its_way_waits_for_it(tenant,
                                                                             monkeypatch):
    names = [f"r{i:04d}" for i in range(LIST_ROWS)]
    names[400] = names[150]  # the unit [300,1000) repeats a row of the unit [100,300)
    source = [{"name": n} for n in names]

    async def upper(row):
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play") as run:  # the reference: one unit at a time
        await run.map("one_at_a_time", source, upper, contract=CONTRACT,
                      page_rows=LIST_UNIT_ROWS, concurrency=1, fast_admission=False)
    reference = await raw_rows(tenant, play_scope(tenant, "play"), "one_at_a_time", ("name",))
    gated = Gated(monkeypatch, held=100)
    async with open_run(tenant, "play") as run:
        async with trio.open_nursery() as nursery:
            # the unit [300,1000) is not sent while [100,300) is held
            nursery.start_soon(gated.release_unless_sent, 300)
            result = await run.map("t", source, upper, contract=CONTRACT,
                                   page_rows=LIST_UNIT_ROWS, concurrency=1)
    assert (result.admitted, result.skipped) == (LIST_ROWS - 1, 1), result
    stored = await raw_rows(tenant, play_scope(tenant, "play"), "t", ("name",))
    assert {row["name"]: row["_input_index"] for row in stored.values()} == \
        {row["name"]: row["_input_index"] for row in reference.values()}


async def test_two_completion_batches_are_written_at_once(tenant, monkeypatch):
    """A map's outcomes go out in batches written by two writers (`actors.completer`): the
    first batch's write is held until the next one has been written beside it; both land."""
    real = map_state.complete_write
    calls: list[int] = []     # each write's rows, as it starts
    returned: list[int] = []  # ... and as it returns
    second_written = trio.Event()

    async def gated(port, write, outcomes, **kwargs):
        first = not calls
        calls.append(len(outcomes))
        if first:
            await second_written.wait()
        completion = await real(port, write, outcomes, **kwargs)
        returned.append(len(outcomes))
        if not first:
            second_written.set()
        return completion

    monkeypatch.setattr(map_state, "complete_write", gated)

    async def upper(row):
        return {"upper": row["name"].upper()}

    names = [f"r{i:02d}" for i in range(20)]
    with trio.fail_after(30):  # one writer would wait here for good
        async with open_run(tenant, "play") as run:
            result = await run.map("t", stream([{"name": n} for n in names]), upper,
                                   contract=CONTRACT, page_rows=PAGE, batch_rows=PAGE,
                                   concurrency=1)
    assert len(calls) >= 2 and sum(returned) == 20
    assert (result.admitted, result.completed) == (20, 20), result
    stored = await raw_rows(tenant, play_scope(tenant, "play"), "t", ("name", "upper"))
    assert {row["name"]: row["upper"] for row in stored.values()} == \
        {n: n.upper() for n in names}
