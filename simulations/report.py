"""What a simulation run reports: examples run, faults injected, invariant violations."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from .harness import DescribedPlan


@attrs.define(eq=False)
class SimulationReport:
    """Mutable tally filled in while a scenario runs; `ok` when no invariant was violated."""

    scenario: str
    examples: int = 0
    faults: int = 0
    violations: list[str] = attrs.field(factory=list)
    fault_counts: collections.Counter = attrs.field(factory=collections.Counter)
    # Examples that broke an invariant (the first one and its shrinking steps), and the minimal
    # failing schedule, `(plan, scheduler seed)`, once hypothesis has shrunk it.
    failing_examples: int = 0
    minimal: tuple[DescribedPlan, int] | None = None
    notes: list[str] = attrs.field(factory=list)  # what hypothesis printed about the failure
    # Faults of the examples' fault ports: drawn, fired, neutralized, not reached.
    drawn_faults: collections.Counter = attrs.field(factory=collections.Counter)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        verdict = "clean" if self.ok else f"{len(self.violations)} violation(s)"
        kinds = ""
        if self.fault_counts:
            kinds = " (" + ", ".join(f"{kind} {n}" for kind, n in sorted(self.fault_counts.items())) + ")"
        shrunk = "".join(f"\n  {note}" for note in self.notes)
        if self.drawn_faults["drawn"]:
            shrunk += "\n  port faults: " + ", ".join(
                f"{n} {what}" for what, n in self.drawn_faults.items())
        if self.minimal is not None:
            plan, scheduler = self.minimal
            shrunk += f"\n  minimal failing schedule: plan={plan!r}, scheduler={scheduler}"
        return (
            f"{self.scenario}: {self.examples} examples, {self.faults} faults injected{kinds}, "
            f"{verdict}{shrunk}"
        )
