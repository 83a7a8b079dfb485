"""A run's cancellation, as every process hosting its rows sees it.

How it works
- `runplane cancel`, the console and the gateway's `runs.cancel` action stamp the run
  (`engine.runs.cancel`). Each process of the run polls the stamp every `CANCEL_POLL_S` with
  `watch_for_cancel`, a system task of the run (the first poll comes one period after the run
  opened, so short runs never poll); a poll the store does not answer is skipped, not fatal.
  A map's history write answers the stamp too (`engine.runs.history.record_map`):
  `RunStop.heard` counts its answer as a poll, and no poll is sent while such a write is in
  flight (`RunStop.answering`). While a map's heartbeat runs (`RunStop.beat`), a poll that
  comes due is not sent: the watcher wakes the heartbeat instead (`nudge`), which writes at
  once, changed or not (one periodic request per run, not two, even when the heartbeat and
  the poll come due together).
  The poller is a system task (`watching_for_cancel`), so no nursery of the run waits for it.
- On a stamp, `RunStop.cancel` cancels the scope each running map's pipeline runs in: the calls
  in flight are cancelled (their rows are left, like a crash's, for the next run), what was
  computed is flushed as on Ctrl-C, and the map returns a result with `stopped_early` and
  `stop_reason = "cancelled"` — its history says the same. A map started after the stamp stops
  at once. The run itself ends terminally (retired: a cancelled run is finished, and a new run
  reuses every finished row); `Run.cancelled` tells the caller (`runplane run` exits 130).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Iterator

import attrs
import trio

from runplane.engine.errors import EngineError
from runplane.engine.ports import Port
from runplane.engine.runs.cancel import CANCEL_POLL_S, cancel_requested
from runplane.engine.values.scopes import RunScope

log = logging.getLogger("runplane.actors")

CANCELLED = "cancelled"  # the stop reason of a map stopped by a run's cancellation


@attrs.define(eq=False)
class RunStop:
    """Whether the run was cancelled, and the scopes that stop when it is."""

    reason: str | None = None
    heard_at: float = float("-inf")  # trio time the stamp was last read, by a poll or otherwise
    asking: int = 0  # requests in flight whose answer reads the stamp (`answering`)
    beating: int = 0  # maps' heartbeats running (`beat`): the watcher nudges one, not polls
    _scopes: set[trio.CancelScope] = attrs.field(factory=set, repr=False)
    _nudge: trio.Event = attrs.field(factory=trio.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        return self.reason is not None

    @contextlib.contextmanager
    def scope(self) -> Iterator[trio.CancelScope]:
        """A cancel scope that the run's cancellation cancels (at once if it came already)."""
        scope = trio.CancelScope()
        if self.cancelled:
            scope.cancel()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Around a request whose answer reads the stamp: while it is in flight the watcher
        does not poll (under load a request can take longer than a poll period)."""
        self.asking += 1
        try:
            yield
        finally:
            self.asking -= 1

    @contextlib.contextmanager
    def beat(self) -> Iterator[None]:
        """Around a map's heartbeat, which waits with `nudged`: while one runs, the watcher
        nudges it rather than poll."""
        self.beating += 1
        try:
            yield
        finally:
            self.beating -= 1

    def nudge(self) -> None:
        """Ask a heartbeat to write now: the stamp is due to be read."""
        self._nudge.set()

    async def nudged(self, pause: float) -> bool:
        """Wait `pause` seconds, or less when nudged; whether this caller took a nudge (one
        heartbeat takes each)."""
        with trio.move_on_after(pause):
            await self._nudge.wait()
        if not self._nudge.is_set():
            return False
        self._nudge = trio.Event()
        return True

    def heard(self, requested: bool) -> None:
        """The run's stamp was read just now (`requested`: it is set): the watcher's next poll
        waits a whole period from here."""
        self.heard_at = trio.current_time()
        if requested:
            log.warning("run cancelled; stopping its rows")
            self.cancel()

    def cancel(self, reason: str = CANCELLED) -> None:
        if self.reason is None:
            self.reason = reason
        for scope in self._scopes:
            scope.cancel()


@contextlib.contextmanager
def watching_for_cancel(port: Port, scope: RunScope, stop: RunStop) -> Iterator[None]:
    """`watch_for_cancel` for the duration of the block, in a system task: the block's own
    nurseries never wait for it (a cancellation arriving as a run's body returns must land
    where it did before, not in a nursery waiting for the watcher), and it ends with the block."""
    poller = trio.CancelScope()

    async def poll() -> None:
        with poller:
            try:
                await watch_for_cancel(port, scope, stop)
            except Exception:  # a system task must not raise: the run goes on unwatched
                log.exception("run %s: the cancellation watch failed", scope.run_id)

    trio.lowlevel.spawn_system_task(poll, name=f"cancel-watch {scope.run_id}",
                                    context=contextvars.copy_context())
    try:
        yield
    finally:
        poller.cancel()


async def watch_for_cancel(port: Port, scope: RunScope, stop: RunStop, *,
                           poll_s: float = CANCEL_POLL_S) -> None:
    """Poll the run's cancellation stamp until it is set, then stop the run's maps: a period
    after the stamp was last read (by this poll or by another request that answers it)."""
    stop.heard_at = max(stop.heard_at, trio.current_time())  # the first poll: a period from now
    while not stop.cancelled:
        due = stop.heard_at + poll_s
        if trio.current_time() < due:
            await trio.sleep_until(due)
            continue  # read meanwhile by a map's history write: wait from then
        if stop.asking or stop.beating:  # a write reads it: in flight, or a heartbeat's now
            if not stop.asking:
                stop.nudge()
            stop.heard_at = trio.current_time()
            continue
        try:
            requested = await cancel_requested(port, scope)
        except EngineError as exc:  # the store is away: the run's own calls ride it out
            log.debug("run %s: cancellation poll failed: %s", scope.run_id, exc)
            stop.heard_at = trio.current_time()  # try again a period later
            continue
        stop.heard(requested)
