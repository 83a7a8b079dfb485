"""The live stream of a run (server-sent events): progress while the session that opened it lives.

How it works
- `open_stream` counts the stream against its org's cap (`MAX_STREAMS`) before it answers:
  the check and the count happen with no checkpoint between them, so a burst of opens gets
  exactly the cap and the rest 503. The count is released when the answer ends, however it ends
  (`_Counted.__call__`), whether or not the stream ever sent an event.
- The stream reads, in one snapshot, the run, what each of its maps did so far (its run
  history, `figures`) and its play's counters, once per `LIVE_INTERVAL_S` while the run is open
  (`IDLE_INTERVAL_S` after). For each table the run mapped it sends the run's own figures
  (admitted, cached, completed, failed, retried), the map's state, the rows of the table running
  now (the sheet's counter, any run), and its rows per second over the last minute with an ETA
  (`rates`: from the run's own completions as its history wrote them, so never negative; the
  chart keeps its last minute once the map stops being written).
- It ends when its session ends: logout or eviction set the session's `ended` event, which wakes
  the stream at once; the session's expiry (a token's `exp`) bounds every pause, and each tick
  checks the session again. It also ends when the server shuts down (`Console.closing`).
"""

from __future__ import annotations

import collections
import json
import time
from typing import AsyncIterator, Callable

import trio
from sse_starlette import EventSourceResponse
from sse_starlette.sse import ContentStream
from starlette.types import Receive, Scope, Send

from ..canonical import JsonObject
from ..errors import EngineError
from ..observability import metrics
from ..ports import Port
from ..runs.outbox import OutboxState
from . import queries, rates
from .words import SHEET_COUNTERS
from .auth import Sessions
from .figures import MapFigures

LIVE_INTERVAL_S = 1.0  # while the run is open
IDLE_INTERVAL_S = 5.0  # once it is retiring or done
PING_S = 15


class _Counted(EventSourceResponse):
    """A stream whose slot in its org's count is given back when the answer ends."""

    def __init__(self, content: ContentStream, release: Callable[[], None], *,
                 ping: float) -> None:
        super().__init__(content, ping=ping)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics.CONSOLE_STREAMS.inc()
        try:
            await super().__call__(scope, receive, send)
        finally:
            metrics.CONSOLE_STREAMS.dec()
            self._release()


def open_stream(streams: collections.Counter, cap: int, sessions: Sessions, session_id: str,
                closing: trio.Event, port: Port, run: queries.RunRow) -> EventSourceResponse | None:
    """The stream's answer, counted against `run`'s org from now on; None when the org already
    has `cap` streams open or the session has ended."""
    ended = sessions.ended(session_id)
    if ended is None or streams[run.org_id] >= cap:
        return None
    streams[run.org_id] += 1  # counted before the answer is accepted: no checkpoint since the check

    def release() -> None:
        streams[run.org_id] -= 1
        if streams[run.org_id] <= 0:
            del streams[run.org_id]

    try:
        return _Counted(_progress(port, run, sessions, session_id, ended, closing), release,
                        ping=PING_S)
    except BaseException:
        release()
        raise


async def _progress(port: Port, run: queries.RunRow, sessions: Sessions, session_id: str,
                    ended: trio.Event, closing: trio.Event) -> AsyncIterator[dict[str, str]]:
    windows: dict[str, rates.RateWindow] = {}
    while not closing.is_set():
        viewer = sessions.viewer(session_id)  # None once logged out, evicted or expired
        if viewer is None:
            return
        try:
            tick = await queries.live(port, run.org_id, run.play, run.run_id)
        except EngineError:  # an outage: skip this tick, the next one tries again
            await _rest(LIVE_INTERVAL_S, viewer.expires_at, ended, closing)
            continue
        now = tick.run or run
        payload: JsonObject = {"state": now.state.word, "duration_s": now.duration_s,
                               "tables": [_live_table(m, tick.counters.get(m.namespace),
                                                      windows, tick.now) for m in tick.maps]}
        yield {"event": "progress", "data": json.dumps(payload)}
        pause = LIVE_INTERVAL_S if now.state is OutboxState.OPEN else IDLE_INTERVAL_S
        await _rest(pause, viewer.expires_at, ended, closing)


async def _rest(seconds: float, expires_at: float, *events: trio.Event) -> None:
    """Sleep `seconds`, or until the session expires, or until one of `events` is set."""
    async def until(event: trio.Event, scope: trio.CancelScope) -> None:
        await event.wait()
        scope.cancel()

    with trio.move_on_after(max(0.0, min(seconds, expires_at - time.time()))):
        async with trio.open_nursery() as nursery:
            for event in events:
                nursery.start_soon(until, event, nursery.cancel_scope)


def _live_table(mine: MapFigures, sheet: queries.TableCounters | None,
                windows: dict[str, rates.RateWindow], now: float | None) -> JsonObject:
    """One table's part of a tick: the run's own figures, its rate (sampled into `windows`),
    ETA and chart, and the rows of the table running now."""
    window = windows.setdefault(mine.namespace, rates.RateWindow())
    window.add(mine.written_at, mine.figures.outcomes)
    rate = window.rate(mine.written_at if now is None else now)
    eta = rates.eta_s(mine.figures.remaining, rate)
    return {"table": mine.namespace, "map_state": mine.state, **mine.figures.as_dict(),
            "running": None if sheet is None else sheet.running,
            "sheet": None if sheet is None else {name: getattr(sheet, name)
                                                 for name in SHEET_COUNTERS},
            "rate": round(rate, 2), "eta_s": None if eta is None else round(eta, 1),
            "series": [round(v, 2) for v in window.series()]}
