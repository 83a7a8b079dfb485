"""A shared-map worker: claims units of a play's open shared maps and runs their rows.

How it works
- `serve_play` joins the play's maps (`engine.shared_maps.join`, a heartbeat), then loops:
  read the play's waiting or open maps; for each, check the play file against what the map
  was published with (`actors.shared_config.check_published`: a different digest or a
  missing function refuses, `ConflictError`), then serve it while it has claimable units.
  With `exit_when_idle` it waits up to `idle_wait_s` for a map to appear and returns once no
  waiting or open map of the play has a unit not done; otherwise it runs until cancelled.
- `MapWorker.serve` claims units in batches (one statement, its fair share) and runs them in
  claim order, `UNITS_IN_FLIGHT` at once; a renewer renews the batch's leases every `renew_s` and cancels the work of a unit
  no longer held (taken over, or the map cancelled or closed): its rows stop, nothing of it is
  written.
- A unit: its staged page is read (`array_input.read_page`, kept while the next unit is on the
  same page), its rows are admitted under the unit's own `Attempt` (the lease's holder id,
  with a row lease of 0 s: the unit's lease guards the rows) in a transaction that also checks
  the lease (`shared_maps.unit_guard`: a holder whose unit was taken over cannot take its rows
  back),
  run under the map's row policies (rate limit, row timeout, retries in place; `give_up_after`
  at admission), and completed in one transaction that also checks the lease and marks the
  unit done with its counters (`engine.shared_units`: actions, so a worker behind a gateway
  works the same). A completion that finds the lease lost rolls back (`LeaseLostError`): the
  unit is the new holder's.
  No permit is held while the function runs; at most `concurrency` rows run at once.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import attrs
import trio

from runplane.engine import array_input, shared_units
from runplane.engine import shared_maps as sm
from runplane.engine.errors import LeaseLostError
from runplane.engine.ports import Port
from runplane.engine.sheets import AdmittedRow, RowOutcome

from .map_state import MapPlan
from .mapper import call_row
from .pacing import open_pacer
from .policies import RowTimeoutError
from .retry import retry_transient
from .shared_config import PlayFile, check_published, decode_config

log = logging.getLogger("runplane.actors")

POLL_S = 0.5
IDLE_WAIT_S = 60.0
UNITS_IN_FLIGHT = 2  # units one worker runs at once (a SIGKILL loses at most their outcomes)


@attrs.define(eq=False)
class UnitTally:
    """What one unit did (besides what its completion applies), recorded with its done mark."""

    rows: int = 0
    cached: int = 0
    blocked: int = 0
    skipped: int = 0
    executed: int = 0
    calls: int = 0
    retried: int = 0
    timed_out: int = 0


async def run_row(plan: MapPlan, pacer: Any, admitted: AdmittedRow,
                  tally: UnitTally) -> RowOutcome:
    """A row under the map's policies: called, retried in place while the retry policy says
    so, its outcome recording the calls it took."""
    calls = 0
    while True:
        calls += 1
        if pacer is not None:
            await pacer.take()
        tally.calls += 1
        if calls > 1:
            tally.retried += 1
        outcome, error = await call_row(plan, admitted, calls)
        if error is None:
            return outcome
        if isinstance(error, RowTimeoutError):
            tally.timed_out += 1
        if plan.retry is None or not plan.retry.retries(error, calls):
            return outcome
        await trio.sleep(plan.retry.delay_s(calls))


@attrs.define(eq=False)
class MapWorker:
    """One worker's service of one shared map."""

    port: Port
    worker_id: str
    shared: sm.SharedMap
    plan: MapPlan
    limiter: trio.CapacityLimiter
    renew_s: float
    pacer: Any = None
    units_run: int = 0
    # Fault injection (simulations): awaited at each stage of a unit ("claimed", "admitted",
    # "computed", "completed") with the lease and, once completed, the outcomes written.
    fault: Callable[[str, sm.UnitLease, Any], Awaitable[None]] | None = None
    renewing: bool = True  # a simulation stalls a worker's renewals to let its leases expire
    _page: tuple[int, Any] | None = None
    _held: dict[int, tuple[sm.UnitLease, trio.CancelScope]] = attrs.field(factory=dict)
    _reading: trio.Lock = attrs.field(factory=trio.Lock)

    async def read_rows(self, lease: sm.UnitLease) -> list[dict]:
        async with self._reading:  # units in flight of one page read it once
            return await self._read_rows(lease)

    async def _read_rows(self, lease: sm.UnitLease) -> list[dict]:
        if self._page is None or self._page[0] != lease.page:
            scope = self.plan.ref.scope.map(self.shared.table_namespace,
                                            self.shared.map_invocation_id)
            page = await retry_transient(lambda: array_input.read_page(
                self.port, scope, lease.page))
            self._page = (lease.page, page)
        page = self._page[1]
        start = lease.low - page.offset
        return [occurrence.data for occurrence in page.rows[start:start + lease.row_count]]

    async def run_unit(self, lease: sm.UnitLease) -> bool:
        """Admit, run and complete one unit; False when its lease was lost meanwhile."""
        plan = self.plan
        await self._stage("claimed", lease)
        rows = await self.read_rows(lease)
        try:
            admission = await retry_transient(lambda: shared_units.admit_unit(
                self.port, plan.ref, self.shared.map_invocation_id, self.worker_id, lease,
                plan.table_namespace, plan.contract, rows, cell_policies=plan.cell_policies,
                give_up_after=plan.give_up_after))
        except LeaseLostError as exc:
            log.info("worker %s: %s", self.worker_id, exc)
            return False
        tally = UnitTally(rows=len(rows), cached=admission.cached or len(admission.completed),
                          blocked=len(admission.blocked), skipped=admission.skipped)
        await self._stage("admitted", lease)
        outcomes: list[RowOutcome] = []

        pending = iter(admission.pending)

        async def run_rows() -> None:
            # One of the unit's row tasks: holds a slot of the worker's concurrency while it
            # takes rows one after the other (a task and a slot per row cost more than a
            # no-op call).
            async with self.limiter:
                for admitted in pending:
                    outcomes.append(await run_row(plan, self.pacer, admitted, tally))
                    tally.executed += 1

        async with trio.open_nursery() as nursery:
            for _ in range(min(plan.concurrency, len(admission.pending))):
                nursery.start_soon(run_rows)
        await self._stage("computed", lease)
        try:
            await retry_transient(lambda: shared_units.complete_unit(
                self.port, plan.ref, self.shared.map_invocation_id, self.worker_id, lease,
                plan.table_namespace, plan.contract, outcomes, attrs.asdict(tally)))
        except LeaseLostError as exc:
            log.info("worker %s: %s", self.worker_id, exc)
            return False
        self.units_run += 1
        await self._stage("completed", lease, outcomes)
        return True

    async def _stage(self, stage: str, lease: sm.UnitLease, detail: Any = None) -> None:
        if self.fault is not None:
            await self.fault(stage, lease, detail)

    async def renew_leases(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.renew_s)
            if not self.renewing:
                continue
            leases = [lease for lease, _ in self._held.values()]
            held = await retry_transient(lambda: sm.renew(
                self.port, self.plan.ref, self.shared.map_invocation_id, self.worker_id, leases))
            for unit, (lease, scope) in list(self._held.items()):
                if unit not in held:
                    log.info("worker %s: lost unit %d of map %s", self.worker_id, unit,
                             self.shared.map_invocation_id)
                    scope.cancel()

    async def serve(self) -> int:
        """Claim and run units until none is claimable; the units this worker finished.

        Units run in claim order, up to `UNITS_IN_FLIGHT` at once (one unit's completion
        overlaps the next one's admission and rows); the next batch is claimed once the last
        unit of the current one has started."""
        self.pacer = open_pacer(self.port, self.plan.rate_limit)
        in_flight = trio.Semaphore(UNITS_IN_FLIGHT)

        async def run_one(lease: sm.UnitLease, scope: trio.CancelScope) -> None:
            try:
                with scope:
                    await self.run_unit(lease)
            finally:
                self._held.pop(lease.unit, None)
                in_flight.release()

        async with trio.open_nursery() as nursery:
            await nursery.start(self.renew_leases)
            async with trio.open_nursery() as units:
                while True:
                    leases = await retry_transient(lambda: sm.claim_units(
                        self.port, self.plan.ref, self.shared.map_invocation_id,
                        self.worker_id))
                    if not leases:
                        break
                    scopes = {lease.unit: trio.CancelScope() for lease in leases}
                    self._held.update({lease.unit: (lease, scopes[lease.unit])
                                       for lease in leases})
                    for lease in leases:
                        await in_flight.acquire()
                        units.start_soon(run_one, lease, scopes[lease.unit])
            nursery.cancel_scope.cancel()
        return self.units_run


def worker_plan(port: Port, shared: sm.SharedMap, fn: Callable[..., Any],
                concurrency: int | None) -> MapPlan:
    config = decode_config(shared.config)
    if config.executor is not None:  # a process pool of the worker's own
        from .executors import ProcessExecutor

        fn = ProcessExecutor(config.executor.get("max_workers")).bind(fn)
    return MapPlan(port, shared.ref, None, shared.table_namespace, config.contract, fn,
                   concurrency or config.concurrency, config.cell_policies, retry=config.retry,
                   row_timeout_s=config.row_timeout_s, rate_limit=config.rate_limit,
                   give_up_after=config.give_up_after)


async def serve_play(port: Port, play: str, play_file: str, *, concurrency: int | None = None,
                     exit_when_idle: bool = False, idle_wait_s: float = IDLE_WAIT_S,
                     poll_s: float = POLL_S, renew_s: float | None = None,
                     task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Serve the play's shared maps (see the module docstring); the units this worker ran."""
    loaded = PlayFile.load(play_file)
    worker_id = sm.new_worker_id()
    await retry_transient(lambda: sm.join(port, play, worker_id))
    task_status.started(worker_id)
    limiter = trio.CapacityLimiter(concurrency or 16)
    started = trio.current_time()
    units = 0
    seen = False  # a map of the play was seen: once none is left, an idle worker exits
    while True:
        maps = await retry_transient(lambda: sm.live_maps(port, play))
        for shared in maps:
            name = f"{shared.ref.run_id}/{shared.map_invocation_id}"
            fn = check_published(loaded, name, shared.function, shared.play_digest)
            if shared.state != sm.OPEN:
                continue
            plan = worker_plan(port, shared, fn, concurrency)
            worker = MapWorker(port, worker_id, shared, plan, limiter,
                               renew_s if renew_s is not None else shared.lease_s / 3)
            units += await worker.serve()
        if exit_when_idle:
            seen = seen or bool(maps)
            if not maps and (seen or trio.current_time() - started > idle_wait_s):
                return units
            if maps and await retry_transient(lambda: sm.units_remaining(port, play)) == 0:
                return units
        await trio.sleep(poll_s)
        await retry_transient(lambda: sm.join(port, play, worker_id))
