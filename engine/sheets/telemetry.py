"""Telemetry of sheet operations: elapsed time and failures per phase of one call.

How it works
- A `PhaseClock` belongs to one call (`admit`, `complete`, …); the sheet transaction adds the
  checkout (split into permit wait and connect when the port reports its permit waits), BEGIN
  and COMMIT, the operation adds its statements. The call turns it into `Timing`s or
  `CompletionDiagnostics`.
This module does no I/O.
"""

from __future__ import annotations

import time
from typing import Awaitable, TypeVar

import attrs

from ..ports import SHEET_LANE, Port

T = TypeVar("T")


@attrs.define(eq=False)
class PhaseClock:
    """Mutable per-call telemetry: elapsed ms and failures per phase, plus retries."""

    ms: dict[str, float] = attrs.field(factory=dict)
    failures: dict[str, int] = attrs.field(factory=dict)
    column_retries: int = 0  # writes that had to create columns first (the exclusive path)

    def add(self, phase: str, seconds: float, failed: bool = False) -> None:
        self.ms[phase] = self.ms.get(phase, 0.0) + seconds * 1000.0
        if failed:
            self.failures[phase] = self.failures.get(phase, 0) + 1

    async def measure(self, phase: str, awaitable: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            result = await awaitable
        except BaseException:
            self.add(phase, time.perf_counter() - started, failed=True)
            raise
        self.add(phase, time.perf_counter() - started)
        return result


def permit_wait_seconds(port: Port) -> float | None:
    try:
        stats = port.permits()
        return sum(stats[name].wait_seconds for name in (SHEET_LANE, "connections") if name in stats)
    except Exception:  # telemetry only: a port without usable stats has no split
        return None
