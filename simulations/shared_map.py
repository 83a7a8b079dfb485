"""Scenario `shared_map`: workers race over the unit leases of one shared map.

How it works
- Hypothesis draws a `Plan`: 30–300 rows cut into units of a drawn size, a lease period, and
  2–4 in-process workers (`actors.shared.service.MapWorker`), each with a concurrency, a call
  latency and at most one fault at a drawn stage of its n-th claim: `crash` (the worker dies
  there, renewing and writing nothing more: its leases must expire and be taken over),
  `stall` (it stops renewing and sleeps past its lease, then carries on: its late completion
  must be refused) or `lost_reply` (after a batch of its completions committed it sends the
  same batch again, as a worker that lost the reply would: the replay must change nothing).
  The last worker never crashes, so the map can finish.
- The coordinator is `run.map(..., shared=True)` (it runs no rows); the workers run in the same
  `trio.run` (trio's scheduler seeded by hypothesis), bounded by `trio.fail_after`. Each
  worker's function writes the worker's name.
- The rows are distinct, so the map is published `concurrent`: the workers' unit writes race
  without the sheet's serialization, their counters going to per-backend deltas.
- Invariants: every row is enriched and was written exactly once (`_attempts` = 1, fenced
  replays add nothing); no write by an expired holder lands (a row was computed by the worker
  whose claim it was written under: rows a holder recorded before its unit was taken over
  stay, the rest run once under the next holder); every unit is done; the coordinator's
  `MapResult` equals the sheet (completed = enriched rows, nothing failed or fenced);
  counters equal a COUNT over the sheet.
- Faults reported: crashes, stalls (with takeovers) and lost replies that actually fired, so
  the CI-sized test can assert the drawn faults happened.
"""

from __future__ import annotations

import attrs
import trio
from hypothesis import strategies as st

from runplane.actors import open_run
from runplane.actors.shared.service import MapWorker
from runplane.actors.shared.worker import worker_plan
from runplane.engine import PlayScope, canonical
from runplane.engine.shared import units as shared_units
from runplane.engine.shared import maps as sm
from runplane.engine.errors import LeaseLostError
from runplane.engine.sheets import RowStatus, SheetContract
from runplane.engine.sheets.layout import column, layout_for

from .counters import counters_match
from .harness import open_example_tenant, run_examples

NAME = "shared_map"
EXAMPLE_TIMEOUT = 120.0
ORG, PLAY, NS = "org-sim", "play-sim", "Shared"
CONTRACT = SheetContract(inputs=("n",), outputs=("by",))
STAGES = ("claimed", "admitted", "computed", "completed")


class Crash(Exception):
    """A drawn worker death: nothing after it runs, no lease is given back."""


async def published(row: dict) -> dict:
    """The function the map is published with (workers run their own, tagged, copies)."""
    return {"by": "nobody"}


@attrs.frozen
class WorkerPlan:
    concurrency: int
    latency_ms: int
    fault: str | None        # crash | stall | lost_reply
    fault_unit: int          # at this worker's n-th claim ...
    fault_stage: str         # ... at this stage


@attrs.frozen
class Plan:
    rows: int
    unit_rows: int
    lease_s: float
    workers: tuple[WorkerPlan, ...]

    def describe(self) -> str:
        return (f"rows={self.rows} unit_rows={self.unit_rows} lease={self.lease_s}s workers="
                + ", ".join(f"(c={w.concurrency}, latency={w.latency_ms}ms, {w.fault} at "
                            f"claim {w.fault_unit} {w.fault_stage})" for w in self.workers))


@st.composite
def plans(draw) -> Plan:
    count = draw(st.integers(2, 4), label="workers")
    workers = []
    for i in range(count):
        last = i == count - 1
        faults = (None, "stall", "lost_reply") if last else (None, "crash", "stall", "lost_reply")
        fault = draw(st.sampled_from(faults))
        workers.append(WorkerPlan(
            concurrency=draw(st.integers(1, 4)),
            latency_ms=draw(st.sampled_from((0, 1, 3))),
            fault=fault,
            fault_unit=draw(st.integers(0, 2)),
            fault_stage="completed" if fault == "lost_reply" else draw(st.sampled_from(STAGES)),
        ))
    return Plan(rows=draw(st.integers(30, 300)), unit_rows=draw(st.sampled_from((7, 25, 60))),
                lease_s=draw(st.sampled_from((0.4, 0.8))), workers=tuple(workers))


@attrs.define(eq=False)
class Faults:
    crashed: int = 0
    stalled: int = 0
    lost_replies: int = 0
    violations: list[str] = attrs.field(factory=list)


async def _worker(tenant, plan: Plan, index: int, spec: WorkerPlan, faults: Faults,
                  done: trio.Event) -> None:
    name = f"w{index}"
    units_seen = 0

    async def fn(row: dict) -> dict:
        if spec.latency_ms:
            await trio.sleep(spec.latency_ms / 1000)
        else:
            await trio.lowlevel.checkpoint()
        return {"by": name}

    while True:  # wait for the coordinator to open the map
        maps = await sm.live_maps(tenant, PLAY)
        if maps and maps[0].state == sm.OPEN:
            shared = maps[0]
            break
        await trio.sleep(0.01)
    worker_id = f"{name}:{index}"
    await sm.join(tenant, PLAY, worker_id)
    worker = MapWorker(tenant, worker_id, shared, worker_plan(tenant, shared, fn, spec.concurrency),
                       trio.CapacityLimiter(spec.concurrency), renew_s=plan.lease_s / 3)

    async def fault(stage: str, leases: list, detail) -> None:
        nonlocal units_seen
        if stage == "claimed":
            units_seen += 1
        if spec.fault is None or units_seen - 1 != spec.fault_unit or stage != spec.fault_stage:
            return
        if spec.fault == "crash":
            faults.crashed += 1
            raise Crash(name)
        if spec.fault == "stall":
            faults.stalled += 1
            worker.renewing = False
            await trio.sleep(plan.lease_s * 2.5)
            worker.renewing = True
        elif spec.fault == "lost_reply":
            faults.lost_replies += 1
            settlements, outcomes = detail
            try:  # the same batch again, as after a lost reply: it must change nothing
                await shared_units.complete_units(tenant, shared.ref, shared.map_invocation_id,
                                                  worker_id, settlements, NS, CONTRACT,
                                                  outcomes)
            except LeaseLostError:
                return

    worker.fault = fault
    try:
        while not done.is_set():
            await worker.serve()
            await trio.sleep(plan.lease_s / 4)  # expired units of dead workers come free
    except* Crash:
        pass  # the worker died: nothing after the crash point runs


async def _rows(tenant) -> list:
    layout = layout_for(tenant, PlayScope(ORG, PLAY), NS)
    async with tenant.connection("sheet") as conn:
        return await conn.fetch(
            f"SELECT _status, _attempts, _input_index, _attempt_id, {column('by')}::text AS by"
            f" FROM {layout.qualified}")


async def run_example(dsn: str, plan: Plan) -> tuple[list[str], dict[str, int]]:
    faults = Faults()
    async with open_example_tenant(ORG, dsn) as tenant:
        result = None
        done = trio.Event()
        try:
            with trio.fail_after(EXAMPLE_TIMEOUT):
                async with open_run(tenant, PLAY, "run-0", retire_on_exit=False) as run:
                    async with trio.open_nursery() as nursery:
                        for index, spec in enumerate(plan.workers):
                            nursery.start_soon(_worker, tenant, plan, index, spec, faults, done)
                        result = await run.map(NS, [{"n": i} for i in range(plan.rows)],
                                               published, contract=CONTRACT, shared=True,
                                               lease_s=plan.lease_s, unit_rows=plan.unit_rows)
                        done.set()
        except trio.TooSlowError:
            return [f"the example did not finish within {EXAMPLE_TIMEOUT}s"], {}
        violations = list(faults.violations)
        rows = await _rows(tenant)
        async with tenant.connection("sheet") as conn:
            units = await conn.fetch(
                f'SELECT low, row_count, done, holder, claims FROM "{tenant.schema}".shared_units')
        for unit in units:
            if not unit["done"]:
                violations.append(f"unit at {unit['low']} is not done")
        if len(rows) != plan.rows:
            violations.append(f"{len(rows)} rows stored, expected {plan.rows}")
        for row in rows:
            by = canonical.loads(row["by"])
            writer = (row["_attempt_id"] or "").split(":")[0]
            if row["_status"] != RowStatus.ENRICHED or row["_attempts"] != 1:
                violations.append(f"row {row['_input_index']}: {row['_status']} after "
                                  f"{row['_attempts']} writes")
            elif by != writer:
                violations.append(f"row {row['_input_index']} computed by {by}, but written "
                                  f"under {row['_attempt_id']}")
        enriched = sum(1 for row in rows if row["_status"] == RowStatus.ENRICHED)
        if result is None or (result.completed, result.failed, result.fenced,
                              result.admitted) != (enriched, 0, 0, plan.rows):
            violations.append(f"the coordinator's result {result} does not match the sheet "
                              f"({enriched} enriched of {plan.rows})")
        ok, detail = await counters_match(tenant, PlayScope(ORG, PLAY), NS)
        if not ok:
            violations.append(detail)
        takeovers = sum(1 for unit in units if unit["claims"] > 1)
    return violations[:10], {"crashed": faults.crashed, "stalled": faults.stalled,
                             "lost_replies": faults.lost_replies, "takeovers": takeovers}


# Failing schedules found, `(plan, scheduler seed)`: each runs first in every run.
REGRESSIONS: list[tuple[Plan, int]] = []


def run(examples: int, seed: int | None, dsn: str | None = None):
    """Run `examples` hypothesis examples of the scenario; collect what they violate."""
    return run_examples(NAME, plans(), run_example, examples=examples, seed=seed, dsn=dsn,
                        regressions=REGRESSIONS)
