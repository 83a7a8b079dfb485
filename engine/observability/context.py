"""What a log line, a metric and a span are about: the org, play, run and map of the current task.

Choices
- One `contextvars.ContextVar` holding a frozen `Where`: the run actors set it (`open_run` the
  org, play and run id; `Run.map` and a shared worker the map), and trio hands a task's context
  to the tasks it starts, so every actor of a map logs with its map's fields without passing
  them around. Setting it costs one `ContextVar.set` per run and per map, never per row.
- `bound(**fields)` is a context manager that sets the given fields on top of the current ones
  and restores the previous value on exit.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import attrs


@attrs.frozen
class Where:
    """The org, play, run id and map (its table) the current task works for; None: unknown."""

    org: str | None = None
    play: str | None = None
    run_id: str | None = None
    map: str | None = None

    def fields(self) -> dict[str, str | None]:
        return {"org": self.org, "play": self.play, "run_id": self.run_id, "map": self.map}


_where: contextvars.ContextVar[Where] = contextvars.ContextVar("runplane_where", default=Where())


def current() -> Where:
    """The current task's `Where`."""
    return _where.get()


def enter(**fields: str) -> contextvars.Token:
    """Set the given fields (the others kept) until `leave(token)`: for a context manager whose
    enter and exit are apart (`actors.run.open_run`)."""
    return _where.set(attrs.evolve(_where.get(), **fields))


def leave(token: contextvars.Token) -> None:
    _where.reset(token)


@contextlib.contextmanager
def bound(*, org: str | None = None, play: str | None = None, run_id: str | None = None,
          map: str | None = None) -> Iterator[Where]:
    """Set the given fields (the others kept) for the block and the tasks it starts."""
    given = {k: v for k, v in (("org", org), ("play", play), ("run_id", run_id), ("map", map))
             if v is not None}
    where = attrs.evolve(_where.get(), **given)
    token = _where.set(where)
    try:
        yield where
    finally:
        _where.reset(token)
