"""The map function as the workers call it, and the fail-fast check on what it does.

How it works
- `as_row_caller(fn, concurrency)`: an async function (a coroutine function, or an object
  whose `__call__` is one; `functools.partial` of one too) is called as it is. Anything else is
  a plain function: it is detected when the map starts, before any row runs, and each call runs
  in a worker thread (`trio.to_thread.run_sync`) under a limiter of the map's `concurrency`, so
  at most that many threads call it at once and a blocking call never stalls the event loop. A
  plain function that returns an awaitable (`lambda row: enrich(row, key)`) has it awaited. A
  cancelled call (a row timeout, Ctrl-C) is abandoned: the thread finishes on its own, its
  result is dropped.
- `FailFast` watches the first outcomes of a map. When its first `rows` outcomes (default
  `FAIL_FAST_ROWS`) all failed for one cause coming from the function — the same exception type
  raised, or the same bad return value (not a dict, outputs that cannot be stored) — the map
  stops early: the function is broken, and calling it on every other row would only repeat its
  side effects. One completed row, or two causes, disarms it for the rest of the map; so does a
  cache hit (the function worked on this sheet before: a rerun runs the rows that failed, whose
  failures may be their data's). A rerun of a map that stopped early, its function still
  broken, finds no cache hit and stops again.
  `run.map(..., fail_fast=False)` turns it off; `fail_fast=N` watches the first N rows.
- `RowError(message, outputs={...})`, raised by the function, fails the row with `message`
  but stores `outputs` as completed cells (every other output of the row is failed): a rerun
  with `previous_cells=True` finds them in `row["_previous"]` and need not compute them again.
  Under a retry policy only the last call's outcome is written (a retried call's outputs are
  dropped with it).
"""

from __future__ import annotations

import functools
import inspect
from typing import Awaitable, Callable, Mapping

import attrs
import trio

from runplane.engine.canonical import JsonObject
from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import OutcomeStatus

FAIL_FAST_ROWS = 20

# The map's function as `run.map` is given it: async or plain, of one row; it returns the row's
# outputs (anything else fails the row as a bad return value).
RowFunction = Callable[[JsonObject], object]
# The map's function as the workers call it: an async function of one row.
RowCaller = Callable[[JsonObject], Awaitable[object]]


class RowError(Exception):
    """Raised by a map function: the row fails with `message`, and the `outputs` given (a dict
    of output fields, as a function would return them) are stored as completed cells."""

    def __init__(self, message: str, outputs: Mapping[str, object] | None = None) -> None:
        super().__init__(message)
        if outputs is not None and not isinstance(outputs, Mapping):
            raise InvalidInputError(
                f"RowError outputs must be a dict of output fields, got {type(outputs).__name__}")
        self.outputs: dict[str, object] = dict(outputs or {})


def is_async_function(fn: object) -> bool:
    """`fn` returns a coroutine when called: a coroutine function, a partial of one, or an
    object whose `__call__` is one."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)
    return not inspect.isfunction(fn) and inspect.iscoroutinefunction(call)


def as_row_caller(fn: RowFunction, concurrency: int) -> RowCaller:
    """`fn` as an async function of one row (see the module docstring)."""
    if not callable(fn) or is_async_function(fn):
        return fn  # a non-callable is refused by the map's plan, naming the argument
    limiter = trio.CapacityLimiter(concurrency)

    def boxed(row: JsonObject) -> tuple[object]:  # trio refuses a thread's coroutine unless boxed
        return (fn(row),)

    async def in_thread(row: JsonObject) -> object:
        (value,) = await trio.to_thread.run_sync(boxed, row, limiter=limiter,
                                                 abandon_on_cancel=True)
        if inspect.isawaitable(value):
            value = await value
        return value

    in_thread.runs_in_thread = True  # type: ignore[attr-defined]
    in_thread.__wrapped__ = fn  # type: ignore[attr-defined]
    return in_thread


def fail_fast_rows(value: object) -> int | None:
    """`run.map`'s `fail_fast` as a number of rows to watch (None: off)."""
    if value is True:
        return FAIL_FAST_ROWS
    if value is False or value is None:
        return None
    if isinstance(value, int) and value >= 1:
        return value
    raise InvalidInputError(f"fail_fast must be True, False or a number of rows >= 1, got {value!r}")


@attrs.define(eq=False)
class FailFast:
    """The streak of the map's first outcomes; `tripped` once `rows` failed for one cause."""

    rows: int
    cause: str | None = None
    example: str | None = None
    seen: int = 0
    armed: bool = True
    tripped: bool = False

    def observe(self, cause: str | None, message: str | None) -> bool:
        """One row's final outcome (`cause` None: it completed); True when this trips it."""
        if not self.armed:
            return False
        if cause is None or (self.cause is not None and cause != self.cause):
            self.armed = False
            return False
        if self.cause is None:
            self.cause, self.example = cause, message
        self.seen += 1
        if self.seen >= self.rows:
            self.armed, self.tripped = False, True
            return True
        return False

    def disarm(self) -> None:
        self.armed = False

    def reason(self) -> str:
        return (f"the first {self.rows} rows all failed with {self.cause}"
                + (f" (for example: {self.example})" if self.example and
                   self.example != self.cause else ""))


def failure_cause(status: str, error: BaseException | None, message: str | None) -> str | None:
    """What a row's final outcome says about the function: None when it completed, the
    exception's type when it raised, else the failure's message (a bad return value)."""
    if status == OutcomeStatus.COMPLETED:
        return None
    if error is not None:
        return type(error).__qualname__
    return message or "failed"
