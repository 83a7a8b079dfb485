"""Numeric argument checks: "a number, not a bool, within bounds", written once.

`bool` is an `int` in Python, so every numeric check must exclude it; these predicates do, and
compare so that NaN fails every bound. They only answer: each caller raises its own typed error
with a message naming its field (bad input is refused before the first query).
"""

from __future__ import annotations

import math
import sys
from typing import Sequence


def is_int(value: object, low: int | None = None, high: int | None = None) -> bool:
    """An `int` that is not a `bool`, with `low <= value <= high` (None: unbounded)."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and (low is None or value >= low) and (high is None or value <= high))


def ints_within(values: Sequence[object], low: int, high: int) -> bool:
    """Every one of `values` (a non-empty sequence) an `int` (exactly: not a bool, nor another
    subclass) with `low <= value <= high`, each check one pass in C. False is no verdict on which
    one: a caller that must name the item then checks each with `is_int`."""
    return set(map(type, values)) == {int} and low <= min(values) and max(values) <= high


def is_number(value: object, low: float | None = None, high: float | None = None, *,
              above: float | None = None, below: float | None = None,
              finite: bool = False) -> bool:
    """An `int` or `float` that is not a `bool`, with `low <= value <= high` and
    `above < value < below` (None: unbounded); `finite` also refuses NaN, infinities and ints
    too large for a float. Without bounds NaN passes; any bound refuses it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if finite and not (math.isfinite(value) if isinstance(value, float)
                       else abs(value) <= sys.float_info.max):
        return False
    return ((low is None or value >= low) and (high is None or value <= high)
            and (above is None or value > above) and (below is None or value < below))
