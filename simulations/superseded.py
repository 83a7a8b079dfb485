"""Scenario `superseded`: overlapping maps of several runs of one play over the same rows.

How it works
- Hypothesis draws a `Plan`: 80–300 rows and 2–3 runs registered in order (later runs have
  larger epochs). Each run maps every row with `run.map` under drawn timing: a start delay,
  `concurrency`, a per-call latency, page and completion-batch sizes, a linger, and rows whose
  first calls fail (retried under a drawn `RowRetry`); older runs may run as a scheduler
  attempt whose lease is live or already expired. The newest run always retries enough to
  complete every row. Each run's function writes its run's tag, so a stored row names the run
  that wrote it.
- All maps run at once in one `trio.run` on a fresh schema (trio's scheduler is seeded by
  hypothesis), bounded by `trio.fail_after`.
- Invariants: every row ends holding the newest run's outcome: enriched, either written by the
  newest run (its epoch and tag; as many as its result says it completed) or found cached by
  it (an older run finished the row first; as many as it reports cached); the newest map is never superseded; a map that saw a completion
  fenced as `stale_write_version` reports `superseded` and started at most
  `concurrency + MAX_WORK_BATCH` calls after that completion came back (and it stops for good:
  `calls_after` is counted until the map returns); the counters equal a COUNT over the sheet.
- Faults reported: maps superseded and calls retried, by kind (whether drawn timing supersedes
  a run varies; `tests/test_superseded_simulation.py` forces one with a fixed plan).
"""

from __future__ import annotations

import attrs
import trio
from hypothesis import strategies as st

from runplane.actors import RowRetry, open_run
from runplane.actors.admission import MAX_WORK_BATCH
from runplane.engine import PlayScope, RunScope, canonical, runs
from runplane.engine.sheets import Attempt, RowStatus, SheetContract
from runplane.engine.sheets.layout import column, layout_for

from .counters import counters_match
from .harness import open_example_tenant, run_examples

NAME = "superseded"
EXAMPLE_TIMEOUT = 120.0
ORG, PLAY, NS = "org-sim", "play-sim", "Superseded"
CONTRACT = SheetContract(inputs=("name",), outputs=("score",))


class Flaky(Exception):
    """A drawn transient failure of the map function."""


@attrs.frozen
class MapPlan:
    run: int
    start_delay_ms: int
    concurrency: int
    latency_ms: int
    page_rows: int
    batch_rows: int
    linger_ms: int
    flaky: frozenset[int]        # rows whose first call fails
    max_attempts: int
    attempt_lease_s: float | None  # an older run's map may be a scheduler attempt


@attrs.frozen
class Plan:
    rows: int
    maps: tuple[MapPlan, ...]

    def describe(self) -> str:
        return f"rows={self.rows} maps=" + ", ".join(
            f"run{m.run}(delay={m.start_delay_ms}ms, c={m.concurrency}, "
            f"latency={m.latency_ms}ms, page={m.page_rows}, batch={m.batch_rows}, "
            f"linger={m.linger_ms}ms, flaky={sorted(m.flaky)}, attempts={m.max_attempts}, "
            f"lease={m.attempt_lease_s})"
            for m in self.maps
        )


@st.composite
def plans(draw) -> Plan:
    n = draw(st.integers(80, 300), label="rows")
    run_count = draw(st.integers(2, 3), label="runs")
    maps = []
    for run in range(run_count):
        newest = run == run_count - 1
        flaky = frozenset(draw(st.lists(st.integers(0, n - 1), max_size=6)))
        maps.append(MapPlan(
            run=run,
            start_delay_ms=draw(st.integers(0, 30)),
            concurrency=draw(st.integers(1, 6)),
            latency_ms=draw(st.sampled_from((0, 0, 1, 2))),
            page_rows=draw(st.sampled_from((5, 20, 50, 100))),
            batch_rows=draw(st.sampled_from((1, 4, 16, 5000))),
            linger_ms=draw(st.sampled_from((0, 1, 5, 50))),
            flaky=flaky,
            max_attempts=2 if newest else draw(st.integers(1, 3)),
            attempt_lease_s=None if newest else draw(st.sampled_from((None, 0.0, 300.0))),
        ))
    return Plan(n, tuple(maps))


def _rows(n: int) -> list[dict]:
    return [{"name": f"row-{i}"} for i in range(n)]


@attrs.define(eq=False)
class _MapWatch:
    """Calls of one map's function, and how many started after its first fenced completion."""

    calls: int = 0
    retried: int = 0
    fenced_at: int | None = None

    def on_progress(self, snapshot) -> None:
        if snapshot.superseded and self.fenced_at is None:
            self.fenced_at = self.calls


@attrs.define(eq=False)
class _Gate:
    """Forces an order no timing guarantees: the newest run starts once an older run has made
    `older_calls` calls, and older runs' later calls wait until the newest map has returned."""

    older_calls: int
    older_started: trio.Event = attrs.Factory(trio.Event)
    newest_done: trio.Event = attrs.Factory(trio.Event)


async def _run_map(tenant, plan: Plan, spec: MapPlan, run_id: str, watch: _MapWatch, results,
                   gate: _Gate | None = None):
    tag = f"run-{spec.run}"
    seen: set[int] = set()
    newest = spec.run == len(plan.maps) - 1

    async def fn(row: dict) -> dict:
        watch.calls += 1
        i = int(row["name"].rsplit("-", 1)[1])
        if gate is not None and not newest and watch.calls >= gate.older_calls:
            gate.older_started.set()
            if watch.calls > gate.older_calls:
                await gate.newest_done.wait()
        if spec.latency_ms:
            await trio.sleep(spec.latency_ms / 1000)
        else:
            await trio.lowlevel.checkpoint()
        if i in spec.flaky and i not in seen:
            seen.add(i)
            raise Flaky(f"{tag}: first call of row {i}")
        return {"score": tag}

    attempt = (Attempt(f"{run_id}-a", 1, lease_s=spec.attempt_lease_s)
               if spec.attempt_lease_s is not None else None)
    await trio.sleep(spec.start_delay_ms / 1000)
    if gate is not None and newest:
        await gate.older_started.wait()
    async with open_run(tenant, PLAY, run_id, attempt=attempt, retire_on_exit=False) as run:
        results[spec.run] = await run.map(
            NS, _rows(plan.rows), fn, contract=CONTRACT, concurrency=spec.concurrency,
            retry=RowRetry(max_attempts=spec.max_attempts, initial_s=0.002),
            page_rows=spec.page_rows, batch_rows=spec.batch_rows,
            linger_s=spec.linger_ms / 1000, on_progress=watch.on_progress,
        )
    if gate is not None and newest:
        gate.newest_done.set()


async def _stored(tenant) -> dict[str, tuple]:
    layout = layout_for(tenant, PlayScope(ORG, PLAY), NS)
    async with tenant.connection("sheet") as conn:
        records = await conn.fetch(
            f"SELECT _key, _status, _write_version, {column('score')}::text AS score"
            f" FROM {layout.qualified}")
    return {r["_key"]: (r["_status"], r["_write_version"], canonical.loads(r["score"]))
            for r in records}


async def run_example(dsn: str, plan: Plan, *, hold_older_after: int | None = None,
                      ) -> tuple[list[str], dict[str, int]]:
    """Run one plan and check its invariants. `hold_older_after=k` starts the newest run once an
    older run has made k calls and holds older runs' later calls until the newest map has
    returned, so they are overtaken mid-map whatever the machine's speed (drawn examples leave
    that to timing)."""
    violations: list[str] = []
    gate = _Gate(hold_older_after) if hold_older_after is not None else None
    async with open_example_tenant(ORG, dsn) as tenant:
        refs = [await runs.register(tenant, RunScope(ORG, PLAY, f"run-{spec.run}"))
                for spec in plan.maps]
        watches = [_MapWatch() for _ in plan.maps]
        results: dict[int, object] = {}
        try:
            with trio.fail_after(EXAMPLE_TIMEOUT):
                async with trio.open_nursery() as nursery:
                    for spec, ref, watch in zip(plan.maps, refs, watches):
                        nursery.start_soon(_run_map, tenant, plan, spec, ref.run_id, watch,
                                           results, gate)
        except trio.TooSlowError:
            return [f"the example did not finish within {EXAMPLE_TIMEOUT}s"], {}
        newest = len(plan.maps) - 1
        stored = await _stored(tenant)
        if len(stored) != plan.rows:
            violations.append(f"{len(stored)} rows stored, expected {plan.rows}")
        # The newest run's outcome of a row is what it wrote, or the enriched row it found
        # cached when it admitted it (an older run finished the row first).
        mine = (RowStatus.ENRICHED, refs[newest].epoch, f"run-{newest}")
        written = sum(1 for row in stored.values() if row == mine)
        cached = {key: row for key, row in stored.items() if row != mine}
        final = results[newest]
        if any(row[0] != RowStatus.ENRICHED or row[2] is None for row in cached.values()):
            violations.append(f"rows neither written nor cached by the newest run: "
                              f"{[r for r in cached.values() if r[0] != RowStatus.ENRICHED][:3]}")
        if (written, len(cached), final.blocked) != (final.completed, final.cached, 0):
            violations.append(
                f"the newest run wrote {written} rows and found {len(cached)} cached, but "
                f"reports completed={final.completed} cached={final.cached} "
                f"blocked={final.blocked}")
        for spec, watch in zip(plan.maps, watches):
            result = results[spec.run]
            if result.superseded != (watch.fenced_at is not None):
                violations.append(f"run-{spec.run}: superseded={result.superseded} but "
                                  f"fenced_at={watch.fenced_at}")
            if spec.run == newest and result.superseded:
                violations.append("the newest run's map was superseded")
            if watch.fenced_at is not None:
                after = watch.calls - watch.fenced_at
                if after > spec.concurrency + MAX_WORK_BATCH:
                    violations.append(f"run-{spec.run}: {after} calls after its first fenced "
                                      f"completion (bound {spec.concurrency + MAX_WORK_BATCH})")
            watch.retried = result.retried
        ok, detail = await counters_match(tenant, PlayScope(ORG, PLAY), NS)
        if not ok:
            violations.append(detail)
    faults = {"superseded": sum(1 for w in watches if w.fenced_at is not None),
              "retried": sum(w.retried for w in watches)}
    return violations, faults


# Failing schedules found, `(plan, scheduler seed)`: each runs first in every run
# (docs/guide/testing.md, "Simulations"). Paste the "minimal failing schedule" a failed run prints.
REGRESSIONS: list[tuple[Plan, int]] = []


def run(examples: int, seed: int | None, dsn: str | None = None):
    """Run `examples` hypothesis examples of the scenario; collect what they violate."""
    return run_examples(NAME, plans(), run_example, examples=examples, seed=seed, dsn=dsn,
                        regressions=REGRESSIONS)
