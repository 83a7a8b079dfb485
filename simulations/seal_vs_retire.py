"""Scenario `seal_vs_retire`: stagers, sealers, readers and retirers race on one run's array input.

How it works
- Hypothesis draws a whole `Plan` up front: the source (1–9 pages), and for every actor its
  role, start delay, retry budget and `FaultPlan` (delays, checkpoints, transient store errors,
  lost replies and cancellations at checkouts and statements), plus an optional tamperer that
  rewrites one stored page behind the engine's back. Each example then runs in its own `trio.run` (trio's
  scheduler is seeded by hypothesis), opens its own tenant on a fresh schema, runs every actor
  concurrently through its own `FaultyPort`, and is bounded by `trio.fail_after`.
    stager   begin, then put pages in a drawn order (the first stager puts all of them)
    sealer   seal with batch size 1, 4 or 8, polling while pages are missing
    reader   poll get_manifest, then read every page once sealed
    retirer  retire until done
- Afterwards `ArrayModel.check` judges the recorded calls against what the store holds (see
  `simulations.array_model` for the invariants), and once retirement was done every kind of
  call is probed once more: each must raise `RetiredError`.
- Violations are collected into the `SimulationReport` rather than raised, so one run reports
  every broken example; a failing example is described by its drawn plan.
"""

from __future__ import annotations

import json
from typing import Literal

import attrs
import trio
from hypothesis import strategies as st

from runplane.engine import RunScope
from runplane.engine import array_input as A
from runplane.engine.array_input.facts import page_key
from runplane.engine.errors import EngineError, RetiredError
from runplane.engine.values.keys import decode_key
from runplane.engine.ports import RECEIPTS_LANE, table
from runplane.engine.tenant import Tenant

from .array_model import ArrayModel, StoredFact
from .faults import ALL_FAULT_KINDS, FaultPlan, FaultyPort, fault_plans
from .harness import open_example_tenant, run_examples, unfired
from .report import SimulationReport

NAME = "seal_vs_retire"
EXAMPLE_TIMEOUT = 60.0
POLLS = 30  # sealers and readers poll while pages are still being staged
POLL_INTERVAL = 0.005
RUN = RunScope("org-sim", "play-sim", "run-sim")
SCOPE = RUN.map("companies", "map-sim")

Role = Literal["stager", "sealer", "reader", "retirer"]


@attrs.frozen
class Actor:
    name: str
    role: Role
    start_delay_ms: int
    attempts: int
    faults: FaultPlan
    batch_size: int = 4
    page_order: tuple[int, ...] = ()


@attrs.frozen
class Plan:
    page_count: int
    last_page_rows: int
    identities: bool
    actors: tuple[Actor, ...]
    tamper: tuple[int, int] | None  # (ordinal, delay ms)

    def source(self) -> list[A.Occurrence]:
        rows = (self.page_count - 1) * A.MAX_PAGE_ROWS + self.last_page_rows
        return [
            A.Occurrence({"i": i, "name": f"c{i}"},
                         A.SourceIdentity("ds", i) if self.identities and i % 3 else None)
            for i in range(rows)
        ]

    def describe(self) -> str:
        actors = ", ".join(
            f"{a.name}(delay={a.start_delay_ms}ms, attempts={a.attempts}, "
            f"faults={[f.kind for f in a.faults.steps if f.kind != 'none']}"
            + (f", batch={a.batch_size}" if a.role == "sealer" else "")
            + (f", pages={list(a.page_order)}" if a.role == "stager" else "") + ")"
            for a in self.actors
        )
        return f"pages={self.page_count} tamper={self.tamper} actors=[{actors}]"


@st.composite
def plans(draw) -> Plan:
    page_count = draw(st.integers(1, 9), label="page_count")
    last_rows = draw(st.integers(1, A.MAX_PAGE_ROWS), label="last_page_rows")
    identities = draw(st.booleans(), label="identities")
    counts = {
        "stager": draw(st.integers(1, 3)), "sealer": draw(st.integers(1, 3)),
        "reader": draw(st.integers(0, 2)), "retirer": draw(st.integers(0, 2)),
    }
    actors = []
    for role, count in counts.items():
        for n in range(count):
            if role == "stager":
                order = draw(st.permutations(range(page_count)))
                if n > 0:
                    order = order[: draw(st.integers(0, page_count))]
            else:
                order = []
            actors.append(Actor(
                name=f"{role}-{n}", role=role,
                start_delay_ms=draw(st.integers(0, 150 if role == "retirer" else 15)),
                attempts=draw(st.integers(1, 3)),
                faults=draw(fault_plans(max_steps=12, kinds=ALL_FAULT_KINDS)),
                batch_size=draw(st.sampled_from((1, 4, 8))) if role == "sealer" else 4,
                page_order=tuple(order),
            ))
    tamper = None
    if draw(st.integers(0, 9)) == 0:
        tamper = (draw(st.integers(0, page_count - 1)), draw(st.integers(0, 30)))
    return Plan(page_count, last_rows, identities, tuple(actors), tamper)


# -- one example -------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Example:
    tenant: Tenant
    plan: Plan
    model: ArrayModel
    faults: int = 0
    ports: dict = attrs.field(factory=dict)

    async def call(self, actor: Actor, port: FaultyPort, op: str, fn) -> tuple[str, object]:
        start = self.model.begin_call()
        outcome, value = "ok", None
        with port.cancellable() as scope:
            try:
                value = await fn()
            except EngineError as exc:
                outcome = type(exc).__name__
        if scope.cancelled_caught:
            outcome, value = "cancelled", None
        self.model.end_call(actor.name, op, start, outcome, value)
        return outcome, value

    async def retrying(self, actor, port, op, fn, *, retry_on=("StoreUnavailableError", "cancelled")):
        outcome, value = "unstarted", None
        for _ in range(actor.attempts):
            outcome, value = await self.call(actor, port, op, fn)
            if outcome not in retry_on:
                break
        return outcome, value

    async def act(self, actor: Actor) -> None:
        port = self.ports[actor.name] = FaultyPort(self.tenant, actor.faults)
        try:
            await trio.sleep(actor.start_delay_ms / 1000)
            await getattr(self, f"_{actor.role}")(actor, port)
        finally:
            self.faults += port.injected

    async def _stager(self, actor, port) -> None:
        m = self.model
        outcome, _ = await self.retrying(actor, port, "begin", lambda: A.begin(
            port, SCOPE, source_fingerprint=m.fingerprint, source_rows=m.source_rows,
            has_source_identities=m.has_source_identities))
        if outcome != "ok":
            return
        for ordinal in actor.page_order:
            draft = m.drafts[ordinal]
            outcome, _ = await self.retrying(actor, port, "put_page", lambda: A.put_page(
                port, SCOPE, source_fingerprint=m.fingerprint, ordinal=draft.ordinal,
                offset=draft.offset, rows=draft.rows))
            if outcome == "RetiredError":
                return

    async def _sealer(self, actor, port) -> None:
        m = self.model
        for _ in range(POLLS):
            outcome, _ = await self.call(actor, port, "seal", lambda: A.seal(
                port, SCOPE, source_fingerprint=m.fingerprint, source_rows=m.source_rows,
                page_count=m.page_count, batch_size=actor.batch_size))
            if outcome in ("ok", "RetiredError"):
                return
            await trio.sleep(POLL_INTERVAL)  # pages may still be arriving

    async def _reader(self, actor, port) -> None:
        for _ in range(POLLS):
            outcome, manifest = await self.call(actor, port, "get_manifest",
                                                lambda: A.get_manifest(port, SCOPE))
            if outcome == "ok" and manifest.state == "sealed":
                break
            if outcome == "RetiredError":
                return
            await trio.sleep(POLL_INTERVAL)
        else:
            return
        for ordinal in range(manifest.page_count):
            start = self.model.begin_call()
            outcome, value = "ok", None
            with port.cancellable() as scope:
                try:
                    value = (ordinal, await A.read_page(port, SCOPE, ordinal))
                except EngineError as exc:
                    outcome = type(exc).__name__
            if scope.cancelled_caught:
                outcome, value = "cancelled", None
            self.model.end_call(actor.name, "read_page", start, outcome, value)
            if outcome == "RetiredError":
                return

    async def _retirer(self, actor, port) -> None:
        for _ in range(200):  # a few batches per source; faults cost retries
            outcome, result = await self.call(actor, port, "retire", lambda: A.retire(port, RUN))
            if outcome == "ok" and result.done:
                return
            if outcome not in ("ok", "StoreUnavailableError", "cancelled"):
                return

    async def tamper(self, ordinal: int, delay_ms: int) -> None:
        await trio.sleep(delay_ms / 1000)
        async with self.tenant.connection(RECEIPTS_LANE) as conn:
            status = await conn.execute(
                f"UPDATE {table(self.tenant, 'work_receipts')} "
                "SET output = jsonb_set(output, '{rows,0,data,name}', '\"tampered\"'::jsonb) "
                "WHERE k = $1",
                page_key(SCOPE, ordinal),
            )
        if status == "UPDATE 1":
            self.model.record_tamper(ordinal)


async def _stored_facts(tenant) -> list[StoredFact]:
    async with tenant.connection(RECEIPTS_LANE) as conn:
        rows = await conn.fetch(
            f"SELECT k, output::text AS output FROM {table(tenant, 'work_receipts')} "
            "WHERE run_id = $1 ORDER BY k", RUN.run_id,
        )
    facts = []
    for row in rows:
        key = decode_key(bytes(row["k"]))
        ordinal = key[6] if key[2] == "array_input_page" and len(key) > 6 else None
        facts.append(StoredFact(key[2], ordinal, json.loads(row["output"])))
    return facts


async def _probe_after_retirement(tenant, model: ArrayModel) -> list[str]:
    """Once retirement is done, every kind of call must raise `RetiredError`."""
    draft = model.drafts[0]
    probes = {
        "get_manifest": lambda: A.get_manifest(tenant, SCOPE),
        "begin": lambda: A.begin(tenant, SCOPE, source_fingerprint=model.fingerprint,
                                 source_rows=model.source_rows,
                                 has_source_identities=model.has_source_identities),
        "put_page": lambda: A.put_page(tenant, SCOPE, source_fingerprint=model.fingerprint,
                                       ordinal=0, offset=0, rows=draft.rows),
        "seal": lambda: A.seal(tenant, SCOPE, source_fingerprint=model.fingerprint,
                               source_rows=model.source_rows, page_count=model.page_count),
        "read_page": lambda: A.read_page(tenant, SCOPE, 0),
    }
    out = []
    for name, probe in probes.items():
        try:
            await probe()
            out.append(f"after retirement, {name} succeeded")
        except RetiredError:
            pass
        except EngineError as exc:
            out.append(f"after retirement, {name} raised {type(exc).__name__}: {exc}")
    return out


async def run_example(dsn: str, plan: Plan) -> tuple[list[str], int]:
    """Run one drawn plan on a fresh schema; return (violations, faults injected)."""
    model = ArrayModel(plan.source())
    async with open_example_tenant(RUN.org_id, dsn) as tenant:
        example = _Example(tenant, plan, model)
        try:
            with trio.fail_after(EXAMPLE_TIMEOUT):
                async with trio.open_nursery() as nursery:
                    for actor in plan.actors:
                        nursery.start_soon(example.act, actor)
                    if plan.tamper is not None:
                        nursery.start_soon(example.tamper, *plan.tamper)
        except trio.TooSlowError:
            return [f"a call hung: the example did not finish within {EXAMPLE_TIMEOUT}s"], \
                example.faults
        violations = model.check(await _stored_facts(tenant)) + unfired(example.ports)
        if model.retired_done_at() is not None:
            violations += await _probe_after_retirement(tenant, model)
        return violations, example.faults


# Failing schedules found, `(plan, scheduler seed)`: each runs first in every run
# (docs/guide/testing.md, "Simulations"). Paste the "minimal failing schedule" a failed run prints.
REGRESSIONS: list[tuple[Plan, int]] = []


def run(examples: int, seed: int | None, dsn: str | None = None) -> SimulationReport:
    """Run `examples` hypothesis examples of the scenario; collect what they violate."""
    return run_examples(NAME, plans(), run_example, examples=examples, seed=seed, dsn=dsn,
                        regressions=REGRESSIONS)
