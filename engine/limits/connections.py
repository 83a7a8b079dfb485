"""A server's connection budget: the connections one process may hold to one server, shared
fairly by the tenants (orgs) it hosts.

How it works
- A `ServerBudget` has `size` slots; a slot is one physical connection, from before it is opened
  until it is closed (in use or pooled idle: the server counts both). Each tenant that draws on
  the budget has a `BudgetAccount`; `account.acquire()` takes a slot before the tenant opens a
  connection and `account.release()` gives it back once the connection is closed. A tenant
  reuses its own pooled connections without asking the budget.
- One fair queue: while slots are free nobody waits. Past the budget, callers wait in line; a
  freed slot goes to the account that waited longest among those holding **no** connection,
  else to the account that has waited longest among the others, one slot per turn: an org that
  holds connections yields to an org that holds none, every active org gets at least one, and
  orgs that keep asking take turns (round robin, FIFO within an org).
- Idle connections go back, and connections move between tenants rather than close and reopen:
  accounts whose tenants could use each other's connections share a `key` (same DSN, startup
  settings and driver loop: runplane keeps no session state on a pooled connection). A caller
  with nobody in line takes an idle connection of another account with its key (slot and
  connection move together): at a full budget any, below it one idle `spare_idle_s` (1 s) or
  longer (a busy tenant keeps the connections it is about to reuse, and a backend already
  running costs the server less than a new one: no start, its catalog caches warm). One that
  has to wait asks an account with an idle connection of another key to close it
  (`pool.take_idle`, `pool.discard`). Both look only at the accounts holding a slot (at most
  `size`), however many a gateway keeps for the orgs it has seen. A tenant whose
  checkout ends while others wait hands the connection to the next caller in line when it has
  the same key (`hand_off`), else closes it rather than pool it (`ServerBudget.wanted`). The
  tenant's idle reaper (15 s) returns the rest.
- Waiting is cancellable and counts against the caller's deadline: a `trio` cancel scope around
  the request ends the wait, and a slot granted at that very moment is passed on, never lost.
- `overdraw()` takes a slot without waiting, even past the size: for a connection opened while
  the caller already holds one (resolving a lost COMMIT, probing the server's identity), which
  would deadlock if it had to wait behind callers waiting for the caller's own slot. The
  default size leaves room for these (see `engine.limits.server_share`).
- `stats()`: slots in use / size, accounts waiting, callers waiting, the longest wait since
  the last `stats(new_period=True)` (finished or still waiting); `take_waits()` the waits of the
  acquisitions since the last call (for a p99).
Pure trio: no I/O, no database. A process hosting many tenants makes one budget per server it
reaches and opens its tenants there inside `with hosting(budget):` (`open_tenant` reads
`current_budget()`; a tenant opened outside takes no slots: a runner's own tenant is bounded by
its `max_connections`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from typing import Iterator, Protocol

import attrs
import trio

from ..errors import InvalidInputError
from .bounds import is_int

MAX_WAIT_SAMPLES = 100_000
SPARE_IDLE_S = 1.0  # below the budget, another tenant's connection idle this long is taken


@attrs.frozen
class BudgetStats:
    """A snapshot of a budget: slots `in_use` of `size`, `orgs_waiting` (accounts with a caller
    in line), `waiting` (callers in line), `longest_wait_s` (the longest wait of the period, finished
    or not; 0 when nobody waited), `granted` (slots handed out so far) and `overdrawn` (slots taken past the size)."""

    size: int
    in_use: int
    orgs_waiting: int
    waiting: int
    longest_wait_s: float
    granted: int
    overdrawn: int

    def line(self) -> str:
        """The statistics line's part: `connections 12/50, 3 orgs waiting (longest 0.8 s)`."""
        return (f"connections {self.in_use}/{self.size}, {self.orgs_waiting} orgs waiting "
                f"(longest {self.longest_wait_s:.1f} s)")


@attrs.define(eq=False)
class _Waiter:
    since: float
    event: trio.Event = attrs.field(factory=trio.Event)
    granted: bool = False
    raw: object = None  # a connection handed over with the slot


class IdlePool(Protocol):
    """What a budget asks of a tenant's pool (`engine.pool.ConnectionPool`)."""

    def take_idle(self, idle_since: float | None = None) -> object | None:
        """Remove and answer the oldest idle connection (None: it has none); with
        `idle_since`, only one idle since then or earlier."""

    def discard(self, raw: object) -> None:
        """Close `raw` (one of the account's) and release its slot once closed."""


@attrs.define(eq=False)
class BudgetAccount:
    """One tenant's share of a budget: `held` slots; `key` says whose connections it can use
    (module docstring); `pool` is set by the tenant's pool."""

    budget: "ServerBudget"
    name: str
    key: object = None
    held: int = 0
    pool: IdlePool | None = None
    _line: collections.deque[_Waiter] = attrs.field(init=False, factory=collections.deque)

    async def acquire(self) -> object | None:
        """Take a slot (waiting in line past the budget); answers the connection that came
        with it when another tenant handed one over, else None (open one)."""
        return await self.budget._acquire(self)

    def hand_off(self, raw: object) -> bool:
        """Hand `raw` and its slot to the next caller in line if it can use it (else False:
        close it and `release()`)."""
        return self.budget._hand_off(self, raw)

    def release(self) -> None:
        self.budget._release(self)

    def overdraw(self) -> None:
        self.budget._overdraw(self)


def _check_size(_instance: object, _attribute: object, value: object) -> None:
    if not is_int(value, 1, 1_000_000):
        raise InvalidInputError(f"a connection budget needs a size from 1 to 1000000, got {value!r}")


@attrs.define(eq=False)
class ServerBudget:
    """The connections this process may hold to one server (module docstring)."""

    size: int = attrs.field(validator=_check_size)
    source: str = "given"  # how the size was chosen, for the log line at start
    spare_idle_s: float = SPARE_IDLE_S
    _in_use: int = attrs.field(init=False, default=0)
    _granted: int = attrs.field(init=False, default=0)
    _overdrawn: int = attrs.field(init=False, default=0)
    # Accounts with callers in line: holding no slot, and holding some (each in turn order).
    _hungry: dict[BudgetAccount, None] = attrs.field(init=False, factory=dict)
    _fed: dict[BudgetAccount, None] = attrs.field(init=False, factory=dict)
    # Accounts holding a slot (only they have connections, idle ones included): what a look
    # for an idle connection walks, at most `size` of them however many orgs the process hosts.
    _holders: dict[BudgetAccount, None] = attrs.field(init=False, factory=dict)
    _waits: list[float] = attrs.field(init=False, factory=list)
    _longest: float = attrs.field(init=False, default=0.0)

    def account(self, name: str, key: object = None) -> BudgetAccount:
        """A new account (one per tenant) named after its org."""
        return BudgetAccount(self, name, key)

    def forget(self, account: BudgetAccount) -> None:
        """Drop a closed tenant's account (it holds nothing by then)."""
        self._holders.pop(account, None)

    def wanted(self) -> bool:
        """Whether someone is waiting for a slot (a tenant then closes rather than pools)."""
        return bool(self._hungry or self._fed)

    # -- the queue ---------------------------------------------------------------------------
    async def _acquire(self, account: BudgetAccount) -> object | None:
        # Cancelled callers leave before anything is granted (nothing to give back); this
        # yields only when cancelled, so what follows up to the wait is one atomic step.
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self.wanted():
            # At the budget any idle connection of the key moves; below it only a spare one
            # (idle `spare_idle_s`): its backend is warm, a new one would start cold.
            full = self._in_use >= self.size
            raw = self._take_idle(account,
                                  None if full else trio.current_time() - self.spare_idle_s)
            # A look that found closed idle connections freed their slots on the way.
            if raw is not None or self._in_use < self.size:
                if raw is None:
                    self._grant(account)
                self._sample(0.0)
                return raw
        waiter = _Waiter(trio.current_time())
        account._line.append(waiter)
        if account not in self._hungry and account not in self._fed:
            (self._fed if account.held else self._hungry)[account] = None
        self._ask_for_idle()
        try:
            await waiter.event.wait()
        except BaseException:
            if not waiter.granted:
                self._leave(account, waiter)
            elif waiter.raw is None:  # granted as we were cancelled: pass the slot on
                self._release(account)
            elif not self._hand_off(account, waiter.raw):
                assert account.pool is not None
                account.pool.discard(waiter.raw)
            raise
        finally:
            self._sample(trio.current_time() - waiter.since)
        return waiter.raw

    def _take_idle(self, account: BudgetAccount, idle_since: float | None) -> object | None:
        """An idle connection of another account with `account`'s key (idle since
        `idle_since` or earlier, when given), moved with its slot."""
        for other in list(self._holders):  # a closed idle connection found frees its slot
            if other is not account and other.key == account.key and other.pool is not None:
                raw = other.pool.take_idle(idle_since)
                if raw is not None:
                    self._give_up(other)
                    self._grant(account)
                    return raw
        return None

    def _hand_off(self, account: BudgetAccount, raw: object) -> bool:
        line = self._hungry or self._fed
        if not line or next(iter(line)).key != account.key:
            return False
        self._give_up(account)
        receiver, waiter = self._pick()
        self._grant(receiver)
        waiter.granted, waiter.raw = True, raw
        waiter.event.set()
        return True

    def _grant(self, account: BudgetAccount) -> None:
        self._in_use += 1
        self._granted += 1
        account.held += 1
        self._holders[account] = None

    def _leave(self, account: BudgetAccount, waiter: _Waiter) -> None:
        account._line.remove(waiter)
        if not account._line:
            self._hungry.pop(account, None)
            self._fed.pop(account, None)

    def _release(self, account: BudgetAccount) -> None:
        self._give_up(account)
        self._hand_on()

    def _give_up(self, account: BudgetAccount) -> None:
        account.held -= 1
        self._in_use -= 1
        if account.held == 0:
            del self._holders[account]
            if account in self._fed:  # it waits and now holds nothing
                del self._fed[account]
                self._hungry[account] = None

    def _overdraw(self, account: BudgetAccount) -> None:
        if self._in_use >= self.size:
            self._overdrawn += 1
        self._grant(account)

    def _hand_on(self) -> None:
        """Give free slots to the callers in line, in turn (module docstring)."""
        while self._in_use < self.size and self.wanted():
            account, waiter = self._pick()
            self._grant(account)
            waiter.granted = True
            waiter.event.set()

    def _pick(self) -> tuple[BudgetAccount, _Waiter]:
        """The next caller in line (its account's next caller goes to the back)."""
        line = self._hungry or self._fed
        account = next(iter(line))
        del line[account]
        waiter = account._line.popleft()
        if account._line:  # it will hold a slot: its next caller waits among the fed
            self._fed[account] = None
        return account, waiter

    def _ask_for_idle(self) -> None:
        """Ask one account that keeps an idle connection to close it (its slot comes back)."""
        granted = self._granted
        for account in list(self._holders):
            if self._in_use < self.size or self._granted != granted:
                return  # a slot is free, or a closed idle connection found freed one (handed on)
            raw = account.pool.take_idle() if account.pool is not None else None
            if raw is not None:
                account.pool.discard(raw)
                return

    # -- telemetry ---------------------------------------------------------------------------
    def _sample(self, wait: float) -> None:
        self._longest = max(self._longest, wait)
        if len(self._waits) < MAX_WAIT_SAMPLES:
            self._waits.append(wait)

    def take_waits(self) -> list[float]:
        """The waits (seconds) of the acquisitions since the last call, in no order."""
        waits, self._waits = self._waits, []
        return waits

    def stats(self, new_period: bool = False) -> BudgetStats:
        """The budget's figures; `new_period` starts a new period for the longest wait."""
        now = trio.current_time()
        oldest = [account._line[0].since for line in (self._hungry, self._fed) for account in line]
        stats = BudgetStats(
            size=self.size, in_use=self._in_use, orgs_waiting=len(self._hungry) + len(self._fed),
            waiting=sum(len(account._line) for line in (self._hungry, self._fed)
                        for account in line),
            longest_wait_s=max([self._longest, *(now - since for since in oldest)]),
            granted=self._granted, overdrawn=self._overdrawn)
        if new_period:
            self._longest = 0.0
        return stats


_hosting: contextvars.ContextVar[ServerBudget | None] = contextvars.ContextVar(
    "runplane_connection_budget", default=None)


@contextlib.contextmanager
def hosting(budget: ServerBudget | None) -> Iterator[None]:
    """Tenants opened in the block (by this task and the tasks it starts) draw on `budget`."""
    token = _hosting.set(budget)
    try:
        yield
    finally:
        _hosting.reset(token)


def current_budget() -> ServerBudget | None:
    """The budget tenants opened here draw on (see `hosting`), None outside one."""
    return _hosting.get()


__all__ = ["ServerBudget", "BudgetAccount", "BudgetStats", "hosting", "current_budget"]
