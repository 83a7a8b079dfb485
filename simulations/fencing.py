"""Scenario `fencing`: runs (write versions) and attempts admit and complete overlapping rows.

How it works
- Hypothesis draws a `Plan`: 1–3 runs registered in order (so later runs have larger epochs),
  and 2–6 actors, each bound to a run and optionally to an attempt whose lease is live (300 s)
  or already expired (0 s), with a start delay, a `FaultPlan` (delays, checkpoints, transient
  store errors, cancellations at checkouts and statements) and a script of steps: admit a subset
  of the rows (sometimes under a cell policy that makes every completed cell stale, so enriched
  rows are taken again), or complete a subset with drawn statuses (sometimes for keys no row
  has). Every
  completed outcome's `score`, and every failed outcome's error, is unique to its call, so the
  stored row names the call that wrote it.
- Each example runs in its own `trio.run` on its own tenant and fresh schema, all actors at
  once (trio's scheduler is seeded by hypothesis), bounded by `trio.fail_after`. Calls that
  raise had no effect (one transaction each; COMMIT is never faulted); calls that return are
  recorded in a `SheetHistory`.
- Afterwards the history judges the stored sheet (`simulations.sheet_model`): each row belongs
  to the highest write version that took it and holds outputs written by that version from an
  attempt compatible with the one holding the row; no fenced outcome's value is stored; fence
  reasons agree with the versions they report. Then `sheet_summary` and
  `sheet_column_summary` must equal a fresh COUNT over the sheet.
"""

from __future__ import annotations

import attrs
import trio
from hypothesis import strategies as st

from runplane.engine import PlayScope, RunScope, canonical, runs
from runplane.engine.errors import EngineError
from runplane.engine.ports import SHEET_LANE
from runplane.engine.sheets import (
    Attempt,
    CellPolicy,
    RowOutcome,
    SheetContract,
    admit,
    complete,
    row_key,
)
from runplane.engine.sheets.layout import column, layout_for

from .counters import counters_match
from .faults import FaultPlan, FaultyPort, fault_plans
from .harness import open_example_tenant, run_examples, unfired
from .report import SimulationReport
from .sheet_model import AdmitCall, CompleteCall, SentOutcome, SheetHistory, StoredRow

NAME = "fencing"
EXAMPLE_TIMEOUT = 60.0
ORG, PLAY, NS = "org-sim", "play-sim", "Fencing"
CONTRACT = SheetContract(inputs=("name",), outputs=("score",))


@attrs.frozen
class Step:
    kind: str  # admit | complete
    rows: tuple[int, ...]
    failed: tuple[bool, ...] = ()
    ghost: bool = False
    stale: bool = False  # admit with a policy that makes every completed cell stale


@attrs.frozen
class Actor:
    name: str
    run: int
    attempt: tuple[str, int, float] | None  # (attempt id, seq, lease_s)
    start_delay_ms: int
    steps: tuple[Step, ...]
    faults: FaultPlan


@attrs.frozen
class Plan:
    rows: int
    runs: int
    actors: tuple[Actor, ...]

    def describe(self) -> str:
        return f"rows={self.rows} runs={self.runs} actors=" + ", ".join(
            f"{a.name}(run={a.run}, attempt={a.attempt}, delay={a.start_delay_ms}ms, steps="
            + "/".join(
                f"{s.kind}{list(s.rows)}{'+ghost' if s.ghost else ''}{'+stale' if s.stale else ''}"
                for s in a.steps
            )
            + f", faults={[f.kind for f in a.faults.steps if f.kind != 'none']})"
            for a in self.actors
        )


@st.composite
def plans(draw) -> Plan:
    n = draw(st.integers(1, 8), label="rows")
    run_count = draw(st.integers(1, 3), label="runs")
    attempts_by_run: dict[int, list[str]] = {}
    actors = []
    for i in range(draw(st.integers(2, 6), label="actors")):
        run = draw(st.integers(0, run_count - 1))
        attempt = None
        if draw(st.integers(0, 2)):
            known = attempts_by_run.setdefault(run, [])
            if known and draw(st.booleans()):
                attempt_id = draw(st.sampled_from(known))  # a second worker of one attempt
            else:
                attempt_id = f"r{run}-a{len(known)}"
                known.append(attempt_id)
            attempt = (attempt_id, int(attempt_id.rsplit("a", 1)[1]),
                       draw(st.sampled_from((0.0, 300.0))))
        steps = []
        for _ in range(draw(st.integers(1, 4))):
            rows = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n)))
            kind = draw(st.sampled_from(("admit", "complete")))
            steps.append(Step(
                kind=kind, rows=rows,
                failed=tuple(draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))),
                ghost=kind == "complete" and draw(st.integers(0, 5)) == 0,
                stale=kind == "admit" and draw(st.integers(0, 4)) == 0,
            ))
        actors.append(Actor(
            name=f"actor-{i}", run=run, attempt=attempt,
            start_delay_ms=draw(st.integers(0, 15)), steps=tuple(steps),
            faults=draw(fault_plans(max_steps=12)),
        ))
    return Plan(n, run_count, tuple(actors))


def _row(i: int) -> dict:
    return {"name": f"row-{i}"}


@attrs.define(eq=False)
class _Example:
    tenant: object
    run_refs: list
    history: SheetHistory = attrs.field(factory=SheetHistory)
    faults: int = 0
    ports: dict = attrs.field(factory=dict)

    async def act(self, actor: Actor) -> None:
        port = self.ports[actor.name] = FaultyPort(self.tenant, actor.faults)
        attempt = Attempt(*actor.attempt) if actor.attempt else None
        run = self.run_refs[actor.run]
        try:
            await trio.sleep(actor.start_delay_ms / 1000)
            for n, step in enumerate(actor.steps):
                with port.cancellable():
                    try:
                        if step.kind == "admit":
                            await self._admit(port, actor, run, attempt, step)
                        else:
                            await self._complete(port, actor, run, attempt, step, n)
                    except EngineError:
                        pass  # no effect: the call's transaction rolled back
        finally:
            self.faults += port.injected

    async def _admit(self, port, actor, run, attempt, step) -> None:
        rows = [_row(i) for i in step.rows]
        policies = {"score": CellPolicy(0)} if step.stale else None
        result = await admit(port, run, NS, CONTRACT, rows, attempt=attempt, cell_policies=policies)
        self.history.admissions.append(AdmitCall(
            actor=actor.name, epoch=run.epoch,
            attempt_id=attempt.attempt_id if attempt else None,
            keys=tuple(dict.fromkeys(row_key(r, NS) for r in rows)),
            pending=tuple(r.key for r in result.pending),
            completed=tuple(r.key for r in result.completed),
            blocked=tuple((r.key, r.reason) for r in result.blocked),
        ))

    async def _complete(self, port, actor, run, attempt, step, n) -> None:
        sent: dict[str, SentOutcome] = {}
        outcomes = []
        for i, failed in zip(step.rows, step.failed):
            key = f"ghost-{i}" if step.ghost else row_key(_row(i), NS)
            value = f"{actor.name}#{n}:{i}"
            if failed:
                outcomes.append(RowOutcome(key, "failed", error=value))
            else:
                outcomes.append(RowOutcome(key, "completed", {"score": value}))
            sent.pop(key, None)
            sent[key] = SentOutcome(key, "failed" if failed else "completed", value)
        result = await complete(port, run, NS, CONTRACT, outcomes, attempt=attempt)
        self.history.completions.append(CompleteCall(
            actor=actor.name, epoch=run.epoch,
            attempt_id=attempt.attempt_id if attempt else None,
            outcomes=tuple(sent.values()),
            committed=result.committed_keys,
            fenced=tuple((f.key, f.reason, f.row_write_version) for f in result.fenced),
        ))


async def stored_rows(tenant) -> dict[str, StoredRow]:
    layout = layout_for(tenant, PlayScope(ORG, PLAY), NS)
    async with tenant.connection(SHEET_LANE) as conn:
        if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", layout.qualified):
            return {}
        records = await conn.fetch(
            f"SELECT _key, _status, _write_version, _attempt_id, _error, "
            f"{column('score')}::text AS score FROM {layout.qualified}"
        )
    return {
        r["_key"]: StoredRow(r["_key"], r["_status"], r["_write_version"], r["_attempt_id"],
                             canonical.loads(r["score"]), r["_error"])
        for r in records
    }


async def run_example(dsn: str, plan: Plan) -> tuple[list[str], int]:
    async with open_example_tenant(ORG, dsn) as tenant:
        run_refs = [
            await runs.register(tenant, RunScope(ORG, PLAY, f"run-{i}"))
            for i in range(plan.runs)
        ]
        example = _Example(tenant, run_refs)
        try:
            with trio.fail_after(EXAMPLE_TIMEOUT):
                async with trio.open_nursery() as nursery:
                    for actor in plan.actors:
                        nursery.start_soon(example.act, actor)
        except trio.TooSlowError:
            return [f"the example did not finish within {EXAMPLE_TIMEOUT}s"], example.faults
        violations = example.history.check(await stored_rows(tenant)) + unfired(example.ports)
        ok, detail = await counters_match(tenant, PlayScope(ORG, PLAY), NS)
        if not ok:
            violations.append(detail)
        return violations, example.faults


# Failing schedules found, `(plan, scheduler seed)`: each runs first in every run
# (docs/guide/testing.md, "Simulations"). Paste the "minimal failing schedule" a failed run prints.
REGRESSIONS: list[tuple[Plan, int]] = []


def run(examples: int, seed: int | None, dsn: str | None = None) -> SimulationReport:
    """Run `examples` hypothesis examples of the scenario; collect what they violate."""
    return run_examples(NAME, plans(), run_example, examples=examples, seed=seed, dsn=dsn,
                        regressions=REGRESSIONS)
