"""Scenario `gateway`: a run through a gateway over a faulty network applies everything once.

How it works
- Every example starts its own gateway server (over a fresh schema of a real PostgreSQL), puts
  a `FaultyProxy` (`simulations.network`) between it and a gateway client, and runs a play
  through the client: a map over a list (staged as an array input, then admitted and completed),
  a stage of another array (read back page by page) and a few work-receipt calls.
- Hypothesis draws the network faults of the first requests: refused connects and resets before
  the request (no answer), replies lost after the server committed, delays, and bursts of 503s
  (never more in a plan than the client's answered ladder, so every call must succeed). The client
  retries under a fast `RetryPolicy`.
- Invariants, against a pure model of what the direct calls answer: the map's counts; every
  row's function ran exactly once (a lost admission reply must not hand rows out twice) and the
  sheet holds each row's outcome; the counters equal a COUNT over the sheet; the staged pages
  read back equal the input; each receipt call answers what the direct call would have (a
  retried claim is still `claimed`, not `running`); the run is retired. Any exception is a
  violation: every fault drawn stays within the documented budgets. Every fault drawn must have
  fired (the plan was consumed by real requests).
"""

from __future__ import annotations

import collections
import attrs
import trio
from hypothesis import strategies as st

from runplane.actors import open_run
from runplane.engine import PlayScope, sheets
from runplane.engine.array_input import Occurrence
from runplane.engine.gateway import (Gateway, RetryPolicy, mint_token, open_gateway,
                                     open_server)
from runplane.engine.ports import RECEIPTS_LANE
from runplane.engine.tenant import Tenant

from .counters import counters_match
from .harness import open_example_tenant, run_examples
from .network import open_proxy
from .report import SimulationReport

NAME = "gateway"
EXAMPLE_TIMEOUT = 120.0
ORG, PLAY = "org-sim", "play-gw"
SECRET = "simulation-gateway-secret-" + "z" * 20
CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("upper",))
POLICY = RetryPolicy(answered_delays_s=(0.005,) * 8, unreachable_budget_s=60.0,
                     request_timeout_s=30.0, completion_total_s=120.0, min_answered_wait_s=0.0)
MAX_BURST = len(POLICY.answered_delays_s)


@attrs.frozen
class Plan:
    rows: int
    staged: int
    faults: tuple[str, ...]

    def describe(self) -> str:
        return f"rows={self.rows} staged={self.staged} faults={list(self.faults)}"


@st.composite
def plans(draw) -> Plan:
    single = st.sampled_from(["pass", "pass", "refuse", "reset", "drop_reply", "delay"])
    faults: list[str] = []
    # Requests run concurrently, so 503s drawn apart may still meet one operation: all the 503s
    # of a plan together stay within one operation's answered ladder.
    left_503 = MAX_BURST
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.one_of(single, st.just("503")) if left_503 else single)
        if kind == "delay":
            faults.append(f"delay:{draw(st.sampled_from([0.001, 0.02, 0.1]))}")
        elif kind == "503":
            count = draw(st.integers(1, left_503))
            faults.extend(["503"] * count)
            left_503 -= count
        else:
            faults.append(kind)
    return Plan(draw(st.integers(1, 60)), draw(st.integers(1, 1500)), tuple(faults))


def fails(row: dict) -> bool:
    return row["n"] % 5 == 2


async def run_example(dsn: str, plan: Plan) -> tuple[list[str], collections.Counter]:
    violations: list[str] = []
    drawn = collections.Counter(fault.partition(":")[0] for fault in plan.faults if fault != "pass")
    fired: collections.Counter = collections.Counter()
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with open_example_tenant(ORG, dsn) as tenant:
            async with open_server(secret=SECRET, dsn=dsn, schema=tenant.schema) as server:
                async with open_proxy(server.url) as proxy:
                    proxy.plan.extend(plan.faults)
                    try:
                        async with open_gateway(proxy.url, mint_token(SECRET, ORG),
                                                retry=POLICY) as gateway:
                            await _play(gateway, plan, violations)
                    except Exception as exc:  # any error is a violation here
                        violations.append(f"raised {type(exc).__name__}: {exc}")
                    fired.update(proxy.fired)
                    if proxy.plan:
                        violations.append(f"{len(proxy.plan)} drawn faults never met a request")
            if not violations:
                await _check_store(tenant, plan, violations)
    if +fired != +drawn and not violations:
        violations.append(f"faults fired {dict(fired)} != drawn {dict(drawn)}")
    return violations, fired


async def _play(gateway: Gateway, plan: Plan, violations: list[str]) -> None:
    calls: collections.Counter = collections.Counter()

    async def upper(row: dict) -> dict:
        calls[row["name"]] += 1
        if fails(row):
            raise ValueError(f"row {row['n']} fails")
        return {"upper": row["name"].upper()}

    rows = [{"name": f"row-{i}", "n": i} for i in range(plan.rows)]
    occurrences = [Occurrence({"i": i}) for i in range(plan.staged)]
    async with open_run(gateway, PLAY, "run-1") as run:
        result = await run.map("things", rows, upper, contract=CONTRACT, concurrency=4)
        staged = await run.stage_array("staged", "m", occurrences)
        read = [occurrence async for page in staged.pages() for occurrence in page.rows]
        claim = await run.claim("k")
        again = await run.claim("k")
        done = await run.complete("k", {"v": 1})
        late = await run.fail("k", "late")
    failing = sum(1 for row in rows if fails(row))
    expected = (plan.rows, 0, plan.rows - failing, failing)
    got = (result.admitted, result.cached, result.completed, result.failed)
    if got != expected:
        violations.append(f"map counts {got} != {expected}")
    twice = sorted(name for name, count in calls.items() if count != 1)
    if twice or len(calls) != plan.rows:
        violations.append(f"rows not run exactly once: {twice[:5]} ({len(calls)} of {plan.rows})")
    if read != occurrences:
        violations.append("staged pages read back differ from the input")
    answers = (claim.disposition, again.disposition, done.status, done.output, late.status)
    if answers != ("claimed", "running", "completed", {"v": 1}, "completed"):
        violations.append(f"receipt answers {answers}")


async def _check_store(tenant: Tenant, plan: Plan, violations: list[str]) -> None:
    scope = PlayScope(ORG, PLAY)
    summary = await sheets.summary(tenant, scope, "things")
    failing = sum(1 for i in range(plan.rows) if i % 5 == 2)
    if (summary.total, summary.completed, summary.failed) != (plan.rows, plan.rows - failing, failing):
        violations.append(f"sheet summary {summary}")
    ok, why = await counters_match(tenant, scope, "things")
    if not ok:
        violations.append(why)
    async with tenant.connection(RECEIPTS_LANE) as conn:
        left = await conn.fetchval(
            f'SELECT count(*) FROM "{tenant.schema}".work_receipts '
            "WHERE output->>'kind' IN ('array_input_begin', 'array_input_page', 'array_input_seal')")
    if left:
        violations.append(f"{left} array-input facts left after the run retired")


# Failing schedules found, `(plan, scheduler seed)`: each runs first in every run
# (docs/guide/testing.md, "Simulations"). Paste the "minimal failing schedule" a failed run prints.
REGRESSIONS: list[tuple[Plan, int]] = []


def run(examples: int, seed: int | None, dsn: str | None = None) -> SimulationReport:
    """Run `examples` hypothesis examples of the scenario; collect what they violate."""
    return run_examples(NAME, plans(), run_example, examples=examples, seed=seed, dsn=dsn,
                        regressions=REGRESSIONS)
