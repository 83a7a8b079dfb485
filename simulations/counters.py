"""Scenario `counters`: concurrent admitters and completers on one sheet; counters stay exact.

How it works
- Hypothesis draws a `Plan`: a few runs, and actors — admitters (plain or under an attempt
  whose lease is live or already expired) and completers (completed and failed outcomes, cell
  meta marking cells failed, fields outside the contract that extend the sheet, keys that do not
  exist) — each with its own batches, start delay and `FaultPlan` (delays, checkpoints,
  transient store errors, cancellations at checkouts and statements). Every example runs in its
  own `trio.run`, on its own tenant and fresh schema, bounded by `trio.fail_after`.
- While the actors run, a watcher repeatedly compares the counters with a COUNT over the sheet
  in one statement (one snapshot): since counters change in the same transaction as the rows,
  every snapshot must agree. After the actors finish, the comparison is made once more.
- `snapshot_counts` and `counters_match` are shared with the `fencing` scenario and the tests.
"""

from __future__ import annotations

import attrs
import trio
from hypothesis import strategies as st

from runplane.engine import PlayScope, RunScope, runs
from runplane.engine.canonical import JsonObject
from runplane.engine.errors import EngineError
from runplane.engine.ports import SHEET_LANE
from runplane.engine.sheets import Attempt, RowOutcome, SheetContract, admit, complete, row_key
from runplane.engine.sheets.counters import column_source, summary_source
from runplane.engine.sheets.layout import layout_for

from .faults import FaultPlan, FaultyPort, fault_plans
from .harness import open_example_tenant, run_examples, unfired
from .report import SimulationReport

NAME = "counters"
EXAMPLE_TIMEOUT = 60.0
ORG, PLAY, NS = "org-sim", "play-sim", "Counters"
CONTRACT = SheetContract(inputs=("name",), outputs=("score", "tag"))

_SNAPSHOT = """
SELECT (SELECT to_jsonb(x) FROM (
            SELECT count(*) AS total,
                   count(*) FILTER (WHERE _status = 'pending') AS queued,
                   count(*) FILTER (WHERE _status = 'running') AS running,
                   count(*) FILTER (WHERE _status = 'enriched') AS completed,
                   count(*) FILTER (WHERE _status = 'failed') AS failed
              FROM {sheet}) AS x)::text AS fresh,
       (SELECT coalesce(jsonb_object_agg(field, jsonb_build_array(completed, failed)), '{{}}')
          FROM (SELECT e.key AS field,
                       count(*) FILTER (WHERE e.value ->> 'status' = 'completed') AS completed,
                       count(*) FILTER (WHERE e.value ->> 'status' = 'failed') AS failed
                  FROM {sheet} AS s, jsonb_each(s._cell_meta) AS e
                 GROUP BY e.key) AS c)::text AS fresh_columns,
       (SELECT to_jsonb(y) FROM (
            SELECT total, queued, running, completed, failed FROM {summary} AS s
             WHERE org_id = $1 AND play = $2 AND table_namespace = $3) AS y)::text AS stored,
       (SELECT coalesce(jsonb_object_agg(field, jsonb_build_array(completed, failed)), '{{}}')
          FROM {column_summary} AS c
         WHERE org_id = $1 AND play = $2 AND table_namespace = $3)::text AS stored_columns
"""

_ZERO = {"total": 0, "queued": 0, "running": 0, "completed": 0, "failed": 0}


async def snapshot_counts(port, scope: PlayScope, namespace: str) -> tuple[dict, dict, dict, dict]:
    """(COUNT over the sheet, per-field COUNT, stored counters, stored per-field counters),
    all from one snapshot. A missing sheet or counter row reads as zeros."""
    import json

    layout = layout_for(port, scope, namespace)
    async with port.connection(SHEET_LANE) as conn:
        present = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", layout.qualified)
        if not present:
            return dict(_ZERO), {}, dict(_ZERO), {}
        row = await conn.fetchrow(
            _SNAPSHOT.format(
                sheet=layout.qualified, summary=summary_source(port),
                column_summary=column_source(port),
            ),
            *layout.counter_args,
        )
    fresh = json.loads(row["fresh"])
    stored = json.loads(row["stored"]) if row["stored"] else dict(_ZERO)
    fresh_columns = {k: tuple(v) for k, v in json.loads(row["fresh_columns"]).items()}
    stored_columns = {k: tuple(v) for k, v in json.loads(row["stored_columns"]).items()}
    fields = set(fresh_columns) | set(stored_columns)
    return (
        fresh,
        {f: fresh_columns.get(f, (0, 0)) for f in fields},
        stored,
        {f: stored_columns.get(f, (0, 0)) for f in fields},
    )


async def counters_match(port, scope: PlayScope, namespace: str) -> tuple[bool, str]:
    fresh, fresh_columns, stored, stored_columns = await snapshot_counts(port, scope, namespace)
    if fresh != stored or fresh_columns != stored_columns:
        return False, (
            f"counters {stored} {stored_columns} != COUNT {fresh} {fresh_columns}"
        )
    return True, ""


# -- the scenario ------------------------------------------------------------------------------


@attrs.frozen
class Batch:
    rows: tuple[int, ...]
    failed: tuple[bool, ...] = ()
    meta_failed: tuple[bool, ...] = ()
    extra_field: bool = False
    ghost: bool = False


@attrs.frozen
class Actor:
    name: str
    role: str  # admitter | completer
    run: int
    attempt: tuple[int, float] | None  # (seq, lease_s)
    start_delay_ms: int
    batches: tuple[Batch, ...]
    faults: FaultPlan


@attrs.frozen
class Plan:
    rows: int
    runs: int
    actors: tuple[Actor, ...]

    def describe(self) -> str:
        return f"rows={self.rows} runs={self.runs} actors=" + ", ".join(
            f"{a.name}(run={a.run}, attempt={a.attempt}, batches={len(a.batches)}, "
            f"faults={[f.kind for f in a.faults.steps if f.kind != 'none']})"
            for a in self.actors
        )


@st.composite
def plans(draw) -> Plan:
    n = draw(st.integers(5, 60), label="rows")
    run_count = draw(st.sampled_from((1, 1, 2, 3)), label="runs")
    actors = []
    for i in range(draw(st.integers(2, 6), label="actors")):
        role = "admitter" if i == 0 else draw(st.sampled_from(("admitter", "completer")))
        batches = []
        for _ in range(draw(st.integers(1, 4))):
            rows = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n)))
            batches.append(Batch(
                rows=rows,
                failed=tuple(draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))),
                meta_failed=tuple(draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))),
                extra_field=draw(st.booleans()),
                ghost=draw(st.integers(0, 4)) == 0,
            ))
        attempt = None
        if draw(st.booleans()):
            attempt = (i, draw(st.sampled_from((0.0, 0.0, 300.0))))
        actors.append(Actor(
            name=f"{role}-{i}", role=role, run=draw(st.integers(0, run_count - 1)),
            attempt=attempt, start_delay_ms=draw(st.integers(0, 10)),
            batches=tuple(batches) * draw(st.integers(1, 3)),  # later rounds revisit rows
            faults=draw(fault_plans(max_steps=10)),
        ))
    return Plan(n, run_count, tuple(actors))


def _row(i: int) -> dict:
    return {"name": f"row-{i}"}


async def _act(tenant, actor: Actor, run_refs, stats: dict) -> None:
    port = stats["ports"][actor.name] = FaultyPort(tenant, actor.faults)
    attempt = None
    if actor.attempt is not None:
        attempt = Attempt(f"{actor.name}-attempt", actor.attempt[0], lease_s=actor.attempt[1])
    run = run_refs[actor.run]
    try:
        await trio.sleep(actor.start_delay_ms / 1000)
        for n, batch in enumerate(actor.batches):
            if actor.role == "admitter":
                call = admit(port, run, NS, CONTRACT, [_row(i) for i in batch.rows], attempt=attempt)
            else:
                outcomes = []
                for i, failed, meta_failed in zip(batch.rows, batch.failed, batch.meta_failed):
                    key = row_key(_row(i), NS) if not batch.ghost else f"ghost-{i}"
                    meta = {"tag": {"status": "failed"}} if meta_failed else None
                    data: JsonObject = {"score": i * 10 + n}
                    if not failed:
                        data["tag"] = f"{actor.name}:{n}"
                    if batch.extra_field:
                        data["extra"] = [n]
                    outcomes.append(RowOutcome(
                        key, "failed" if failed else "completed", data, cell_meta=meta,
                        error=f"{actor.name}:{n}" if failed else None,
                    ))
                call = complete(port, run, NS, CONTRACT, outcomes, attempt=attempt)
            with port.cancellable():
                try:
                    await call
                except EngineError:
                    stats["errors"] += 1
    finally:
        stats["faults"] += port.injected


async def _watch(tenant, done: trio.Event, violations: list[str]) -> None:
    scope = PlayScope(ORG, PLAY)
    while not done.is_set():
        ok, detail = await counters_match(tenant, scope, NS)
        if not ok:
            violations.append(f"mid-run snapshot: {detail}")
            return
        await trio.sleep(0.002)


async def run_example(dsn: str, plan: Plan) -> tuple[list[str], int]:
    violations: list[str] = []
    stats: JsonObject = {"faults": 0, "errors": 0, "ports": {}}
    async with open_example_tenant(ORG, dsn) as tenant:
        run_refs = [
            await runs.register(tenant, RunScope(ORG, PLAY, f"run-{i}"))
            for i in range(plan.runs)
        ]
        done = trio.Event()
        try:
            with trio.fail_after(EXAMPLE_TIMEOUT):
                async with trio.open_nursery() as outer:
                    outer.start_soon(_watch, tenant, done, violations)
                    async with trio.open_nursery() as nursery:
                        for actor in plan.actors:
                            nursery.start_soon(_act, tenant, actor, run_refs, stats)
                    done.set()
        except trio.TooSlowError:
            return [f"the example did not finish within {EXAMPLE_TIMEOUT}s"], stats["faults"]
        ok, detail = await counters_match(tenant, PlayScope(ORG, PLAY), NS)
        if not ok:
            violations.append(f"after the run: {detail}")
        violations += unfired(stats["ports"])
        return violations, stats["faults"]


# Failing schedules found, `(plan, scheduler seed)`: each runs first in every run
# (docs/guide/testing.md, "Simulations"). Paste the "minimal failing schedule" a failed run prints.
REGRESSIONS: list[tuple[Plan, int]] = []


def run(examples: int, seed: int | None, dsn: str | None = None) -> SimulationReport:
    """Run `examples` hypothesis examples of the scenario; collect what they violate."""
    return run_examples(NAME, plans(), run_example, examples=examples, seed=seed, dsn=dsn,
                        regressions=REGRESSIONS)
