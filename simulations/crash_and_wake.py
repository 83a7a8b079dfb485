"""Scenario `crash_and_wake`: a run crashes at a drawn point, then is woken with the same run id.

How it works
- Hypothesis draws a `Plan`: the rows (a list source, staged and replayed, or an async stream),
  which rows the user function fails on, where the first incarnation crashes, whether it
  crashes by cancellation or lives on as a *zombie* attempt, and fault plans for both
  incarnations (`simulations.faults`: delays, checkpoints, and up to two dropped connections
  each — before a statement or after it applied with the reply lost — which the actors must
  ride through with their retries). Each example runs in its own `trio.run` on a
  fresh schema, bounded by `trio.fail_after`.
- Crash points are counted per phase, read from the phase mark (`actors.phases`) of the task
  that reaches a store boundary: `staging` (the sealer's page putters), `admission`,
  `completion` (the completer's writer, i.e. inside a completion batch), or `executed` (after n
  user-function calls). The drawn crash point must fire (else the example fails: it would test
  nothing), and so must a drawn `flush_fault` (hit at the flush's first checkout). When the
  point is reached the first incarnation is cancelled from outside, as a killed process would be;
  outcomes already computed are flushed by the map's shielded flush — or, with `flush_fault`,
  the store fails inside that flush and those outcomes are lost (their rows simply run again). In zombie mode the first
  incarnation is not cancelled: it runs on under attempt `a1` (lease 0 s, so it is superseded at
  once) while the wake runs under attempt `a2`, and its late writes must be fenced.
- Just before the wake starts, the sheet is read: the rows enriched then are *finished before
  the crash*. The wake maps the same source again (a list source is replayed from the sealed
  array once the list is proven the one staged) and ends terminally, which retires the run.
- Invariants, judged against a pure model (the user function is deterministic per row):
  1. every row is terminal with exactly the model's status, output and error;
  2. no row finished before the crash was executed by the wake (fn calls counted per row);
  3. the sheet counters (`sheet_summary` and per-column completed cells) equal COUNT(*);
  4. after the terminal retirement no array fact of the run remains (only the retained guard),
     and the outbox entry is done;
  5. a first incarnation that ended terminally retired the run: waking it is not an error —
     its list map admits the caller's list directly (a retired run stages nothing) and, like
     its stream map, finds every finished row cached.
"""

from __future__ import annotations

import collections
import logging
import uuid
from typing import Callable, Literal

import attrs
import trio
from hypothesis import strategies as st

from runplane.actors import open_run, phases
from runplane.engine import PlayScope, sheets
from runplane.engine.errors import EngineError, RetiredError, StoreUnavailableError
from runplane.engine.ports import SHEET_LANE
from runplane.engine.runs.outbox import OutboxState
from runplane.engine.sheets import RowStatus
from runplane.engine.sheets.layout import column, layout_for
from runplane.engine.tenant import Tenant

from .faults import Fault, FaultPlan, FaultyPort, fault_plans
from .harness import open_example_tenant, run_examples, unfired
from .ports import HookedPort
from .report import SimulationReport

NAME = "crash_and_wake"
EXAMPLE_TIMEOUT = 60.0
ORG, PLAY, TABLE = "org-sim", "play-sim", "companies"
CONTRACT = sheets.SheetContract(inputs=("name", "i"), outputs=("upper",))

Phase = Literal["staging", "admission", "completion", "executed"]
PHASES: tuple[Phase, ...] = ("staging", "admission", "completion", "executed")
MIN_PHASE_BOUNDARIES = {"staging": 2, "admission": 6, "completion": 6}
STORE_PHASES = frozenset({"staging", "admission", "completion"})  # counted at store boundaries


@attrs.frozen
class Plan:
    rows: int
    source: Literal["list", "stream"]
    failing: frozenset[int]
    crash_phase: Phase
    crash_at: int
    zombie: bool
    flush_fault: bool
    concurrency: int
    first_faults: FaultPlan
    wake_faults: FaultPlan

    def source_rows(self) -> list[dict]:
        return [{"name": f"c{i}", "i": i} for i in range(self.rows)]

    def describe(self) -> str:
        def kinds(plan):
            return [f.kind for f in plan.steps if f.kind not in ("none", "checkpoint")]

        return (f"rows={self.rows} source={self.source} failing={sorted(self.failing)} "
                f"crash={self.crash_phase}#{self.crash_at} zombie={self.zombie} "
                f"flush_fault={self.flush_fault} "
                f"concurrency={self.concurrency} first_faults={kinds(self.first_faults)} "
                f"wake_faults={kinds(self.wake_faults)}")


MAX_TRANSIENT_FAULTS = 2  # fewer than the actors' retry budget: no call may give up


def cap_transient(plan: FaultPlan) -> FaultPlan:
    """Keep the first `MAX_TRANSIENT_FAULTS` dropped connections of a plan, quiet the rest."""
    steps, transient = [], 0
    for step in plan.steps:
        if step.kind in ("unavailable", "lost_reply"):
            transient += 1
            if transient > MAX_TRANSIENT_FAULTS:
                step = Fault("none")
        steps.append(step)
    return FaultPlan(steps)


# Delays and checkpoints perturb the interleaving; dropped connections (before a statement, or
# after it applied with the reply lost) must be ridden through by the actors' retries.
FAULTS = fault_plans(
    max_steps=24, kinds=("none", "checkpoint", "delay", "unavailable", "lost_reply")
).map(cap_transient)


@st.composite
def plans(draw) -> Plan:
    rows = draw(st.integers(1, 1500), label="rows")
    source = draw(st.sampled_from(("list", "stream")), label="source")
    failing = draw(st.frozensets(st.integers(0, rows - 1), max_size=min(rows, 8)), label="fail")
    phases = PHASES if source == "list" else PHASES[1:]
    phase = draw(st.sampled_from(phases), label="crash_phase")
    # Store boundaries per phase are few (a checkout and a handful of statements per call); a
    # drawn point must fire, so it stays within what the phase always reaches (measured: a page
    # put is 2 boundaries, a page admission 6, a completion batch 6); `executed` counts
    # user-function calls.
    most = rows if phase == "executed" else MIN_PHASE_BOUNDARIES[phase]
    crash_at = draw(st.integers(1, most), label="crash_at")
    zombie = draw(st.booleans(), label="zombie")
    # A flush fault needs computed outcomes to flush: inside a completion batch, or after the
    # first user-function call returned.
    flushes = phase == "completion" or (phase == "executed" and crash_at >= 2)
    return Plan(
        rows=rows,
        source=source,
        failing=failing,
        crash_phase=phase,
        crash_at=crash_at,
        zombie=zombie,
        flush_fault=not zombie and flushes and draw(st.booleans(), label="flush_fault"),
        concurrency=draw(st.sampled_from((1, 4, 16)), label="concurrency"),
        first_faults=draw(FAULTS, label="first_faults"),
        wake_faults=draw(FAULTS, label="wake_faults"),
    )


@attrs.define(eq=False)
class CrashPoint:
    """A hook that fires `crash` when the drawn phase reaches its drawn count."""

    phase: Phase
    at: int
    crash: Callable[[], object]  # cancel, or hand over to the wake
    flush_fault: bool = False
    counts: collections.Counter = attrs.field(factory=collections.Counter)
    fired: bool = False
    flush_faults: int = 0

    def tick(self, phase: str) -> bool:
        if self.fired or phase != self.phase:
            return False
        self.counts[phase] += 1
        if self.counts[phase] == self.at:
            self.fired = True
            self.crash()
            return True
        return False

    async def at_boundary(self, boundary) -> None:
        phase = phases.current()
        if self.fired and self.flush_fault and phase == "flush" \
                and boundary.kind == "checkout" and not self.flush_faults:
            # After the crash, the shielded flush of computed outcomes: the store fails there,
            # and those outcomes are lost.
            self.flush_faults += 1
            raise StoreUnavailableError("injected: store lost during the cancellation flush")
        if phase in STORE_PHASES and self.tick(phase):
            await trio.lowlevel.checkpoint()  # a cancellation lands here, inside the call

    def unfired(self) -> list[str]:
        """What was drawn and never happened: the crash point, or the flush fault."""
        out = []
        if not self.fired:
            out.append(f"the crash point {self.phase}#{self.at} never fired "
                       f"(the phase reached {self.counts[self.phase]})")
        elif self.flush_fault and not self.flush_faults:
            out.append("the drawn flush fault never fired (nothing was flushed)")
        return out


def expected(plan: Plan, i: int) -> tuple[str, str | None, str | None]:
    """(status, upper, error) the model says row i ends with."""
    if i in plan.failing:
        return "failed", None, f"no data for c{i}"
    return "enriched", f"C{i}", None


@attrs.define(eq=False)
class Example:
    tenant: Tenant
    plan: Plan
    run_id: str = attrs.field(factory=lambda: f"run-{uuid.uuid4().hex[:12]}")
    calls: dict[str, collections.Counter] = attrs.field(
        factory=lambda: {"first": collections.Counter(), "wake": collections.Counter()})
    faults: int = 0
    violations: list[str] = attrs.field(factory=list)
    first_outcome: str | None = None

    def fn(self, who: str, crash_point: CrashPoint | None):
        async def enrich(row: dict) -> dict:
            await trio.lowlevel.checkpoint()
            self.calls[who][row["i"]] += 1
            if crash_point is not None:
                crash_point.tick("executed")
            if row["i"] in self.plan.failing:
                raise LookupError(f"no data for c{row['i']}")
            return {"upper": f"C{row['i']}"}

        return enrich

    def source(self):
        if self.plan.source == "list":
            return self.plan.source_rows()
        rows = self.plan.source_rows()  # a stream is not staged: a wake must stream it again

        async def stream():
            for row in rows:
                yield row

        return stream()

    async def first(self, port, crash: trio.CancelScope, crash_point: CrashPoint,
                    handed_over: trio.Event) -> None:
        """The first incarnation; records how it ended in `first_outcome`."""
        attempt = sheets.Attempt("a1", 1, lease_s=0.0) if self.plan.zombie else None
        try:
            with crash:
                async with open_run(port, PLAY, self.run_id, attempt=attempt,
                                    retire_on_exit=not self.plan.zombie) as run:
                    await run.map(TABLE, self.source(), self.fn("first", crash_point),
                                  contract=CONTRACT, concurrency=self.plan.concurrency)
            self.first_outcome = "crashed" if crash.cancelled_caught else "finished"
        except RetiredError as exc:
            if self.plan.zombie:
                self.first_outcome = "retired under the zombie"  # the wake retired the run
            else:
                self.violations.append(f"first incarnation raised RetiredError: {exc}")
        except EngineError as exc:
            self.violations.append(f"first incarnation raised {type(exc).__name__}: {exc}")
        finally:
            handed_over.set()

    async def wake(self, port, finished_before: set[int]) -> None:
        attempt = sheets.Attempt("a2", 2) if self.plan.zombie else None
        # The wake passes the same list: a sealed list source is replayed from the array (a
        # different list, sealed or still staging, is a ConflictError: tests/test_map_invocations).
        async with open_run(port, PLAY, self.run_id, attempt=attempt) as run:
            result = await run.map(TABLE, self.source(), self.fn("wake", None),
                                   contract=CONTRACT, concurrency=self.plan.concurrency)
        if not self.plan.zombie and result.cached < len(finished_before):
            self.violations.append(
                f"the wake found {result.cached} cached rows, fewer than the "
                f"{len(finished_before)} finished before the crash")

    async def enriched_now(self) -> set[int]:
        rows = await sheets.read_rows(self.tenant, PlayScope(ORG, PLAY), TABLE, limit=10_000)
        return {row["i"] for row in rows if row["_status"] == RowStatus.ENRICHED}


async def run_example(dsn: str, plan: Plan) -> tuple[list[str], int]:
    async with open_example_tenant(ORG, dsn) as tenant:
        example = Example(tenant, plan)
        try:
            with trio.fail_after(EXAMPLE_TIMEOUT):
                await play_example(example)
        except trio.TooSlowError:
            example.violations.append(f"the example hung past {EXAMPLE_TIMEOUT}s")
            return example.violations, example.faults
        if not example.violations:
            example.violations.extend(await check_final(example))
        return example.violations, example.faults


async def play_example(example: Example) -> None:
    plan, tenant = example.plan, example.tenant
    crash = trio.CancelScope()
    handed_over = trio.Event()
    finished_before: set[int] = set()

    def on_crash() -> None:
        if plan.zombie:
            handed_over.set()  # the zombie lives on; the wake starts now
        else:
            crash.cancel()

    crash_point = CrashPoint(plan.crash_phase, plan.crash_at, on_crash, plan.flush_fault)
    first_port = FaultyPort(HookedPort(tenant, crash_point), plan.first_faults)
    wake_port = FaultyPort(tenant, plan.wake_faults)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(example.first, first_port, crash, crash_point, handed_over)
        # Without a zombie this fires once the crashed incarnation unwound completely.
        await handed_over.wait()
        if example.violations:
            return
        finished_before |= await example.enriched_now()
        try:
            await example.wake(wake_port, finished_before)
        except RetiredError as exc:
            example.violations.append(f"the wake met RetiredError: {exc}")
    example.faults = first_port.injected + wake_port.injected + crash_point.flush_faults
    example.violations.extend(crash_point.unfired())
    example.violations.extend(unfired({"first": first_port, "wake": wake_port}))
    rerun = set(example.calls["wake"]) & finished_before
    if rerun:
        example.violations.append(
            f"rows finished before the crash ran again in the wake: {sorted(rerun)[:10]}")


async def check_final(example: Example) -> list[str]:
    plan, tenant = example.plan, example.tenant
    out: list[str] = []
    scope = PlayScope(ORG, PLAY)
    rows = await sheets.read_rows(tenant, scope, TABLE, limit=10_000)
    by_index = {row["i"]: row for row in rows}
    if sorted(by_index) != list(range(plan.rows)) or len(rows) != plan.rows:
        out.append(f"the sheet holds {len(rows)} rows, expected {plan.rows} distinct")
    for i, row in sorted(by_index.items()):
        status, upper, error = expected(plan, i)
        got = (row["_status"], row.get("upper") if status == RowStatus.ENRICHED else None,
               row["_error"] if status == RowStatus.FAILED else None)
        if got != (status, upper, error):
            out.append(f"row {i}: expected {(status, upper, error)}, found {got}")
            break
    summary = await sheets.summary(tenant, scope, TABLE)
    layout = layout_for(tenant, scope, TABLE)
    async with tenant.connection(SHEET_LANE) as conn:
        counts = await conn.fetchrow(
            f"SELECT count(*) AS total,"
            f" count(*) FILTER (WHERE _status = 'pending') AS queued,"
            f" count(*) FILTER (WHERE _status = 'running') AS running,"
            f" count(*) FILTER (WHERE _status = 'enriched') AS completed,"
            f" count(*) FILTER (WHERE _status = 'failed') AS failed,"
            f" count(*) FILTER (WHERE _cell_meta->'upper'->>'status' = 'completed'"
            f"                  AND {column('upper')} IS NOT NULL) AS upper_completed"
            f" FROM {layout.qualified}")
        facts = await conn.fetch(
            f'SELECT output->>\'kind\' AS kind FROM "{tenant.schema}".work_receipts'
            " WHERE run_id = $1 AND output->>'kind' LIKE 'array_input_%'", example.run_id)
        state = await conn.fetchval(
            f'SELECT state FROM "{tenant.schema}".terminal_outbox WHERE run_id = $1',
            example.run_id)
    stored = (summary.total, summary.queued, summary.running, summary.completed, summary.failed)
    counted = tuple(counts[k] for k in ("total", "queued", "running", "completed", "failed"))
    if stored != counted:
        out.append(f"sheet_summary {stored} != COUNT(*) {counted}")
    column_summary = summary.columns.get("upper")
    if column_summary is None or column_summary.completed != counts["upper_completed"]:
        out.append(f"column summary {column_summary} != COUNT(*) {counts['upper_completed']}")
    kinds = sorted(row["kind"] for row in facts)
    if kinds not in ([], ["array_input_guard"]):
        out.append(f"array facts left after the terminal retirement: {kinds}")
    if state != OutboxState.DONE:
        out.append(f"the outbox entry is {state!r} after the terminal retirement")
    return out


# Failing schedules found, `(plan, scheduler seed)`: each runs first in every run
# (docs/guide/testing.md, "Simulations"). Paste the "minimal failing schedule" a failed run prints.
REGRESSIONS: list[tuple[Plan, int]] = []


def run(examples: int, seed: int | None, dsn: str | None = None) -> SimulationReport:
    """Run `examples` hypothesis examples of the scenario; collect what they violate."""
    # Injected store faults make the actors log warnings (a lost flush); keep the report clean.
    logging.getLogger("runplane.actors").setLevel(logging.ERROR)
    return run_examples(NAME, plans(), run_example, examples=examples, seed=seed, dsn=dsn,
                        regressions=REGRESSIONS)
