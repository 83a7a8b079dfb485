"""The garbage collector of a hosting process: frozen after imports, collecting less often.

How it works
- A process that hosts rows or serves (`HOSTING_COMMANDS`) calls `tune_for_hosting` once,
  after its imports and argument parsing, before the command runs (`cli.main.main`, only for
  the process's own command, never for `main(argv)` called from Python).
- `gc.freeze()` moves every object alive then (modules, classes, functions: some 10^5 of them)
  into the permanent generation, so no later collection scans them again.
- `gc.set_threshold(*HOSTING_THRESHOLDS)`: CPython's default (700, 10, 10) runs a young
  collection every 700 net container allocations; a map allocates several containers a row
  (its dict, outcome values, batches), so a 100,000-row map ran ~800 young, ~75 middle and a few
  full collections: 12–16 % of its CPU (measured with `benchmarks/gc.py`). With 50,000 it runs
  a handful. Garbage cycles are still collected (each young collection finds them); what grows
  is at most 50,000 young containers (a few MB) between collections.
- `restore_defaults` undoes both (tests and the benchmark's alternating rounds use it).
Nothing here changes what a process computes, only when cycles are reclaimed.
"""

from __future__ import annotations

import gc

HOSTING_COMMANDS = frozenset({"run", "demo", "worker", "supervise", "serve", "console"})
HOSTING_THRESHOLDS = (50_000, 20, 100)
DEFAULT_THRESHOLDS = (700, 10, 10)  # CPython's own


def tune_for_hosting() -> None:
    """Freeze what is alive now and raise the collection thresholds (see the docstring)."""
    gc.collect()  # what is garbage already is not frozen forever
    gc.freeze()
    gc.set_threshold(*HOSTING_THRESHOLDS)


def restore_defaults() -> None:
    """Unfreeze and put CPython's default thresholds back."""
    gc.unfreeze()
    gc.set_threshold(*DEFAULT_THRESHOLDS)
