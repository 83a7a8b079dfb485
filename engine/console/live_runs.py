"""The live runs list (server-sent events): the runs page's first page, kept current.

How it works
- `GET /ui/live/runs` takes the runs page's filters (`?play=`, `?state=`, `?org=` for a viewer
  of every org) and checks them as the page does (400 / 404 before anything is accepted). It then
  sends the newest runs as the page lists them (`runs` events: each run's play, id, state, epoch,
  start, duration and own figures), every `RUNS_INTERVAL_S`, for as long as its session lives.
- It is counted like a run's stream (`live`): against its org's `MAX_STREAMS` before the answer is
  accepted, given back when the answer ends; it ends with its session (logout, eviction, expiry)
  and when the server shuts down. An outage skips a tick instead of ending the stream.
- Each tick is one runs-list read (`queries.list_runs`: the runs and their run history, primary-
  key ranges, `LIMIT` 50), never a sheet read.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..canonical import JsonObject
from ..errors import EngineError
from .auth import COOKIE, Sessions, Viewer
from .live import _Counted, _rest

if TYPE_CHECKING:
    from .routes import _Handlers

RUNS_INTERVAL_S = 2.0
PING_S = 15

Listing = Callable[[], Awaitable[JsonObject]]


async def stream_runs(h: _Handlers, request: Request) -> Response:
    """`GET /ui/live/runs` (see the module docstring)."""
    from .routes import MAX_STREAMS, _run_json

    session_id = request.cookies.get(COOKIE) or ""

    async def render(viewer: Viewer) -> Response:
        first = await h._runs(request, viewer)  # the filters checked, the org the viewer's

        async def listing() -> JsonObject:
            got = await h._runs(request, viewer)
            return {"runs": [_run_json(run) for run in got.runs]}

        org = first.org or h.c.default_org
        ended = h.c.sessions.ended(session_id)
        if ended is None or h.c.streams[org] >= MAX_STREAMS:
            return JSONResponse({"error": "too many live streams", "code": "busy"}, 503)
        h.c.streams[org] += 1  # counted before the answer is accepted (no checkpoint since)

        def release() -> None:
            h.c.streams[org] -= 1
            if h.c.streams[org] <= 0:
                del h.c.streams[org]

        try:
            return _Counted(_ticks(listing, h.c.sessions, session_id, ended, h.c.closing),
                            release, ping=PING_S)
        except BaseException:
            release()
            raise
    return await h.guarded(request, True, render)


async def _ticks(listing: Listing, sessions: Sessions, session_id: str, ended: trio.Event,
                 closing: trio.Event) -> AsyncIterator[dict[str, str]]:
    while not closing.is_set():
        viewer = sessions.viewer(session_id)  # None once logged out, evicted or expired
        if viewer is None:
            return
        try:
            payload = await listing()
        except EngineError:  # an outage: skip this tick, the next one tries again
            payload = None
        if payload is not None:
            yield {"event": "runs", "data": json.dumps(payload)}
        await _rest(RUNS_INTERVAL_S, viewer.expires_at, ended, closing)
