"""Permits: FIFO, cancellable counting semaphores with wait telemetry.

A tenant holds one `Permits` per lane plus one for its connection cap. Waiters are served in
arrival order (trio's semaphore parks them in a FIFO lot), a cancelled waiter leaves the queue
without consuming a permit, and every acquisition adds its wait to `wait_seconds`.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import attrs
import trio

from .observability import metrics


@attrs.frozen
class PermitStats:
    """A snapshot of one lane: its limit, permits held, tasks waiting, acquisitions so far and
    the total seconds those acquisitions waited."""

    limit: int
    in_use: int
    waiting: int
    acquired: int
    wait_seconds: float


@attrs.define(eq=False)
class Permits:
    name: str
    limit: int = attrs.field(validator=attrs.validators.ge(1))
    _semaphore: trio.Semaphore = attrs.field(init=False)
    _waiting: int = attrs.field(init=False, default=0)
    _acquired: int = attrs.field(init=False, default=0)
    _wait_seconds: float = attrs.field(init=False, default=0.0)

    def __attrs_post_init__(self) -> None:
        self._semaphore = trio.Semaphore(self.limit, max_value=self.limit)

    async def acquire(self) -> None:
        """Take one permit; waits FIFO, cancellable while waiting. Pair with `release()`."""
        try:
            self._semaphore.acquire_nowait()
        except trio.WouldBlock:
            self._waiting += 1
            started = trio.current_time()
            try:
                await self._semaphore.acquire()
            finally:
                self._waiting -= 1
                self._wait_seconds += (waited := trio.current_time() - started)
                metrics.permit_waited(self.name, waited)  # `runplane_permit_wait_seconds`
        self._acquired += 1

    def release(self) -> None:
        self._semaphore.release()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold one permit for the block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    def stats(self) -> PermitStats:
        return PermitStats(
            limit=self.limit,
            in_use=self.limit - self._semaphore.value,
            waiting=self._waiting,
            acquired=self._acquired,
            wait_seconds=self._wait_seconds,
        )
