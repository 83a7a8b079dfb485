"""The live stream of a run (server-sent events): progress while the session that opened it lives.

How it works
- `open_stream` counts the stream against its org's cap (`MAX_STREAMS`) before it answers:
  the check and the count happen with no checkpoint between them, so a burst of opens gets
  exactly the cap and the rest 503. The count is released when the answer ends, however it ends
  (`_Counted.__call__`), whether or not the stream ever sent an event.
- The stream reads the play's counters once per `LIVE_INTERVAL_S` while the run is open
  (`IDLE_INTERVAL_S` after) and sends each table's counters, its rows per second over the last
  minute (from the samples this stream took) and an ETA.
- It ends when its session ends: logout or eviction set the session's `ended` event, which wakes
  the stream at once; the session's expiry (a token's `exp`) bounds every pause, and each tick
  checks the session again. It also ends when the server shuts down (`Console.closing`).
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any, Callable

import trio
from sse_starlette import EventSourceResponse

from ..errors import EngineError
from ..ports import Port
from . import queries
from .auth import Sessions

LIVE_INTERVAL_S = 1.0  # while the run is open
IDLE_INTERVAL_S = 5.0  # once it is retiring or done
RATE_WINDOW = 61  # samples kept per table: one minute of per-second rates
PING_S = 15


class _Counted(EventSourceResponse):
    """A stream whose slot in its org's count is given back when the answer ends."""

    def __init__(self, content: Any, release: Callable[[], None], **options: Any) -> None:
        super().__init__(content, **options)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
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
                    ended: trio.Event, closing: trio.Event) -> Any:
    history: dict[str, collections.deque] = {}
    while not closing.is_set():
        viewer = sessions.viewer(session_id)  # None once logged out, evicted or expired
        if viewer is None:
            return
        try:
            now, tables = await queries.live(port, run.org_id, run.play, run.run_id)
        except EngineError:  # an outage: skip this tick, the next one tries again
            await _rest(LIVE_INTERVAL_S, viewer.expires_at, ended, closing)
            continue
        now = now or run
        at = trio.current_time()
        payload: dict[str, Any] = {"state": now.state, "duration_s": now.duration_s, "tables": []}
        for t in tables:
            samples = history.setdefault(t.namespace, collections.deque(maxlen=RATE_WINDOW))
            samples.append((at, t.done))
            payload["tables"].append(_live_table(t, samples))
        yield {"event": "progress", "data": json.dumps(payload)}
        pause = LIVE_INTERVAL_S if now.state == "open" else IDLE_INTERVAL_S
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


def _live_table(t: queries.TableCounters, samples: collections.deque) -> dict[str, Any]:
    points = list(samples)
    series = [max(0.0, (b[1] - a[1]) / (b[0] - a[0])) if b[0] > a[0] else 0.0
              for a, b in zip(points, points[1:])]
    span = points[-1][0] - points[0][0]
    rate = (points[-1][1] - points[0][1]) / span if span > 0 else 0.0
    remaining = max(0, t.total - t.done)
    eta = remaining / rate if rate > 0 and remaining else (0.0 if not remaining else None)
    return {"table": t.namespace, "total": t.total, "queued": t.queued, "running": t.running,
            "completed": t.completed, "failed": t.failed, "rate": round(rate, 2),
            "eta_s": None if eta is None else round(eta, 1),
            "series": [round(v, 2) for v in series]}
