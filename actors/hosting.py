"""A nursery that hosts a caller's `async with` body without wrapping its errors.

How it works
- trio nurseries wrap whatever the body of `async with open_nursery()` raises in an exception
  group. A context manager like `open_run` or `open_supervisor` yields *inside* its nursery (so
  nothing started on it outlives the block), but a user who writes `except ValueError` around
  the block should catch their own `ValueError`. `open_hosting_nursery` therefore captures the
  body's exception, cancels the nursery's children, lets the nursery finish, and re-raises the
  body's exception unchanged. Children's own failures still surface as an exception group.
- `cancel_on_exit=True` cancels background children when the body ends normally (a supervisor's
  drainer loops forever); otherwise the nursery waits for them, like any nursery.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import trio


@contextlib.asynccontextmanager
async def open_hosting_nursery(*, cancel_on_exit: bool = False) -> AsyncIterator[trio.Nursery]:
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        except BaseException as exc:  # re-raised below, after the children are gone
            body_error = exc
            nursery.cancel_scope.cancel()
        else:
            if cancel_on_exit:
                nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error


def is_terminal(error: BaseException | None) -> bool:
    """A run ends terminally when it returns or raises an ordinary exception.

    Cancellation, KeyboardInterrupt and groups holding them are not terminal: the run may be
    woken again, so its durable input must stay.
    """
    return error is None or isinstance(error, Exception)
