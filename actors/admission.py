"""The source and admission actors of `run.map`: pages in, pending rows out to the workers.

How it works
- The input comes as admission units (`actors.list_source.SourcePage`), in groups. A list
  source is read in place by admission (`ListSource`): its leading rows are first probed as
  given (in chunks through a window of `PROBES_IN_FLIGHT`; see `probe_unencoded`) — a settled
  rerun ends there, never encoding the list; from the first rows not all settled, the list is
  encoded once (canonical texts, row keys, the array input's page cuts) and cut into units of
  whole array-input pages (up to `page_rows` rows), grouped up to `PROBE_GROUP_ROWS`; the
  rows are the encoded ones — byte-identical to the staged page facts, so running them is
  replaying the staged input. For an async iterable the **source actor** (`stream_pages`)
  cuts pages as rows arrive (a group of one each), the first of `FIRST_PAGE_ROWS` rows (so
  work starts soon even on a slow source), each next one twice as large up to `page_rows`.
- The **admission actor** (`admit_pages`) probes a unit by its row keys (`sheets.probe`, one
  read-only statement): when every row is settled — a fresh cache hit under the cell policies,
  or blocked (newer run, another attempt's live lease, given up), exactly as admission would
  decide — the unit is counted and nothing is sent or written. Otherwise it admits the unit in
  one transaction (`engine.sheets.admit`, cache hits counted, not listed). Whether it probes a
  unit, the rest of a group, or admits straight away is the state machine of
  `actors.admission_steps`. While it admits units straight away, the next unit is keyed
  and sent while the one before is still on its way, handed out in order
  (`admit_in_order`). A list source is staged first (lazily, at the first unit that needs
  admitting; see `actors.list_source`); a one-page unit of a sealed input is admitted from its
  stored page fact, other units with their rows (and their canonical texts).
- Pending rows go to the workers in small batches (`MAX_WORK_BATCH`) so all get a share.
  Duplicates: the engine drops them within a unit; a later duplicate of a row still in flight
  in this map is dropped by `MapState.take_admission` (counted as skipped).
Who calls: `actors.mapper.map_rows` starts these actors.
"""

from __future__ import annotations

import contextlib
import math
from typing import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable

import trio

from runplane.engine.canonical import JsonObject
from runplane.engine.sheets import Admission

from .admission_steps import AdmissionSteps, Event, event_of
from .list_source import ListSource, SourcePage
from .map_options import FIRST_PAGE_ROWS
from .map_state import MapPlan, MapState
from .phases import marked

MAX_WORK_BATCH = 64        # rows per worker batch: small enough to share a page among workers
PROBE_GROUP_ROWS = 10_000   # rows of an encoded list probed together once probes settle rows
# A list's leading rows, probed before encoding: SENTINEL_PROBE_ROWS alone first (new rows
# stop there, whatever the sheet holds), then the rest of a chunk of FIRST_PROBE_ROWS, then
# chunks of LEADING_PROBE_ROWS (a unit's 5 full pages, so no unit is cut short),
# PROBES_IN_FLIGHT at once (one is keyed while the server answers another).
SENTINEL_PROBE_ROWS = 100
FIRST_PROBE_ROWS = 1_000
LEADING_PROBE_ROWS = 5_000
PROBES_IN_FLIGHT = 2
ADMISSIONS_IN_FLIGHT = 3  # units sent while the ones before are on their way


# -- the source actor ------------------------------------------------------------------------
async def stream_pages(source: AsyncIterable[JsonObject], page_rows: int, pages_send,
                       *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with pages_send:
        offset, page = 0, []
        size = min(FIRST_PAGE_ROWS, page_rows)
        try:
            async for row in source:
                page.append(row)
                if len(page) >= size:
                    await pages_send.send([SourcePage(offset, page)])
                    offset, page = offset + len(page), []
                    size = min(page_rows, 2 * size)
            if page:
                await pages_send.send([SourcePage(offset, page)])
        except trio.BrokenResourceError:
            pass  # admission stopped reading: the map was superseded or stopped early


async def admit_page(plan: MapPlan, page: SourcePage, listed: ListSource | None,
                     probe: bool, background: trio.Nursery | None
                     ) -> tuple[Admission, bool, list[str] | None]:
    """One page's admission, whether a probe settled it, and the keys of its cache hits (a
    superset: all its keys when known) or None: settled from its keys by a read-only probe when
    every row is (a fresh cache hit or blocked, judged exactly as admission judges it), else
    admitted — from its staged page fact for a list source (staging the list first), with its
    rows otherwise."""
    if not plan.fast_admission:
        if listed is not None:
            await listed.ensure_staged()
        admission = await plan.admit(page.rows, page.offset, cache_hits="rows")
        return admission, False, [row.key for row in admission.completed]
    if probe:
        settled, keys = await plan.probe_keyed(page.rows, page.offset, keys=page.keys)
        if settled is not None:
            return settled, True, keys
    staged = await listed.staged_page(page, background) if listed is not None else None
    admission = await plan.admit(page.rows, page.offset, keys=page.keys, staged_page=staged,
                                 texts=page.texts)
    return admission, False, page.keys


async def probe_group(plan: MapPlan, group: list[SourcePage]) -> Admission | None:
    """Settle consecutive pages with one probe, or None (then each page goes on its own).
    Pages with a key in common are never probed together: each page deduplicates its own rows,
    so the counts stay exactly those of page-by-page admission."""
    keys = [key for page in group for key in page.keys or ()]
    rows = [row for page in group for row in page.rows]
    if len(keys) != len(rows) or len(set(keys)) != sum(len(set(page.keys)) for page in group):
        return None
    return await plan.probe(rows, group[0].offset, keys=keys)


def probe_bounds(rows: int) -> list[tuple[int, int]]:
    """The chunks a list's leading rows are probed in before it is encoded: `FIRST_PROBE_ROWS`,
    then `LEADING_PROBE_ROWS` each. Admission units never span a chunk boundary, so a chunk a
    probe settled is exactly the units it covers (see `probe_unencoded`, which probes the
    first chunk's first `SENTINEL_PROBE_ROWS` on their own: admission starts at the first row
    not settled, wherever it is)."""
    bounds = [(0, min(rows, FIRST_PROBE_ROWS))]
    while bounds[-1][1] < rows:
        low = bounds[-1][1]
        bounds.append((low, min(rows, low + LEADING_PROBE_ROWS)))
    return bounds


async def probe_unencoded(plan: MapPlan, state: MapState, listed: ListSource,
                          hand_out: Callable[[int, Admission], Awaitable[None]]) -> int:
    """Settle a list's leading rows by probes before encoding it (a settled rerun never needs
    the encoding); returns the first row not settled (a chunk boundary).

    Nothing is probed when the sheet held no row as the map began (`ListSource.sheet_rows`: a
    first run). Otherwise the first `SENTINEL_PROBE_ROWS` rows are probed alone: new rows
    stop there, whatever the sheet holds (a run of new rows into a sheet of as many old ones
    keys and probes a hundred rows, not the whole list), at one round trip more for a rerun.
    Once they are settled, the other chunks go through a window of `PROBES_IN_FLIGHT`; when the
    sheet holds as many rows as the list (likely a rerun) the window's first two as one. In the
    window a probe is started as soon as an earlier one is answered, so one chunk is keyed
    (CPU, in `sheets.probe`) while the server answers another. Answers are taken in order; at
    the first chunk not settled no further probe starts, and the ones already started are let
    finish and dropped (a probe writes nothing; not cancelling it keeps its connection). A
    chunk holding a duplicate is left to the units (they deduplicate unit by unit, and a chunk
    may hold several units); a duplicate of an earlier chunk's row is in another unit anyway,
    so it counts as that unit's cache hit either way."""
    bounds = probe_bounds(listed.source_rows)
    if listed.sheet_rows == 0:
        return 0  # the sheet was empty when the map began: nothing can be settled
    if bounds[0][1] > SENTINEL_PROBE_ROWS:  # the first chunk's sentinel, then its rest
        bounds = [(0, SENTINEL_PROBE_ROWS), (SENTINEL_PROBE_ROWS, bounds[0][1]), *bounds[1:]]
    first, keys = await plan.probe_keyed(listed.rows_between(*bounds[0]), 0)
    if first is None or first.skipped:
        return 0
    if first.cached:
        state.note_reuse(keys)
    await hand_out(bounds[0][1], first)
    settled_up_to = bounds[0][1]
    rest = bounds[1:]
    if len(rest) > 1 and listed.sheet_rows is not None \
            and listed.sheet_rows >= listed.source_rows:
        # Likely a rerun: the window's first two as one (a small chunk would only wait there
        # while the next one is keyed).
        rest = [(rest[0][0], rest[1][1]), *rest[2:]]
    answers: list[tuple[Admission | None, list[str]]] = [(None, [])] * len(rest)
    answered = [trio.Event() for _ in rest]
    window = trio.Semaphore(PROBES_IN_FLIGHT)
    stop = False

    async def probe(i: int) -> None:
        try:
            answers[i] = await plan.probe_keyed(listed.rows_between(*rest[i]), rest[i][0])
        finally:
            answered[i].set()

    async def launch(nursery: trio.Nursery) -> None:
        for i in range(len(rest)):
            await window.acquire()
            if stop:
                return
            nursery.start_soon(probe, i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(launch, nursery)
        for i, (low, high) in enumerate(rest):
            await answered[i].wait()
            admission, keys = answers[i]
            stop = state.stopping or admission is None or bool(admission.skipped)
            window.release()
            if stop:
                break
            assert admission is not None
            if admission.cached:
                state.note_reuse(keys)
            await hand_out(high - low, admission)
            settled_up_to = high
    return settled_up_to


async def _aiter(groups: Iterable[list[SourcePage]]) -> AsyncIterator[list[SourcePage]]:
    for group in groups:
        yield group


# A unit made ready to send ahead: its row keys, and the call that admits it.
Ready = tuple[list[str], Callable[[], Awaitable[Admission]]]


def streamed_ready(plan: MapPlan) -> Callable[[SourcePage], Awaitable[Ready]]:
    """A streamed page made ready: validated, keyed, deduplicated and encoded here
    (`MapPlan.prepare_page`; a bad row raises `InvalidInputError` before it is sent)."""
    async def ready(page: SourcePage) -> Ready:
        prepared = plan.prepare_page(page.rows, page.offset)
        return prepared.keys, lambda: plan.admit_prepared(prepared, page.offset,
                                                          expect_new=True)
    return ready


def listed_ready(plan: MapPlan, listed: ListSource,
                 background: trio.Nursery | None) -> Callable[[SourcePage], Awaitable[Ready]]:
    """A list's unit made ready: its keys from its texts, and its staged page (the first one
    begins staging: the begin fact is written before any row of the list is sent)."""
    async def ready(page: SourcePage) -> Ready:
        keys = page.keys if page.keys is not None else plan.row_keys(page.rows)
        staged = await listed.staged_page(page, background)
        return keys, lambda: plan.admit(page.rows, page.offset, keys=keys, staged_page=staged,
                                        texts=page.texts, expect_new=True)
    return ready


async def admit_in_order(plan: MapPlan, state: MapState, groups: AsyncIterable[list[SourcePage]],
                         steps: AdmissionSteps,
                         admit_group: Callable[[list[SourcePage]], Awaitable[int]],
                         hand_out: Callable[[int, Admission], Awaitable[None]],
                         ready: Callable[[SourcePage], Awaitable[Ready]]) -> None:
    """The units of `groups`, in order. While admission admits without probing after a unit
    whose rows were all new (`AdmissionSteps.sends_ahead`), the next unit is made `ready`
    here (keyed; a stream's page encoded, a list's staged page found) and sent, as rows
    expected new (`expect_new`: inserted without `ON CONFLICT`, admitted again the ordinary
    way if one was there after all), while the ones before are still on their way (at most
    `ADMISSIONS_IN_FLIGHT` at once): its preparation and its trip through a gateway overlap
    the others' statements, which overlap one another on the server (`engine.sheets.
    write_group`). Units are handed to the workers strictly in order, and a unit holding a row
    of a unit in flight waits until that one is handed out, so a row repeated across units is
    admitted in their order, as one at a time. Units with no row in common touch no
    row in common, so which commits first changes nothing (the sheet lock orders their
    transactions; counters, fences and the write ledger do not depend on that order). Any
    other unit waits for the one in flight, then goes one at a time (`admit_group`, probing
    as the steps say) until units may be sent ahead again."""
    window = trio.Semaphore(ADMISSIONS_IN_FLIGHT)
    handed = trio.Event()  # the last unit sent was handed out
    handed.set()
    flying: list[tuple[frozenset[str], trio.Event]] = []  # units on their way: keys, handed

    async def admit_ahead(page: SourcePage, keys: list[str],
                          send: Callable[[], Awaitable[Admission]], before: trio.Event,
                          mine: trio.Event) -> None:
        try:
            try:
                with state.writing():
                    admission = await send()
            except Exception:
                # Errors in the units' order: the unit before lands (or fails, and this one
                # is cancelled waiting) first, so a map raises one error, as one at a time.
                await before.wait()
                raise
            await before.wait()
            if admission.cached:
                state.note_reuse(keys)
            steps.on(event_of(False, admission.inserted, page.size))
            await hand_out(page.size, admission)
            mine.set()  # not on an error: the next unit is cancelled waiting, not let on
        finally:
            window.release()

    async with trio.open_nursery() as nursery:
        async for group in groups:
            position = 0
            while position < len(group):
                if state.stopping:
                    return
                if not (plan.fast_admission and steps.sends_ahead):
                    await handed.wait()
                    position += await admit_group(group[position:])
                    continue
                page = group[position]
                position += 1
                try:
                    keys, send = await ready(page)
                except Exception:  # a bad row; a list's begin fact refused
                    await handed.wait()  # the unit on its way lands first, as one at a time
                    raise
                flying = [unit for unit in flying if not unit[1].is_set()]
                sharing = [mine for held, mine in flying if not held.isdisjoint(keys)]
                if sharing:
                    await sharing[-1].wait()  # units are handed out in order
                await window.acquire()
                if state.stopping:
                    window.release()
                    return
                before, handed = handed, trio.Event()
                flying.append((frozenset(keys), handed))
                nursery.start_soon(admit_ahead, page, keys, send, before, handed)


@marked("admission")
async def admit_pages(plan: MapPlan, state: MapState, pages_recv, work_send,
                      listed: ListSource | None = None, background: trio.Nursery | None = None,
                      *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The admission actor: pages from `pages_recv` (a streamed source), or the units of
    `listed` (a list source, read in place; `pages_recv` is then None). What it does with each
    unit follows `AdmissionSteps` (`actors.admission_steps`)."""
    task_status.started()
    steps = AdmissionSteps()

    async def hand_out(rows_in_page: int, admission: Admission) -> None:
        pending = state.take_admission(rows_in_page, admission)
        size = max(1, min(MAX_WORK_BATCH, math.ceil(len(pending) / plan.concurrency)))
        for start in range(0, len(pending), size):
            batch = pending[start:start + size]
            await state.hand_out(len(batch))
            await work_send.send(batch)

    async def admit_group(group: list[SourcePage]) -> int:
        """Units of `group` one at a time, probing as `steps` says, until the group ends or
        the next unit may be sent ahead (`steps.sends_ahead`); how many units it took."""
        steps.start_group()
        position = 0
        while position < len(group) and not state.stopping:
            if position and plan.fast_admission and steps.sends_ahead:
                return position
            rest = group[position:]
            if plan.fast_admission and steps.probes_rest(len(rest)):
                admission = await probe_group(plan, rest)
                if admission is not None:
                    steps.on(Event.REST_SETTLED)
                    if admission.cached:
                        state.note_reuse([key for page in rest for key in page.keys or ()])
                    await hand_out(sum(page.size for page in rest), admission)
                    return len(group)
                steps.on(Event.REST_UNSETTLED)
            page = group[position]
            position += 1
            with state.writing():
                admission, settled, keys = await admit_page(plan, page, listed,
                                                            steps.probes_unit, background)
            if admission.cached:
                state.note_reuse(keys if keys is not None else plan.row_keys(page.rows))
            steps.on(event_of(settled, admission.inserted, page.size))
            await hand_out(page.size, admission)
        return position

    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(work_send)
        try:
            if listed is None:
                await stack.enter_async_context(pages_recv)
                await admit_in_order(plan, state, pages_recv, steps, admit_group, hand_out,
                                     streamed_ready(plan))
                return
            start = 0
            if plan.fast_admission and not listed.woken:  # (a wake's units are probed)
                start = await probe_unencoded(plan, state, listed, hand_out)
                # the rows at `start` need admitting (all of them, into an empty sheet)
                steps.on(Event.EMPTY_SHEET if listed.sheet_rows == 0 else Event.LEADING_UNSETTLED)
            if start < listed.source_rows and not state.stopping:
                await listed.encode()
                cut_at = frozenset(low for low, _ in probe_bounds(listed.source_rows))
                await admit_in_order(
                    plan, state,
                    _aiter(listed.page_groups(PROBE_GROUP_ROWS, plan.page_rows, start, cut_at)),
                    steps, admit_group, hand_out, listed_ready(plan, listed, background))
        finally:
            state.end_admission()
