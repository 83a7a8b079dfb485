"""Histograms and labels cheap enough for the hot paths: a bucket count is a bisect and an add.

Choices
- `prometheus_client.Histogram.observe` takes a lock per observation; a row call or a statement
  is observed from trio's one thread (sync row functions run in worker threads, but their call
  is timed around `trio.to_thread`, in the trio thread), so `FastHistogram` keeps plain lists
  and is exposed through a collector at scrape time (`LabeledHistograms.collect`). A stray
  observation from another thread can at worst lose one count; it never corrupts the list.
- `BoundedLabels` keeps a label's values to the first `cap` seen (or a fixed set) and maps
  every other value to `OTHER`, so no caller can grow a metric without bound.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Iterator

from prometheus_client.core import HistogramMetricFamily

OTHER = "other"

# Seconds: from a no-op call (microseconds) to a slow one (minutes).
CALL_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0)
STATEMENT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class FastHistogram:
    """Bucket counts, a sum and a count, unlocked (see the module docstring)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), self.counts):
            running += count
            out.append((bound, float(running)))
        return out


class BoundedLabels:
    """Label values kept to a fixed set, or to the first `cap` seen; the rest become `OTHER`."""

    def __init__(self, cap: int = 0, known: Iterable[str] = ()) -> None:
        self.cap = cap
        self.known: set[str] = set(known)
        self.fixed = cap == 0

    def __call__(self, value: str) -> str:
        if value in self.known:
            return value
        if self.fixed or len(self.known) >= self.cap:
            return OTHER
        self.known.add(value)
        return value


class LabeledHistograms:
    """One `FastHistogram` per label tuple, collected as one Prometheus histogram family."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...],
                 bounds: tuple[float, ...]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = bounds
        self.children: dict[tuple[str, ...], FastHistogram] = {}

    def child(self, *values: str) -> FastHistogram:
        found = self.children.get(values)
        if found is None:
            found = self.children[values] = FastHistogram(self.bounds)
        return found

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        for values, histogram in list(self.children.items()):
            family.add_metric(list(values), histogram.cumulative(), histogram.total)
        yield family
