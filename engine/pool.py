"""A tenant's physical connections: the idle ones, when they close, and their slots in a
server's connection budget.

How it works
- `take()` answers the newest idle pooled connection (the others age out), else opens one; with
  a budget (`engine.limits.connections`), a new connection first takes a slot, waiting in the
  budget's fair line when the process is at its budget (cancellable: the caller's deadline
  ends the wait). A connect that fails gives its slot back.
- `give(raw, reusable)` pools a connection, or closes it when it is not reusable, the pool is
  closed, or others wait for a slot of the budget (a tenant never keeps an idle connection
  somebody else is waiting for). A connection closed here frees its slot once it is closed.
- The budget may also take an idle connection (`take_idle`: the oldest, or the oldest idle
  since a given time) for a tenant that can use it, or have it closed (`discard`: in the
  reaper's task, its slot returned once closed); a checkout that ends while others wait hands
  its connection to the next in line when that tenant can use it (see
  `engine.limits.connections`).
- A pooled connection idle `idle_close_s` (15 s, `RUNPLANE_IDLE_CLOSE_S`) is closed by the
  reaper, a task the tenant owns from `start()` to `aclose()`, so an idle process holds none of
  the server's connections.
- `extra()`: a connection opened while the caller holds one of this pool's (resolving a lost
  COMMIT, reading the server's identity): it overdraws the budget rather than wait (see
  `ServerBudget.overdraw`); close it with `close_extra`.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import attrs
import trio

from . import pg
from .limits.connections import BudgetAccount

Raw = pg.RawConnection  # a driver connection


@attrs.define(eq=False)
class ConnectionPool:
    """One tenant's connections (module docstring). `connect` opens one (the tenant's connect
    ladder); `account` is the tenant's share of a server budget, None without one."""

    driver: pg.Driver = attrs.field(repr=False)
    connect: Callable[[], Awaitable[Raw]] = attrs.field(repr=False)
    idle_close_s: float
    account: BudgetAccount | None = None
    # Pooled connections, by when they were returned (trio time), the newest last.
    idle: list[tuple[float, Raw]] = attrs.field(init=False, factory=list)
    closed: bool = attrs.field(init=False, default=False)
    _reaper: trio.CancelScope = attrs.field(init=False, factory=trio.CancelScope)
    _to_close: list[Raw] = attrs.field(init=False, factory=list)
    _wake: trio.Event = attrs.field(init=False, factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        if self.account is not None:
            self.account.pool = self

    async def take(self) -> Raw:
        """An idle pooled connection, else a new one (after a budget slot)."""
        while self.idle:
            _, raw = self.idle.pop()
            if not raw.is_closed():
                return raw
            self._free()
        if self.account is not None:
            handed = await self.account.acquire()
            if handed is not None:
                if not handed.is_closed():
                    return handed
                pg.terminate(handed)
        try:
            return await self.connect()
        except BaseException:
            self._free()
            raise

    def give(self, raw: Raw, reusable: bool) -> None:
        """Pool `raw`, or close it at once (module docstring)."""
        account = self.account
        wanted = account is not None and account.budget.wanted()
        if reusable and not self.closed and not wanted:
            self.idle.append((trio.current_time(), raw))
            return
        if reusable and not self.closed and account is not None and account.hand_off(raw):
            return
        pg.terminate(raw)
        self._free()

    def broken(self) -> None:
        """A connection of this pool was closed by its holder (it frees its slot)."""
        self._free()

    async def extra(self) -> Raw:
        if self.account is not None:
            self.account.overdraw()
        try:
            return await self.connect()
        except BaseException:
            self._free()
            raise

    async def close_extra(self, raw: Raw) -> None:
        try:
            await pg.close_gracefully(raw, self.driver)
        finally:
            self._free()

    def _free(self) -> None:
        if self.account is not None:
            self.account.release()

    def take_idle(self, idle_since: float | None = None) -> Raw | None:
        """Remove and answer the oldest idle connection that is still open (None: none); with
        `idle_since` (trio time), only one pooled at or before then."""
        while self.idle and not self.closed:
            if idle_since is not None and self.idle[0][0] > idle_since:
                return None
            _, raw = self.idle.pop(0)
            if not raw.is_closed():
                return raw
            self._free()
        return None

    def discard(self, raw: Raw) -> None:
        """Close `raw` in the reaper's task; its slot is released once it is closed."""
        self._to_close.append(raw)
        self._wake.set()

    # -- the reaper --------------------------------------------------------------------------
    def start(self) -> None:
        """Close idle connections from now until `aclose` (a system task, like the tenant's
        diagnostics queue: it outlives no tenant)."""
        trio.lowlevel.spawn_system_task(self._reap, name="runplane idle connections")

    async def _reap(self) -> None:
        with self._reaper:
            next_round = trio.current_time() + self.idle_close_s / 3
            while True:
                with trio.move_on_at(next_round):
                    await self._wake.wait()
                self._wake = trio.Event()
                if trio.current_time() >= next_round:
                    next_round = trio.current_time() + self.idle_close_s / 3
                    cutoff = trio.current_time() - self.idle_close_s
                    self._to_close.extend(raw for released, raw in self.idle if released <= cutoff)
                    self.idle = [(t, raw) for t, raw in self.idle if t > cutoff]
                while self._to_close:
                    await self.close_extra(self._to_close.pop())

    async def aclose(self) -> None:
        """Close every pooled connection at once (a blackholed server costs one timeout)."""
        self.closed = True
        self._reaper.cancel()
        closing = [raw for _, raw in self.idle] + self._to_close
        self.idle, self._to_close = [], []
        async with trio.open_nursery() as nursery:
            for raw in closing:
                nursery.start_soon(self.close_extra, raw)


__all__ = ["ConnectionPool"]
