"""Every interleaving of a few sessions' statements, PostgreSQL isolation-tester style.

How it works
- A `Session` is a name and a program: an async function that runs engine calls through the
  port it is given (its own connections, checked out as the calls do). The port is a
  `HookedPort` whose statement hook parks the session before each of its *steps* — a statement
  its `is_step` predicate picks (by default every statement but BEGIN and the transaction's
  `set_config` prelude, which take no locks) — until the scheduler grants it.
- `step_counts(...)` runs each session alone (on its own fresh state) and counts its steps;
  `interleavings(counts)` yields every distinct order of those steps (a multiset permutation:
  for two sessions of a and b steps, C(a+b, a) of them).
- `run_interleaving(...)` plays one order: it grants the scheduled session one step, then waits
  until every session has settled — parked before its next step, finished, or *blocked*: its
  statement waits on a lock another session holds, as the server says
  (`pg_isolation_test_session_is_blocked`, the function isolationtester uses). When the
  scheduled session is blocked, the next scheduled step of a session that is not blocked runs
  instead (the schedule is marked `reordered`), so a lock wait lets the other session proceed
  rather than deadlocking the test; a deadlock is broken by the server's detector (one session
  gets an error). Steps beyond the counted ones (a retry) run after the schedule; a session that
  takes fewer steps simply skips its remaining slots.
- The result of each interleaving (`Played`): the order steps were granted in, each session's
  return value or exception, and whether a lock wait reordered it. Tests check each against the
  outcomes the spec allows.

Only tests use this module.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import AsyncIterator, Awaitable, Callable, Iterator, Literal, Mapping, Sequence

import attrs
import trio

from runplane.engine import open_tenant
from runplane.engine.pg import Connection
from runplane.engine.ports import Port

from .ports import Boundary, HookedPort

SETTLE_POLL_S = 0.002  # how often a running statement is checked for a lock wait
_PRELUDE = ("BEGIN", "SELECT SET_CONFIG(")


def default_step(sql: str) -> bool:
    """Every statement is a step but BEGIN and the `set_config` prelude of a transaction."""
    return not sql.lstrip().upper().startswith(_PRELUDE)


@attrs.frozen
class Session:
    name: str
    program: Callable[[Port], Awaitable[object]]
    is_step: Callable[[str], bool] = default_step


State = Literal["starting", "parked", "running", "done"]


@attrs.define(eq=False)
class _Live:
    """One session being played: its state, its gate, its server process."""

    session: Session
    changed: Callable[[], None]
    state: State = "starting"
    grant: trio.Event = attrs.field(factory=trio.Event)
    pid: int | None = None
    parked_sql: str | None = None
    steps: int = 0
    result: object = None
    error: BaseException | None = None

    async def at_boundary(self, boundary: Boundary) -> None:
        if boundary.kind != "query" or not self.session.is_step(boundary.sql or ""):
            return
        self.state, self.parked_sql = "parked", boundary.sql
        self.changed()
        await self.grant.wait()
        self.grant = trio.Event()
        self.state = "running"
        self.steps += 1

    async def play(self, port: Port) -> None:
        try:
            self.result = await self.session.program(_SessionPort(port, self))
        except Exception as exc:  # an outcome to judge, not a test failure
            self.error = exc
        finally:
            self.state = "done"
            self.changed()


class _SessionPort(HookedPort):
    """Parks its session before each step; remembers the server pid of its connection."""

    def __init__(self, inner: Port, live: _Live) -> None:
        super().__init__(inner, live)

    @contextlib.asynccontextmanager
    async def connection(self, lane: str) -> AsyncIterator[Connection]:
        async with super().connection(lane) as conn:
            self.hook.pid = conn.backend_pid
            yield conn


@attrs.frozen
class Played:
    """One interleaving played: the schedule, the order steps ran in, what each session got."""

    schedule: tuple[str, ...]
    granted: tuple[tuple[str, str], ...]  # (session, statement) in grant order
    reordered: bool
    results: Mapping[str, object]
    errors: Mapping[str, BaseException | None]

    def first_grant(self, session: str, prefix: str = "") -> int:
        """Index in `granted` of the session's first step whose statement starts with `prefix`
        (whitespace-insensitive), or len(granted) if none."""
        for i, (name, sql) in enumerate(self.granted):
            if name == session and sql.lstrip().startswith(prefix):
                return i
        return len(self.granted)


def interleavings(counts: Mapping[str, int]) -> Iterator[tuple[str, ...]]:
    """Every distinct order of `counts[name]` steps of each session (multiset permutations)."""
    names = list(counts)
    total = sum(counts.values())

    def place(remaining: list[str], slots: tuple[int, ...], order: list[str | None]):
        if not remaining:
            yield tuple(order)  # type: ignore[arg-type]
            return
        name, rest = remaining[0], remaining[1:]
        for chosen in itertools.combinations(slots, counts[name]):
            filled = list(order)
            for slot in chosen:
                filled[slot] = name
            yield from place(rest, tuple(s for s in slots if s not in chosen), filled)

    yield from place(names, tuple(range(total)), [None] * total)


@attrs.define(eq=False)
class Interleaver:
    """Plays schedules of sessions against one tenant, with a monitor connection of its own."""

    tenant: Port
    monitor: Port

    async def step_counts(self, sessions: Sequence[Session]) -> dict[str, int]:
        """Each session's steps when it runs alone."""
        counts = {}
        for session in sessions:
            played = await self.play([session], (), free=True)
            if played.errors[session.name] is not None:
                raise played.errors[session.name]  # type: ignore[misc]
            counts[session.name] = len(played.granted)
        return counts

    async def play(self, sessions: Sequence[Session], schedule: Sequence[str], *,
                   free: bool = False) -> Played:
        """Play `schedule` (session names, one per step); with `free`, grant steps in any order
        until every session is done (used alone, to count steps)."""
        changed = trio.Event()

        def notify() -> None:
            nonlocal changed
            changed.set()
            changed = trio.Event()

        lives = {s.name: _Live(s, notify) for s in sessions}
        granted: list[tuple[str, str]] = []
        reordered = False
        queue = list(schedule)
        async with trio.open_nursery() as nursery:
            for live in lives.values():
                nursery.start_soon(live.play, self.tenant)
            while True:
                wait_for = changed
                blocked = await self._settle(lives)
                parked = [n for n, live in lives.items() if live.state == "parked"]
                if not parked:
                    if all(live.state == "done" for live in lives.values()):
                        break
                    await wait_for.wait()  # all blocked (a deadlock the server will break)
                    continue
                queue = [n for n in queue if lives[n].state != "done"]
                pick = next((n for n in queue if lives[n].state == "parked"), None)
                if pick is None:
                    pick = parked[0]  # past the schedule: extra steps, or `free`
                elif queue[0] != pick:
                    reordered = reordered or queue[0] in blocked
                if pick in queue:
                    queue.remove(pick)
                live = lives[pick]
                granted.append((pick, live.parked_sql or ""))
                live.state = "running"
                live.grant.set()
        return Played(tuple(schedule), tuple(granted), reordered,
                      {n: live.result for n, live in lives.items()},
                      {n: live.error for n, live in lives.items()})

    async def _settle(self, lives: Mapping[str, _Live]) -> set[str]:
        """Wait until no session is running a statement that is not blocked; return the names
        of the blocked ones."""
        while True:
            running = [n for n, live in lives.items() if live.state in ("starting", "running")]
            if not running:
                return set()
            blocked = await self._blocked(lives, running)
            if len(blocked) == len(running):
                return blocked
            await trio.sleep(SETTLE_POLL_S)

    async def _blocked(self, lives: Mapping[str, _Live], running: list[str]) -> set[str]:
        pids = {n: live.pid for n, live in lives.items() if live.pid is not None}
        candidates = [n for n in running if lives[n].state == "running" and n in pids]
        if not candidates:
            return set()
        out = set()
        async with self.monitor.connection("receipts") as conn:
            for name in candidates:
                others = [pid for other, pid in pids.items() if other != name]
                if others and await conn.fetchval(
                        "SELECT pg_isolation_test_session_is_blocked($1, $2::int[])",
                        pids[name], others):
                    out.add(name)
        return out


@contextlib.asynccontextmanager
async def open_interleaver(tenant: Port, dsn: str) -> AsyncIterator[Interleaver]:
    """An interleaver over `tenant`, watching lock waits through a pool of its own."""
    async with open_tenant(tenant.org_id, dsn, schema=tenant.schema) as monitor:
        yield Interleaver(tenant, monitor)
