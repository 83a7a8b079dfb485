"""Phase marks: which actor phase the current task is in, as a context variable.

How it works
- `PHASE` is a `contextvars.ContextVar` holding a short phase name, or None outside any phase.
  An actor function decorated with `@marked("admission")` sets it for the duration of the call and
  restores the previous value when the call ends, however it ends. Trio copies the context into
  each task it spawns, so a mark set by an actor is seen by everything that actor awaits (engine
  calls, ports, statement hooks) and by tasks it starts, and by nothing else.
- Phases: `staging` (the sealer's page putters), `admission` (the admission actor), `completion`
  (the completer's writer), `flush` (the shielded flush of computed outcomes on cancellation),
  `retirement` (retiring a run's array inputs).
- Only observers read it (`current()`): simulations and tests use it to place crash points and
  faults in a phase. Engine and actor logic never branches on it.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Awaitable, Callable, Literal, ParamSpec, TypeVar

Phase = Literal["staging", "admission", "completion", "flush", "retirement"]
PHASES: tuple[Phase, ...] = ("staging", "admission", "completion", "flush", "retirement")

PHASE: contextvars.ContextVar[Phase | None] = contextvars.ContextVar("runplane_phase", default=None)

P = ParamSpec("P")
R = TypeVar("R")


def current() -> Phase | None:
    """The phase the current task is in (None outside every marked actor)."""
    return PHASE.get()


def marked(phase: Phase) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorate an async actor function so that its calls run in `phase`."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def in_phase(*args: P.args, **kwargs: P.kwargs) -> R:
            token = PHASE.set(phase)
            try:
                return await fn(*args, **kwargs)
            finally:
                PHASE.reset(token)

        return in_phase

    return decorate
