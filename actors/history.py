"""A map's entry in the run history (`engine.runs.history`), written while it runs and when it ends.

How it works
- `MapRecorder` belongs to one `run.map`. It sees every progress snapshot of the map (a cheap
  assignment), and its **heartbeat** task, started in the run's nursery, writes the latest
  one about every `HEARTBEAT_S` seconds while it changed (less often while the store is slow to
  answer, see `heartbeat`; unchanged, when it stands in for the run's cancellation poll) (state
  `running`; `running` is the rows
  inside a call of the function when it was written, as everywhere: `engine.runs.row_calls`). When the map returns, `finish` writes its final counts (`finished`,
  `stopped_early` or `superseded`, ended when the map returned) in the run's nursery, so the
  caller of `run.map` does not wait for a record (the run's exit does); a map that raised is written as `failed` (unless the store
  is away: then, like a crash, it is left to the wake). A map cancelled in its process (Ctrl-C,
  SIGTERM) writes once more when it has flushed what it computed (`interrupted`): the counts
  that are then durable, with nothing running, so its `completed` is what a rerun finds cached;
  its state is then `interrupted` at once (a crash leaves `running`, read as interrupted once
  it stops being written), and a wake that runs the map again replaces it. A crash writes nothing more.
- A heartbeat write under way when the map ends is finished, not cancelled (a cancelled
  statement costs its connection); the store never lets a `running` write replace the ended
  entry of the same map call, so it may land after the last entry (`engine.runs.history`).
- History is a record, never a reason to fail: a write that fails is logged and dropped (the
  next heartbeat or a later run writes again). Each write also answers whether the run was
  asked to cancel, which the run's `RunStop` takes as its cancellation poll. The final write is shielded with a short
  deadline so a map that just ended is recorded even as its run is being cancelled.
"""

from __future__ import annotations

import contextlib
import datetime
import logging

import attrs
import trio

from runplane.engine.canonical import JsonObject
from runplane.engine.runs import history
from runplane.engine.runs.cancel import CANCEL_POLL_S
from runplane.engine.runs.history import MapRunState
from runplane.engine.runs.outages import record_outages
from runplane.engine.errors import EngineError
from runplane.engine.ports import Port
from runplane.engine.values.scopes import RunScope

from .cancellation import RunStop
from .progress import MapProgress, MapResult
from .retry import ENDING_ATTEMPT_S, current_watch, hurry_if_waiting

log = logging.getLogger("runplane.actors")

HEARTBEAT_S = 1.0
# At most the cancellation poll period: a busy map's heartbeat is then its run's poll (the
# watcher nudges it when the poll comes due first), one request a period, not two.
MAX_HEARTBEAT_S = CANCEL_POLL_S
FINAL_DEADLINE_S = 5.0


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@attrs.define(eq=False)
class MapRecorder:
    port: Port
    scope: RunScope
    map_key: str
    table_namespace: str
    spec: JsonObject | None = None  # what a retry of the table runs (`engine.runs.retry_spec`)
    spec_written: bool = False  # the spec goes with the first write that lands, not every one
    stop: RunStop | None = None  # the run's cancellation: each write answers its stamp
    started_at: datetime.datetime = attrs.field(factory=now)
    latest: MapProgress | None = None
    _beating: trio.CancelScope | None = attrs.field(init=False, default=None, repr=False)
    written: MapProgress | None = None

    def observe(self, snapshot: MapProgress) -> None:
        self.latest = snapshot

    def _record(self, state: MapRunState, snapshot: MapProgress | None, *, ended: bool = False,
                stop_reason: str | None = None) -> history.MapRecord:
        counts: dict[str, int] = {}
        if snapshot is not None:
            counts = {name: getattr(snapshot, name) for name in (
                "source_rows", "admitted", "cached", "completed", "failed", "blocked", "retried")}
            counts["running"] = snapshot.in_call if state == MapRunState.RUNNING else 0
        return history.MapRecord(self.map_key, self.table_namespace, state, self.started_at,
                                 now() if ended else None, stop_reason=stop_reason,
                                 spec=None if self.spec_written else self.spec, **counts)

    async def _write(self, record: history.MapRecord, level: int = logging.DEBUG) -> None:
        try:
            if self.stop is None:
                await history.record_map(self.port, self.scope, record)
            else:
                with self.stop.answering():
                    requested = await history.record_map(self.port, self.scope, record)
                self.stop.heard(requested)
            self.spec_written = self.spec_written or record.spec is not None
        except EngineError as exc:  # the next heartbeat, or a later run, writes again
            log.log(level, "run %s: map %s: run history not written: %s",
                    self.scope.run_id, self.table_namespace, exc)

    async def heartbeat(self) -> None:
        """Write the latest snapshot while it changes, until cancelled: every `HEARTBEAT_S`,
        or, when the store is slow to answer (a busy gateway or server), twice as long as the
        last write took (at most `MAX_HEARTBEAT_S`): history never takes more than a third of
        the store's time for a map, and a loaded server is not loaded more by its history.
        Unchanged, it writes when the run's cancellation watcher nudges it (the stamp is due
        to be read): while it runs, the watcher sends no poll of its own (`RunStop.beat`). A
        write under way when the map ends is finished (within `ENDING_ATTEMPT_S`, `ending`), not
        cancelled: that would cost its connection, and the store keeps the map's last entry
        over it (`engine.runs.history`)."""
        with contextlib.nullcontext() if self.stop is None else self.stop.beat():
            self.written = self.latest
            await self._beat(self._record(MapRunState.RUNNING, self.latest))
            pause = HEARTBEAT_S
            while True:
                nudged = await self._wait(pause)
                changed = self.latest is not None and self.latest != self.written
                if changed or nudged:
                    self.written = self.latest
                    started = trio.current_time()
                    await self._beat(self._record(MapRunState.RUNNING, self.latest))
                    took = trio.current_time() - started
                    pause = min(MAX_HEARTBEAT_S, max(HEARTBEAT_S, 2 * took))
                await self._write_outages()

    async def _wait(self, pause: float) -> bool:
        """Sleep `pause` seconds, or less when the run's watcher nudges the heartbeat; whether
        it did."""
        if self.stop is None:
            await trio.sleep(pause)
            return False
        return await self.stop.nudged(pause)

    async def _beat(self, record: history.MapRecord) -> None:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + FINAL_DEADLINE_S) \
                as scope, hurry_if_waiting():
            self._beating = scope
            try:
                await self._write(record)
            finally:
                self._beating = None

    def ending(self, heartbeat: trio.CancelScope) -> None:
        """The map ended: cancel its `heartbeat`; a heartbeat write under way gets at most
        `ENDING_ATTEMPT_S` more. A store that answers finishes it; one that is away (a write
        hanging on a dead connection) does not hold the map's end past its budget."""
        if self._beating is not None:
            self._beating.deadline = min(self._beating.deadline,
                                         trio.current_time() + ENDING_ATTEMPT_S)
        heartbeat.cancel()

    async def _write_outages(self) -> None:
        """The run's outages ridden out since the last write, for its timeline."""
        watch = current_watch()
        outages = [] if watch is None else watch.take_ended()
        if not outages:
            return
        try:
            await record_outages(self.port, self.scope, outages)
        except EngineError as exc:  # written with the next ones
            watch.give_back(outages)
            log.debug("run %s: outages not written: %s", self.scope.run_id, exc)

    async def finish(self, result: MapResult | None, state: MapRunState | None = None,
                     ended_at: datetime.datetime | None = None) -> None:
        """The map's last entry: its result's counts, or `state` (`failed`) with the last
        snapshot's; ended `ended_at` (default now: a caller writing it later passes when the
        map returned)."""
        if result is not None:
            state = (MapRunState.STOPPED_EARLY if result.stopped_early else
                     MapRunState.SUPERSEDED if result.superseded else MapRunState.FINISHED)
            snapshot = self.latest
            record = history.MapRecord(
                self.map_key, self.table_namespace, state, self.started_at, ended_at or now(),
                source_rows=snapshot.source_rows if snapshot is not None else result.admitted,
                admitted=result.admitted, cached=result.cached, completed=result.completed,
                failed=result.failed, blocked=result.blocked, retried=result.retried,
                stop_reason=result.stop_reason, spec=None if self.spec_written else self.spec)
        else:
            record = self._record(state or MapRunState.FAILED, self.latest, ended=True)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + FINAL_DEADLINE_S):
            await self._write(record, logging.WARNING)
            await self._write_outages()

    async def interrupted(self) -> None:
        """The map was cancelled and has flushed its computed outcomes: write its last counts
        with nothing running (shielded, within `FINAL_DEADLINE_S`; skipped while the run waits
        for the database, which a crash's entry is left to as well)."""
        record = attrs.evolve(self._record(MapRunState.INTERRUPTED, self.latest), running=0)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + FINAL_DEADLINE_S), \
                hurry_if_waiting() as waiting:
            if not waiting:
                await self._write(record, logging.WARNING)
