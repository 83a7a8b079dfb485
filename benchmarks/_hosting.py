"""Benchmark processes collect garbage as runplane's hosting commands do.

`runplane run`, `demo`, `worker`, `supervise`, `serve` and `console` freeze what is alive
after their imports and raise the collector's thresholds (`cli.collector.tune_for_hosting`).
A benchmark process that stands for one of them (a map is what `runplane run` hosts, a
gateway child is `runplane serve`, a runner is `runplane demo`) calls `collect_as_hosting()`
after its imports, so it is measured the way production runs. `RUNPLANE_BENCH_GC=default`
keeps CPython's defaults instead (a program embedding runplane without tuning), in this
process and in the children it starts (they inherit the environment).
"""

from __future__ import annotations

import os

from runplane.cli import collector

ENV = "RUNPLANE_BENCH_GC"


def collect_as_hosting() -> str:
    """Tune this process's collector as the hosting commands do, unless `RUNPLANE_BENCH_GC`
    is `default`; a line saying which, for the benchmark to print."""
    if os.environ.get(ENV, "").strip().lower() == "default":
        return "garbage collector: CPython's defaults (RUNPLANE_BENCH_GC=default)"
    collector.tune_for_hosting()
    return ("garbage collector: tuned as runplane's hosting commands tune it "
            "(RUNPLANE_BENCH_GC=default for CPython's defaults)")
