"""Rows per second of one map of one run, from its run history's samples: never negative.

How it works
- A `RateWindow` is fed samples `(at, count)`: `count` is a run's rows given an outcome
  (completed + failed) on one table, as its run history last wrote them, and `at` the time the
  history wrote it (the database's clock). The count belongs to this run alone, so it only
  grows: a `force` run that re-admits a sheet's rows, or another run writing the same sheet,
  never moves it backwards. Were a count ever to drop (a wake of a crashed run replaces the
  map's entry with its own), the window starts over from it instead of showing a negative rate.
- `rate(now)`: completions over the last `WINDOW_S` seconds before `now` (over the time sampled
  while that is shorter): 0 with fewer than two samples in the window, so 0 when there were
  none, and never below 0.
- `series()`: the rate between each two successive samples of the last `KEEP` samples; samples
  are only added while the map runs, so when it ends the chart keeps its last minute.
- Pure: no I/O (the live stream and the tests call it).
"""

from __future__ import annotations

import collections

import attrs

WINDOW_S = 60.0
KEEP = 61  # samples drawn in the chart: about a minute of per-second history writes


def eta_s(remaining: int, rate: float) -> float | None:
    """Seconds left at `rate`: 0 when nothing remains, None when the rate is 0."""
    if remaining <= 0:
        return 0.0
    return remaining / rate if rate > 0 else None


@attrs.define(eq=False)
class RateWindow:
    samples: collections.deque = attrs.field(
        init=False, factory=lambda: collections.deque(maxlen=KEEP))

    def add(self, at: float, count: int) -> None:
        """Sample `count` at `at` (a repeat of the last sample's time adds nothing)."""
        if self.samples:
            last_at, last = self.samples[-1]
            if at <= last_at:
                return
            if count < last:  # this map's entry was replaced (a wake): start over from it
                self.samples.clear()
        self.samples.append((at, count))

    def rate(self, now: float) -> float:
        """Completions a second over the last `WINDOW_S` seconds before `now`."""
        recent = [s for s in self.samples if s[0] >= now - WINDOW_S]
        if len(recent) < 2:
            return 0.0
        (then, before), (_, count) = recent[0], recent[-1]
        span = max(now, recent[-1][0]) - then
        return max(0.0, (count - before) / span) if span > 0 else 0.0

    def series(self) -> list[float]:
        points = list(self.samples)
        return [max(0.0, (b[1] - a[1]) / (b[0] - a[0]))
                for a, b in zip(points, points[1:])]
