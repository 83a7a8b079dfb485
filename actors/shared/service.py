"""One worker's service of one shared map: claims, admissions, runners, batches, renewals.

How it works
- `MapWorker.serve` runs four kinds of task. The **claimer** claims units (one statement,
  its fair share; about `GROUP_S` of work at the worker's measured rate, 1 to `MAX_CLAIM`
  units) and admits the rows each claim still has to run in one transaction
  (`engine.shared.units.admit_units`, the leases checked in it; `ADMISSIONS` claims are
  admitted at once, their staged pages read at once); it claims again once the rows not yet
  started would last less than `PREFETCH_S` plus twice an admission's time, holding at most
  `CLAIMS_HELD` claims.
  `concurrency` **runners** take the admitted rows one by one and run them under the map's
  row policies (rate limit, row timeout, retries in place), handing the loop over every
  `SLICE_S`. The **flusher** records what was computed in small batches
  (`engine.shared.units.complete_units`: the outcomes, and each unit's settled mask, counters
  and done mark, in one transaction per claim): a batch goes `LINGER_S` after its first
  outcome, or at once when `FLUSH_ROWS` wait or no row is left to run. So a worker killed
  with SIGKILL loses its calls in flight and at most what it computed in the last `LINGER_S`
  (plus a batch in its commit); the rows it recorded stay settled and the next holder runs
  only the rest. The **renewer** renews the leases every `renew_s` and stops the work of a
  unit no longer held (taken over, or the map cancelled or closed): its calls are cancelled
  and nothing more of it is written. A batch refused with `LeaseLostError` (a lease lost
  meanwhile) makes the flusher ask which units are still held and write the rest.
- A cancellation of the map's run (`actors.cancellation`, polled every `CANCEL_POLL_S`) cancels the
  service: calls in flight and outcomes not yet written are left, as by a crash; the
  coordinator marks the map cancelled.
- Store calls ride out an outage for the port's outage budget (`actors.retry`), then `serve`
  ends with `StoreOutageError`; the leases expire and other workers take the units.
- No permit is held while the function runs; at most `concurrency` rows run at once.
- A map published `concurrent` (its rows' keys distinct) is written by concurrent sheet
  transactions (`engine.sheets.sheet_txn`): the workers' admissions and batches do not wait
  for each other's.
"""

from __future__ import annotations

import bisect
import collections
import functools
import logging
import math
import os
from typing import Awaitable, Callable

import attrs
import trio

from runplane.engine import array_input
from runplane.engine.array_input import Page
from runplane.engine.shared import units as shared_units
from runplane.engine.shared import maps as sm
from runplane.engine.errors import LeaseLostError
from runplane.engine.ports import Port
from runplane.engine.shared.leases import (
    MAX_CLAIM, Settlement, UnitLease, claim_units, mask_of, mask_text, renew,
)
from runplane.engine.observability import context as where, metrics
from runplane.engine.opening import outage_budget

from ..cancellation import RunStop, watch_for_cancel
from ..map_state import MapPlan
from ..pacing import Pacer, open_pacer
from ..retry import OutageWatch, install_watch, reset_watch, retry_transient
from ..row_calls import report_calls
from .work import Claim, UnitWork, count_written, run_row

log = logging.getLogger("runplane.actors")

LINGER_S = 0.2      # computed outcomes are written at most this long after the first of a batch
FLUSH_ROWS = 4000   # ... or at once when this many wait, or when no row is left to run
GROUP_S = 1.0       # a claim takes about this long of work at the worker's rate ...
FIRST_CLAIM = 2     # ... and this many units before the rate is known
PREFETCH_S = 0.25   # the next claim is made when the rows not yet started last less than
                    # this plus twice an admission's time
CLAIMS_HELD = 4     # claims a worker holds at once (running, queued, being admitted) ...
ADMISSIONS = 2      # ... of which at most this many are being admitted
PAGES_KEPT = 8      # staged pages a worker keeps at hand
RATE_WINDOW_S = 0.25
SLICE_S = 0.005     # runners hand the loop over to the other tasks at least this often


@attrs.define(eq=False)
class MapWorker:
    """One worker's service of one shared map (see the module docstring)."""

    port: Port
    worker_id: str
    shared: sm.SharedMap
    plan: MapPlan
    limiter: trio.CapacityLimiter
    renew_s: float
    pacer: Pacer | None = None
    units_run: int = 0
    # Fault injection (simulations): awaited at each stage ("claimed", "admitted" with a
    # claim's leases; "computed" before a batch is written and "completed" after, with its
    # leases and, once completed, its `(settlements, outcomes)`).
    fault: Callable[[str, list[UnitLease], object], Awaitable[None]] | None = None
    renewing: bool = True  # a simulation stalls a worker's renewals to let its leases expire
    _claims: list[Claim] = attrs.field(factory=list)
    _queue: collections.deque = attrs.field(factory=collections.deque)
    _running: int = 0
    _waiting_rows: int = 0          # outcomes computed, not yet written
    _work: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    _changed: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    _flush_wanted: trio.Event = attrs.field(factory=trio.Event)
    _urgent: trio.Event = attrs.field(factory=trio.Event)
    _pages: dict[int, Page] = attrs.field(factory=dict)
    _claim_prefix: str = attrs.field(factory=lambda: os.urandom(3).hex())
    _claim_no: int = 0
    _finished: int = 0
    _rate: float | None = None      # rows finished a second
    _first_rows: int = 0            # rows of the first admission
    _slice_end: float = 0.0
    _slice_no: int = 0
    _ending: bool = False
    _admitting: int = 0
    _admit_s: float = 0.0           # how long a claim's admission takes (a moving average)
    _rate_mark: tuple[float, int] | None = None
    _meters: metrics.RowMeters | None = None  # `runplane_rows_total` of the map (`serve`)

    @property
    def concurrent(self) -> bool:
        """Whether the map was published for concurrent writers (its rows' keys distinct)."""
        return self.shared.config.get("concurrent") is True

    # -- the claimer -------------------------------------------------------------------------

    def _threshold(self) -> float:
        if self._rate is None:  # until the rate is known: once half the rows started
            return max(self.plan.concurrency, self._first_rows / 2)
        # enough rows left to run while the next claim is admitted, twice over
        return max(self.plan.concurrency, self._rate * (PREFETCH_S + 2 * self._admit_s))

    def _claim_size(self) -> int:
        if self._rate is None:
            return FIRST_CLAIM
        unit_rows = max(1, max((w.lease.row_count for c in self._claims
                                for w in c.units.values()), default=sm.UNIT_ROWS))
        return max(1, min(MAX_CLAIM, math.ceil(self._rate * GROUP_S / unit_rows)))

    async def _claim_loop(self, nursery: trio.Nursery) -> None:
        ref, mid = self.plan.ref, self.shared.map_invocation_id
        while True:
            while (self._admitting >= ADMISSIONS
                   or len(self._claims) + self._admitting >= CLAIMS_HELD
                   or len(self._queue) > self._threshold()):
                await self._changed.park()
            self._claim_no += 1
            holder = f"{self.worker_id}/{self._claim_prefix}{self._claim_no}"
            limit = self._claim_size()
            leases = await retry_transient(lambda: claim_units(
                self.port, ref, mid, holder, limit=limit))
            if not leases:
                if not self._claims and not self._admitting:
                    return  # nothing held, nothing claimable
                await self._changed.park()  # a unit finished or was lost: look again
                continue
            metrics.lease_takeovers(sum(1 for lease in leases if lease.claims > 1))
            await self._stage("claimed", leases)
            self._admitting += 1
            nursery.start_soon(self._admit_claim, Claim(holder, {
                lease.unit: UnitWork(lease, mask_of(lease.settled)) for lease in leases}))

    async def _admit_claim(self, claim: Claim) -> None:
        started = trio.current_time()
        try:
            await self._admit(claim)
            self._admit_s = (self._admit_s + trio.current_time() - started) / 2
        finally:
            self._admitting -= 1
            self._changed.unpark_all()

    async def _read_pages(self, ordinals: set[int]) -> dict[int, Page]:
        """The staged pages `ordinals`: those not at hand read at once; the last few kept."""
        scope = self.plan.ref.scope.map(self.shared.table_namespace,
                                        self.shared.map_invocation_id)
        read = {ordinal: self._pages[ordinal] for ordinal in ordinals if ordinal in self._pages}
        missing = sorted(ordinals - read.keys())

        async def one(ordinal: int) -> None:
            read[ordinal] = await retry_transient(lambda: array_input.read_page(
                self.port, scope, ordinal))

        async with trio.open_nursery() as nursery:
            for ordinal in missing:
                nursery.start_soon(one, ordinal)
        pages = dict(read)
        for ordinal in missing:
            self._pages[ordinal] = read[ordinal]
        while len(self._pages) > PAGES_KEPT:
            self._pages.pop(next(iter(self._pages)))
        return pages

    async def _admit(self, claim: Claim) -> None:
        """Admit the claim's unsettled rows, then queue the pending ones and note what the
        admission settled (cache hits, blocked and skipped rows) for the next batch."""
        plan = self.plan
        rows, indexes = [], []
        pages = await self._read_pages({work.lease.page for work in claim.units.values()})
        for work in claim.units.values():
            lease = work.lease
            page = pages[lease.page]
            start = lease.low - page.offset
            for offset in range(lease.row_count):
                if not work.recorded >> offset & 1:
                    rows.append(page.rows[start + offset].data)
                    indexes.append(lease.low + offset)
        keys = None
        if self.shared.config.get("keyed") is True:  # a retry: each row names its stored key
            keys = [row["_key"] for row in rows]
            rows = [{f: v for f, v in row.items() if f != "_key"} for row in rows]
        try:
            admission = await retry_transient(lambda: shared_units.admit_units(
                self.port, plan.ref, self.shared.map_invocation_id, claim.leases,
                plan.table_namespace, plan.contract, rows, indexes,
                cell_policies=plan.cell_policies, give_up_after=plan.give_up_after,
                concurrent=self.concurrent, keys=keys, force=plan.force))
        except LeaseLostError as exc:
            log.info("worker %s: %s", self.worker_id, exc)
            return
        leases = claim.leases
        works = list(claim.units.values())  # in unit order: their rows in input order
        lows = [work.lease.low for work in works]

        def work_of(input_index: int) -> UnitWork:
            return works[bisect.bisect_right(lows, input_index) - 1]

        queued = [(work_of(admitted.input_index), admitted) for admitted in admission.pending]
        pending = {work.lease.unit: 0 for work in works}
        for work, admitted in queued:
            pending[work.lease.unit] |= work.bit(admitted.input_index)
        for row in admission.blocked:
            work_of(row.input_index).tally["blocked"] += 1
        # Cache hits and duplicates are counted per claim: spread them over the units whose
        # admitted rows they were (only their sums are read).
        cached, skipped = admission.cached, admission.skipped
        for work in claim.units.values():
            lease = work.lease
            work.decided = lease.full & ~work.recorded & ~pending[lease.unit]
            if not work.recorded:
                work.tally["rows"] += lease.row_count
            others = bin(work.decided).count("1") - work.tally["blocked"]
            work.tally["skipped"] += (s := min(skipped, others))
            work.tally["cached"] += (c := min(cached, others - s))
            skipped, cached = skipped - s, cached - c
        self._claims.append(claim)
        self._first_rows = self._first_rows or len(queued)
        self._queue.extend(queued)
        self._work.unpark(count=len(queued))
        await self._stage("admitted", leases)
        if any(work.decided for work in claim.units.values()):
            self._want_flush(0)

    # -- the runners ---------------------------------------------------------------------------

    async def _run_rows(self) -> None:
        """A runner: takes queued rows one by one; the rows of one unit run in one cancel
        scope, cancelled when the unit is lost (a scope per row costs more than a no-op call)."""
        queue = self._queue
        while True:
            while not queue:
                await self._work.park()
            await self._take_turns()
            if not queue:
                continue
            work = queue[0][0]
            if work.lost:
                queue.popleft()
                continue
            with trio.CancelScope() as scope:
                work.calls.add(scope)
                try:
                    while queue and queue[0][0] is work and not work.lost:
                        _, admitted = queue.popleft()
                        if len(queue) <= self._threshold():
                            self._changed.unpark_all()
                        self._running += 1
                        try:
                            outcome, timeouts = await run_row(self.plan, self.pacer, admitted)
                        finally:
                            self._running -= 1
                        work.finish(admitted, outcome, timeouts)
                        self._note_rate()
                        self._want_flush(1)
                        await self._take_turns()
                finally:
                    work.calls.discard(scope)

    async def _take_turns(self) -> None:
        """Runners whose function does not yield (CPU-bound, or a no-op) take turns: one of
        them runs rows for `SLICE_S`, then every runner hands the loop over before its next
        row, and the first one back runs the next slice. A store call (a few loop turns per
        statement, some holding the sheet's lock) waits about `SLICE_S` a turn."""
        while self._ending or trio.current_time() >= self._slice_end:
            self._ending = True
            seen = self._slice_no
            await trio.lowlevel.checkpoint()
            if self._slice_no == seen and self._ending:  # the first one back
                self._slice_no += 1
                self._ending = False
                self._slice_end = trio.current_time() + SLICE_S

    def _note_rate(self) -> None:
        self._finished += 1
        now = trio.current_time()
        if self._rate_mark is None:
            self._rate_mark = (now, self._finished)
        elif now - self._rate_mark[0] >= RATE_WINDOW_S:
            at, count = self._rate_mark
            rate = (self._finished - count) / (now - at)
            self._rate = rate if self._rate is None else (self._rate + rate) / 2
            self._rate_mark = (now, self._finished)

    # -- the flusher ---------------------------------------------------------------------------

    def _want_flush(self, rows: int) -> None:
        self._waiting_rows += rows
        self._flush_wanted.set()
        if self._waiting_rows >= FLUSH_ROWS or (not self._queue and not self._running):
            self._urgent.set()

    async def _flush_loop(self) -> None:
        while True:
            await self._flush_wanted.wait()
            with trio.move_on_after(LINGER_S):
                await self._urgent.wait()
            self._flush_wanted, self._urgent, self._waiting_rows = trio.Event(), trio.Event(), 0
            for claim in list(self._claims):
                await self._flush_claim(claim)

    async def _flush_claim(self, claim: Claim) -> None:
        batch = [(work, *work.taken()) for work in claim.units.values()
                 if work.decided and not work.lost]
        if not batch:
            return
        settlements = []
        for work, decided, _, tally in batch:
            after = work.recorded | decided
            settlements.append(Settlement(work.lease, mask_text(work.recorded), mask_text(after),
                                          after == work.lease.full, dict(+tally)))
        outcomes = [outcome for work, _, count, _ in batch for outcome in work.outcomes[:count]]
        leases = [work.lease for work, *_ in batch]
        await self._stage("computed", leases)
        plan = self.plan
        try:
            completion = await retry_transient(lambda: shared_units.complete_units(
                self.port, plan.ref, self.shared.map_invocation_id, self.worker_id,
                settlements, plan.table_namespace, plan.contract, outcomes,
                concurrent=self.concurrent))
        except LeaseLostError as exc:
            log.info("worker %s: %s", self.worker_id, exc)
            if not await self._check_held(claim):
                for work, *_ in batch:  # still held, yet refused: give the units up
                    self._lose(work)
            self._flush_wanted.set()  # the rest again
            return
        if self._meters is not None:
            count_written(self._meters, outcomes, completion, [tally for *_, tally in batch])
        for work, decided, count, tally in batch:
            work.recorded_batch(decided, count, tally)
            if work.recorded == work.lease.full:
                claim.units.pop(work.lease.unit, None)
                self.units_run += 1
        self._forget_if_empty(claim)
        await self._stage("completed", leases, (settlements, outcomes))

    # -- the renewer ---------------------------------------------------------------------------

    async def _renew_leases(self) -> None:
        while True:
            await trio.sleep(self.renew_s)
            if self.renewing:
                await self._check_held()

    async def _check_held(self, only: Claim | None = None) -> bool:
        """Renew the held leases; stop the units no longer held. Whether some unit (of `only`,
        when given) was found lost."""
        works = [work for claim in list(self._claims) for work in claim.units.values()]
        if not works:
            return False
        held = set(await retry_transient(lambda: renew(
            self.port, self.plan.ref, self.shared.map_invocation_id, self.worker_id,
            [work.lease for work in works])))
        lost = False
        for work in works:
            if work.lease.unit not in held and not work.lost and (
                    work.recorded != work.lease.full):
                lost = lost or only is None or work.lease.unit in only.units
                self._lose(work)
        return lost

    def _lose(self, work: UnitWork) -> None:
        log.info("worker %s: lost unit %d of map %s", self.worker_id, work.lease.unit,
                 self.shared.map_invocation_id)
        work.lost = True
        for scope in list(work.calls):
            scope.cancel()
        kept = [item for item in self._queue if item[0] is not work]
        self._queue.clear()  # in place: the runners hold it
        self._queue.extend(kept)
        for claim in list(self._claims):
            if claim.units.get(work.lease.unit) is work:
                claim.units.pop(work.lease.unit)
                self._forget_if_empty(claim)

    def _forget_if_empty(self, claim: Claim) -> None:
        if not claim.units and claim in self._claims:
            self._claims.remove(claim)
        self._changed.unpark_all()

    async def _stage(self, stage: str, leases: list[UnitLease], detail: object = None) -> None:
        if self.fault is not None:
            await self.fault(stage, leases, detail)

    async def serve(self) -> int:
        """Claim and run units until none is claimable and none is held; the units this
        worker finished. Store calls ride out outages for the port's outage budget."""
        self.pacer = open_pacer(self.port, self.plan.rate_limit)
        # The worker's own outage budget (its port's), whoever started it.
        token = install_watch(OutageWatch(outage_budget(self.port.settings.outage_budget_s)))
        stop = RunStop()  # the run's cancellation stops this worker's service of its map
        scope = self.shared.ref.scope
        self._meters = metrics.RowMeters.of(scope.play, self.shared.table_namespace)
        try:
            with stop.scope(), where.bound(org=self.port.org_id, play=scope.play,
                                           run_id=scope.run_id, map=self.shared.table_namespace):
                await self._serve_in(stop)
        finally:
            reset_watch(token)
        return self.units_run

    async def _serve_in(self, stop: RunStop) -> None:
        """The worker's actors: renewer, flusher, the rows-in-a-call report, row runners; a
        cancellation of the map's run (polled like the run's own processes do) cancels them:
        calls in flight, and outcomes not yet written, are left."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_for_cancel, self.port, self.shared.ref.scope, stop)
            nursery.start_soon(self._renew_leases)
            nursery.start_soon(self._flush_loop)
            nursery.start_soon(functools.partial(  # this process's rows in a call
                report_calls, self.port, self.shared.ref.scope,
                self.shared.map_invocation_id, self.shared.table_namespace, self.plan.calls))
            for _ in range(max(1, min(self.plan.concurrency, int(self.limiter.total_tokens)))):
                nursery.start_soon(self._run_rows)
            await self._claim_loop(nursery)
            nursery.cancel_scope.cancel()
