"""Instrumented ports: see, count, pause or disturb every checkout and query of an engine call.

How it works
- `HookedPort(inner, hook)` is a `PortWrapper`: the port `inner` (a `Tenant` or another port).
  Before each connection checkout it awaits `hook.at_boundary(Boundary("checkout", ...))`, and
  on the connection it yields it installs a `statement_hook` (the public hook of
  `engine.pg.Connection`) that awaits `hook.at_boundary(Boundary("query", ...))` before every
  statement — BEGIN, COMMIT, SAVEPOINT and RELEASE included. What the hook raises
  (a transient error, `trio.Cancelled` from a cancelled scope) surfaces exactly where a real
  fault would; a query hook that returns `LOSE_REPLY` lets the statement run and then drops the
  connection, so the caller sees `StoreUnavailableError` for a statement that took effect.
- Hooks chain: an outer port's hook runs first and then calls the inner port's, so wrappers nest
  (`GatedPort(CountingPort(tenant))` both gates and counts). A cancelled statement or an
  injected connection loss marks the one shared connection broken, so the tenant closes it
  instead of pooling it.
- Three hooks ship here: `CountingPort` (records every boundary: round trips per call, for the
  tests that bound them), `GatedPort` (parks the n-th matching boundary until the test releases
  it: deterministic races), and `simulations.faults.FaultyPort` (hypothesis-drawn faults).
- Give each concurrent actor its own wrapper around one shared tenant: counters and gates are
  then per actor, and what an actor sees does not depend on how the others are scheduled.

Only tests, simulations and benchmarks use this module; engine code never does.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Protocol

import attrs
import trio

from runplane.engine import pg
from runplane.engine.errors import StoreUnavailableError
from runplane.engine.ports import Port, PortWrapper

BoundaryKind = Literal["checkout", "query"]


@attrs.frozen
class Boundary:
    """One point where a hook runs: a checkout on `lane`, or a statement `sql` on a checkout.

    `checkout` is the 1-based index of the checkout through this port; `query` the 1-based index
    of the statement through this port (0 at a checkout boundary).
    """

    kind: BoundaryKind
    lane: str
    checkout: int
    query: int = 0
    sql: str | None = None


LOSE_REPLY = "lose_reply"


class Hook(Protocol):
    async def at_boundary(self, boundary: Boundary) -> str | None:
        """Run at a boundary. At a query boundary, returning `LOSE_REPLY` lets the statement run
        and then drops the connection before the caller sees the reply (as a network cut after
        the server answered: the statement took effect, the caller gets
        `StoreUnavailableError`)."""


@attrs.define(eq=False)
class HookedPort(PortWrapper):
    """A port that is `inner` but runs `hook` at every checkout and statement."""

    hook: Hook
    checkouts: int = attrs.field(init=False, default=0)
    queries: int = attrs.field(init=False, default=0)

    @contextlib.asynccontextmanager
    async def connection(self, lane: str) -> AsyncIterator[pg.Connection]:
        self.checkouts += 1
        checkout = self.checkouts
        await self._boundary("checkout", lane, checkout, None)
        async with self.inner.connection(lane) as conn:
            inner_hook = conn.statement_hook

            async def hook(sql: str, send: Callable[[], Awaitable[Any]]) -> Any:
                try:
                    verdict = await self._boundary("query", lane, checkout, sql)
                except StoreUnavailableError:
                    conn.close()  # an injected connection loss: gone, as after a network cut
                    raise
                # Through the inner port's hook, so wrappers compose (a gate around a counter).
                result = await (inner_hook(sql, send) if inner_hook is not None else send())
                if verdict == LOSE_REPLY:
                    conn.close()
                    raise StoreUnavailableError("injected fault: connection lost before the reply")
                return result

            conn.statement_hook = hook
            try:
                yield conn
            finally:
                conn.statement_hook = inner_hook

    async def _boundary(self, kind: BoundaryKind, lane: str, checkout: int, sql: str | None) -> str | None:
        if kind == "query":
            self.queries += 1
        boundary = Boundary(kind, lane, checkout, self.queries if kind == "query" else 0, sql)
        return await self.hook.at_boundary(boundary)


# -- counting ----------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Recorder:
    boundaries: list[Boundary] = attrs.field(factory=list)

    async def at_boundary(self, boundary: Boundary) -> None:
        self.boundaries.append(boundary)


class CountingPort(HookedPort):
    """Records every checkout and statement. `reset()` between the calls you want to measure.

    `round_trips` counts statements sent (BEGIN, COMMIT and savepoints included).
    """

    def __init__(self, inner: Port) -> None:
        super().__init__(inner, _Recorder())

    @property
    def boundaries(self) -> list[Boundary]:
        return self.hook.boundaries

    @property
    def statements(self) -> list[str]:
        return [b.sql or "" for b in self.hook.boundaries if b.kind == "query"]

    @property
    def round_trips(self) -> int:
        return len(self.statements)

    @property
    def checkout_count(self) -> int:
        return sum(1 for b in self.hook.boundaries if b.kind == "checkout")

    def reset(self) -> None:
        self.hook.boundaries.clear()


# -- gates -------------------------------------------------------------------------------------


@attrs.define(eq=False)
class Gate:
    """Parks the boundary it matches: `reached` is set when a task arrives, and the task waits
    until `release()`. A gate fires once."""

    matches: Callable[[Boundary], bool]
    reached: trio.Event = attrs.field(factory=trio.Event)
    released: trio.Event = attrs.field(factory=trio.Event)
    boundary: Boundary | None = None

    def release(self) -> None:
        self.released.set()

    async def wait_reached(self) -> Boundary:
        await self.reached.wait()
        assert self.boundary is not None
        return self.boundary


@attrs.define(eq=False)
class _Gates:
    gates: list[Gate] = attrs.field(factory=list)

    async def at_boundary(self, boundary: Boundary) -> None:
        for gate in self.gates:
            if not gate.reached.is_set() and gate.matches(boundary):
                gate.boundary = boundary
                gate.reached.set()
                await gate.released.wait()


class GatedPort(HookedPort):
    """Pauses chosen boundaries until the test releases them, to force one interleaving.

        port = GatedPort(tenant)
        gate = port.gate_checkout(2)          # the second checkout through this port
        nursery.start_soon(seal, port, ...)
        await gate.wait_reached()             # the sealer is parked before that checkout
        ...                                   # race something against it
        gate.release()
    """

    def __init__(self, inner: Port) -> None:
        super().__init__(inner, _Gates())

    def gate(self, matches: Callable[[Boundary], bool]) -> Gate:
        gate = Gate(matches)
        self.hook.gates.append(gate)
        return gate

    def gate_checkout(self, n: int) -> Gate:
        """Park before the `n`-th checkout (1-based) through this port."""
        return self.gate(lambda b: b.kind == "checkout" and b.checkout == n)

    def gate_query(self, n: int) -> Gate:
        """Park before the `n`-th statement (1-based) through this port."""
        return self.gate(lambda b: b.kind == "query" and b.query == n)
