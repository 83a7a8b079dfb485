"""Property-tested race simulations against a real PostgreSQL.

A scenario draws operations, faults and interleavings with hypothesis, runs them against a real
tenant through a fault-injecting port, and checks invariants against a pure model after every
example. Scenarios are modules of this package listed in `SCENARIOS`; each exposes
`run(examples, seed, dsn=None) -> SimulationReport`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

from .report import SimulationReport

# name -> module; a scenario is listed once its module exists.
SCENARIOS: dict[str, str] = {}


def _register_available() -> None:
    for name in ("seal_vs_retire", "fencing", "counters", "crash_and_wake", "gateway",
                 "fast_admission", "superseded", "crash_anywhere", "shared_map", "routing"):
        if importlib.util.find_spec(f"runplane.simulations.{name}") is not None:
            SCENARIOS[name] = f"runplane.simulations.{name}"


_register_available()


def resolve_dsn(dsn: str | None = None) -> str:
    """The DSN a simulation runs against: given, `RUNPLANE_TEST_DSN`, else a throwaway server."""
    if dsn:
        return dsn
    if os.environ.get("RUNPLANE_TEST_DSN"):
        return os.environ["RUNPLANE_TEST_DSN"]
    from runplane.engine.embedded import start_embedded

    return start_embedded(Path(tempfile.mkdtemp(prefix="runplane-sim-")) / "pg", temporary=True)


def run_scenario(name: str, *, examples: int | None, seed: int | None,
                 dsn: str | None = None) -> SimulationReport:
    """Run scenario `name`; `examples` None: the scenario's `DEFAULT_EXAMPLES`, else 100."""
    module = importlib.import_module(SCENARIOS[name])
    if examples is None:
        examples = getattr(module, "DEFAULT_EXAMPLES", 100)
    return module.run(examples=examples, seed=seed, dsn=resolve_dsn(dsn))
