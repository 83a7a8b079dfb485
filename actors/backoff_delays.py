"""The backoff formula: how long to wait before a retry, for every retry in `actors`.

How it works
- `backoff_ceiling(n, initial=, cap=, factor=)` is capped exponential growth,
  `min(cap, initial × factor^(n-1))` for the n-th retry (1-based), computed without overflow
  however large n grows.
- `half_jittered_s` draws the wait uniformly from [d/2, d] (the store retries of `actors.retry`
  and the supervisor's outbox drainer); a row policy draws from [0, d] (full jitter, see
  `actors.policies.RowRetry`).
Pure: no I/O.
"""

from __future__ import annotations

import random


def backoff_ceiling(n: int, *, initial: float, cap: float, factor: float = 2.0) -> float:
    """The longest wait before retry `n` (1-based; less counts as 1): `min(cap, initial ×
    factor^(n-1))`; 0 when `initial` or `cap` is 0, `min(cap, initial)` when `factor` <= 1."""
    if initial <= 0 or cap <= 0:
        return 0.0
    if factor <= 1:
        return min(cap, initial)
    try:
        return min(cap, initial * factor ** (max(n, 1) - 1))
    except OverflowError:  # factor^(n-1) is past any float: the cap long since
        return cap


def half_jittered_s(n: int, *, initial: float, cap: float,
                    rng: random.Random | None = None) -> float:
    """The wait after the `n`-th failure: uniform in [d/2, d], d = `backoff_ceiling` doubling."""
    ceiling = backoff_ceiling(n, initial=initial, cap=cap)
    return ceiling / 2 + (rng or random).random() * ceiling / 2
