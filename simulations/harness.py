"""What every scenario does the same way: a fresh schema per example, N hypothesis examples.

How it works
- `open_example_tenant(org_id, dsn)` opens a tenant on a fresh schema `sim_<16 hex>` for one
  example and, however the example ends, drops that schema (CASCADE) before the tenant closes,
  so examples never see each other's rows and a long run leaves nothing behind.
- `run_examples(name, plans, run_example, examples=, seed=, dsn=)` lets hypothesis draw
  `examples` plans from the `plans` strategy (no example database, no deadline, every health
  check suppressed: an example is a whole concurrent run against a real server) and runs each
  in its own `trio.run(run_example, dsn, plan)`, so trio's scheduler is seeded by hypothesis.
  `run_example` returns `(violations, faults injected)` — a count, or a mapping of counts by
  kind of fault, which the report also keeps by kind; they are tallied into the scenario's
  `SimulationReport`, each violation as `example {n}: {violation} [{plan.describe()}]`, rather
  than raised, so one run reports every broken example. A `seed` makes the draws reproducible.
- Scenarios call both from their own `run_example` and `run(examples, seed, dsn=None)`; the
  tests call a scenario's `run_example` directly to replay a pinned plan.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import AsyncIterator, Awaitable, Callable, Mapping, Protocol, TypeVar

import trio
from hypothesis import HealthCheck, given, seed as hypothesis_seed, settings, strategies as st

from runplane.engine import Tenant, open_tenant
from runplane.engine.ports import SHEET_LANE
from runplane.engine.sql import quote_ident

from . import resolve_dsn
from .report import SimulationReport


class DescribedPlan(Protocol):
    """A drawn plan: `describe()` names what was drawn, so a violation can be reproduced."""

    def describe(self) -> str: ...


P = TypeVar("P", bound=DescribedPlan)
RunExample = Callable[[str, P], Awaitable[tuple[list[str], "int | Mapping[str, int]"]]]


@contextlib.asynccontextmanager
async def open_example_tenant(org_id: str, dsn: str) -> AsyncIterator[Tenant]:
    """A tenant of `org_id` on a fresh schema, dropped when the block exits."""
    schema = f"sim_{uuid.uuid4().hex[:16]}"
    async with open_tenant(org_id, dsn, schema=schema) as tenant:
        try:
            yield tenant
        finally:
            async with tenant.connection(SHEET_LANE) as conn:
                await conn.execute(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE")


def run_examples(
    name: str,
    plans: st.SearchStrategy[P],
    run_example: RunExample[P],
    *,
    examples: int,
    seed: int | None,
    dsn: str | None,
) -> SimulationReport:
    """Run `examples` hypothesis examples of `plans` through `run_example`; report what they
    violate and how many faults they injected."""
    dsn = resolve_dsn(dsn)
    report = SimulationReport(name)

    @settings(max_examples=examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(plan=plans)
    def example(plan: P) -> None:
        violations, faults = trio.run(run_example, dsn, plan)
        report.examples += 1
        if isinstance(faults, Mapping):
            report.fault_counts.update(faults)
            faults = sum(faults.values())
        report.faults += faults
        report.violations.extend(
            f"example {report.examples}: {violation} [{plan.describe()}]" for violation in violations
        )

    if seed is not None:
        example = hypothesis_seed(seed)(example)
    example()
    return report
