"""What a simulation run reports: examples run, faults injected, invariant violations."""

from __future__ import annotations

import collections

import attrs


@attrs.define(eq=False)
class SimulationReport:
    """Mutable tally filled in while a scenario runs; `ok` when no invariant was violated."""

    scenario: str
    examples: int = 0
    faults: int = 0
    violations: list[str] = attrs.field(factory=list)
    fault_counts: collections.Counter = attrs.field(factory=collections.Counter)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        verdict = "clean" if self.ok else f"{len(self.violations)} violation(s)"
        kinds = ""
        if self.fault_counts:
            kinds = " (" + ", ".join(f"{kind} {n}" for kind, n in sorted(self.fault_counts.items())) + ")"
        return (
            f"{self.scenario}: {self.examples} examples, {self.faults} faults injected{kinds}, "
            f"{verdict}"
        )
