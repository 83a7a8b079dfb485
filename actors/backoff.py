"""The delay queue of a map with a retry policy: rows waiting out a backoff, outside every worker.

How it works
- A worker whose call failed and may be retried `defer`s the row (with its due time and the
  calls it has had) and goes on with the next row: a waiting row holds no worker and no permit.
- The map's `release_retries` actor sends rows that came due back into the work channel, in
  batches, and otherwise sleeps until the earliest due time or until something changes.
- Bookkeeping for the end of the map: `out` counts rows handed to workers (by admission or by
  the releaser) and not yet resolved (written to an outcome, deferred, or left). The releaser
  ends — closing its side of the work channel, so the workers can end — once admission is done,
  nothing is out and nothing is waiting: no row can come back any more.
- Memory: admission waits (`wait_for_room`) while `limit` rows (the map's `max_waiting_rows`,
  default `MAX_WAITING_ROWS`) wait, so a source whose every row fails cannot pile its rows up
  here: only rows already handed out can still be deferred, so the queue never holds more than
  `limit` plus the admission window (the rows in the work channel and in the workers' hands,
  at most `3 × concurrency × MAX_WORK_BATCH`), whatever the source size.
- Wake-ups are rare on purpose: the releaser is woken when a row is deferred earlier than
  everything waiting, when admission ends, when the last row out is resolved, or when the map is
  stopped — never once per row.
All of it runs in the map's one trio thread; no method here awaits except the two waits.
"""

from __future__ import annotations

import heapq
import itertools
import math

import attrs
import trio

from runplane.engine.sheets import AdmittedRow

MAX_WAITING_ROWS = 10_000


@attrs.define(eq=False)
class RetryQueue:
    """Rows in backoff, by due time (see the module docstring)."""

    limit: int = MAX_WAITING_ROWS
    out: int = 0
    admitting: bool = True
    stopped: bool = False
    _heap: list[tuple[float, int, AdmittedRow]] = attrs.field(init=False, factory=list)
    _order: itertools.count = attrs.field(init=False, factory=itertools.count)
    _calls: dict[str, int] = attrs.field(init=False, factory=dict)
    _changed: trio.lowlevel.ParkingLot = attrs.field(init=False, factory=trio.lowlevel.ParkingLot)
    _room: trio.lowlevel.ParkingLot = attrs.field(init=False, factory=trio.lowlevel.ParkingLot)

    @property
    def waiting(self) -> int:
        return len(self._heap)

    # -- admission and the releaser hand rows out -----------------------------------------------
    def hand_out(self, rows: int) -> None:
        self.out += rows

    def end_admission(self) -> None:
        self.admitting = False
        self._changed.unpark_all()

    async def wait_for_room(self) -> None:
        while len(self._heap) >= self.limit and not self.stopped:
            await self._room.park()

    # -- workers --------------------------------------------------------------------------------
    def calls_so_far(self, key: str) -> int:
        """Calls the row had in this map before the one about to start (0 for a first call)."""
        return self._calls.pop(key, 0)

    def defer(self, row: AdmittedRow, calls: int, due: float) -> None:
        self._calls[row.key] = calls
        earliest = self._heap[0][0] if self._heap else math.inf
        heapq.heappush(self._heap, (due, next(self._order), row))
        if due < earliest:
            self._changed.unpark_all()

    def resolve(self) -> None:
        """A row handed out is done with (an outcome, a deferral, or left to a newer run)."""
        self.out -= 1
        if self.out == 0 and not self.admitting:
            self._changed.unpark_all()

    # -- the releaser ---------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return not self.admitting and self.out == 0 and not self._heap

    def take_due(self, now: float) -> list[AdmittedRow]:
        due = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        if due:
            self._room.unpark_all()
        return due

    @property
    def next_due(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    async def wait_for_change(self) -> None:
        await self._changed.park()

    def stop(self) -> None:
        """The map stops (superseded): waiting rows are dropped, left to the newer run."""
        self.stopped = True
        self._heap.clear()
        self._calls.clear()
        self._changed.unpark_all()
        self._room.unpark_all()
