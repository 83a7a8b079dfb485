"""The console's HTTP routes under `/ui/`: pages, data endpoints, the live stream, login.

How it works
- `console_app(console)` is an ASGI application meant to be mounted at `/ui` (the gateway mounts
  it next to its actions; `runplane console` serves it alone). Every answer carries a
  Content-Security-Policy that allows scripts, styles and connections from the console's own
  origin only (no inline script or style), `nosniff`, no framing and no caching, plus a
  `Server-Timing: app;dur=MS` header: the time the console took to produce the answer.
- Routes match the path with each segment percent-encoded whole (`params.encoded_path`), so a
  play or run id holding `/` (`%2F` in every link the console renders) is one segment.
- Without a valid session cookie, a page redirects to `/ui/login` and a data endpoint (`/ui/api/…`,
  `/ui/live/…`) answers 401: neither reads anything. With one, every parameter is checked
  (`params`: no NUL, bounded, epochs and cursors in range; else 400), then the org a request
  names (the viewer's own, or `?org=` for a viewer of every org), its play and, for a session
  of a run-scoped token, its run are checked against the viewer before any query; what the
  viewer may not see answers 404, exactly like what does not exist, so a page never tells
  another org's names apart from made-up ones. Listings show only what the viewer sees.
- The login routes (`/ui/login`, `/ui/logout`) are `login`'s; the action POSTs
  (`/ui/runs/<play>/<run_id>/cancel`) are `actions`' and are checked there (session, form token,
  action claim) before they write.
- The live stream (`/ui/live/runs/<play>/<run_id>`, see `live`): at most `MAX_STREAMS` per
  org at once, counted before the stream is accepted (one org's open pages cannot take
  another's streams); each ends with its session or when the server shuts down.
"""

from __future__ import annotations

import collections
import functools
import logging
from importlib import resources
from typing import Awaitable, Callable

import attrs
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (HTMLResponse, JSONResponse, RedirectResponse, Response,
                                 StreamingResponse)
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..canonical import JsonObject
from ..errors import EngineError, MissingRelationError, SchemaNotFoundError
from ..ports import Port
from ..runs.outbox import OutboxState
from ..sheets.model import RowStatus
from ..values.scopes import PlayScope, RunScope, normalize_namespace
from . import (actions, export, live, live_runs, origin, pages, params, queries, row_routes,
               rows, timeline)
from .auth import COOKIE, Sessions, Viewer
from .login import LoginRoutes
from .words import ROW_STATE_WORDS

log = logging.getLogger("runplane.console")

MAX_STREAMS = 16  # per org
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [(b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"), (b"referrer-policy", b"no-referrer"),
                    (b"cache-control", b"no-store")]
STATIC_TYPES = {"css": "text/css; charset=utf-8", "js": "text/javascript; charset=utf-8"}
STATUSES = tuple(ROW_STATE_WORDS)  # stored values: what `?status=` filters by
RUN_STATES = {state.word: state for state in OutboxState}  # the words `?state=` filters by


class NotFound(Exception):
    """Nothing to show: absent, or not the viewer's to see."""


@attrs.frozen
class _RunsListing:
    """One page of the runs list as asked (`state`: a word of `RUN_STATES`), and the epoch the
    next page starts before; `empty_schema`: the schema holds no runplane tables yet."""

    org: str | None
    play: str | None
    state: str | None
    runs: list[queries.RunRow]
    next_epoch: int | None
    empty_schema: str | None = None
    replica_lag_s: float | None = None  # read from a replica (RUNPLANE_READ_DSN) this far behind


@attrs.define(eq=False)
class Console:
    """What the console serves from: sessions, and the store of an org (`port_for`).
    `forwarded_allow`: the proxies whose `X-Forwarded-Proto` / `-Host` are believed (see
    `origin.Forwarding`; `runplane serve --forwarded-allow` sets it)."""

    sessions: Sessions
    port_for: Callable[[str], Awaitable[Port]]
    token_login: bool
    default_org: str = "local"
    closing: trio.Event = attrs.field(factory=trio.Event)
    forwarded_allow: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # the store an action writes to, per org (None: a read-only console; see `actions`)
    writer_for: Callable[[str], Awaitable[Port]] | None = None
    # starts a retry's run in the console's process (None: no retries; see `actions`)
    start_retry: actions.RetryStarter | None = None
    streams: collections.Counter = attrs.field(init=False, factory=collections.Counter)

    @property
    def forwarding(self) -> origin.Forwarding:
        return origin.Forwarding(self.forwarded_allow)


def console_app(console: Console) -> ASGIApp:
    """The ASGI application of the console, to mount at `/ui`."""
    h = _Handlers(console)
    login = LoginRoutes(console)
    app = Starlette(routes=[
        Route("/", h.runs, methods=["GET"]),
        Route("/login", login.login_form, methods=["GET"]),
        Route("/login", login.login, methods=["POST"]),
        Route("/logout", login.logout, methods=["POST"]),
        Route("/static/{name}", h.static, methods=["GET"]),
        Route("/runs/{play}/{run_id}", h.run, methods=["GET"]),
        Route("/runs/{play}/{run_id}/cancel", functools.partial(actions.cancel_run, h),
              methods=["POST"]),
        Route("/tables/{play}/{table}", h.table, methods=["GET"]),
        Route("/tables/{play}/{table}/retry", functools.partial(actions.retry_table, h),
              methods=["POST"]),
        Route("/failures/{play}/{table}", h.failures, methods=["GET"]),
        Route("/rows/{play}/{table}/{key}", functools.partial(row_routes.row, h), methods=["GET"]),
        Route("/api/rows/{play}/{table}/{key}", functools.partial(row_routes.api_row, h),
              methods=["GET"]),
        Route("/search/{play}/{table}", functools.partial(row_routes.find, h), methods=["GET"]),
        Route("/api/search/{play}/{table}", functools.partial(row_routes.api_find, h),
              methods=["GET"]),
        Route("/api/runs", h.api_runs, methods=["GET"]),
        Route("/api/runs/{play}/{run_id}", h.api_run, methods=["GET"]),
        Route("/api/tables/{play}/{table}", h.api_table, methods=["GET"]),
        Route("/api/failures/{play}/{table}", h.api_failures, methods=["GET"]),
        Route("/live/runs", functools.partial(live_runs.stream_runs, h), methods=["GET"]),
        Route("/live/runs/{play}/{run_id}", h.live, methods=["GET"]),
        Route("/export/{play}/{table}.{fmt}", h.export, methods=["GET"]),
    ])

    async def secured(scope: Scope, receive: Receive, send: Send) -> None:
        started = trio.current_time()
        if scope["type"] == "http":  # a `%2F` inside a segment stays inside it
            scope = dict(scope, path=params.encoded_path(scope["path"], scope.get("raw_path")))

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                timing = f"app;dur={(trio.current_time() - started) * 1000:.1f}".encode()
                message = dict(message, headers=[*message.get("headers", []), *SECURITY_HEADERS,
                                                 (b"server-timing", timing)])
            await send(message)

        await app(scope, receive, with_headers)

    return secured


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status)


def _static(name: str) -> bytes | None:
    if name not in ("console.css", "console.js"):
        return None
    return resources.files(__package__).joinpath("static", name).read_bytes()


class _Handlers:
    def __init__(self, console: Console) -> None:
        self.c = console

    # -- who is asking -------------------------------------------------------------------------
    def viewer(self, request: Request) -> Viewer | None:
        return self.c.sessions.viewer(request.cookies.get(COOKIE))

    def org(self, request: Request, viewer: Viewer) -> str:
        asked = request.query_params.get("org") or None
        if viewer.org is not None:
            if asked not in (None, viewer.org):
                raise NotFound()
            return viewer.org
        return asked or self.c.default_org

    def play(self, request: Request, viewer: Viewer) -> tuple[str, str]:
        org = self.org(request, viewer)
        try:
            scope = PlayScope(org, params.segment(request.path_params["play"], "play"))
        except EngineError:
            raise NotFound() from None
        if not viewer.sees(scope.org_id, scope.play):
            raise NotFound()
        return scope.org_id, scope.play

    def namespace(self, request: Request) -> str:
        try:
            return normalize_namespace(params.segment(request.path_params["table"], "table"))
        except EngineError:
            raise NotFound() from None

    async def guarded(self, request: Request, api: bool,
                      render: Callable[[Viewer], Awaitable[Response]]) -> Response:
        viewer = self.viewer(request)
        if viewer is None:
            if api:
                return JSONResponse({"error": "log in first", "code": "unauthenticated"}, 401)
            return RedirectResponse("/ui/login", status_code=303)
        try:
            params.check_all([*params.query_items(request.query_params),
                              *((name, params.segment(value, name))
                                for name, value in request.path_params.items())])
            return await render(viewer)
        except (NotFound, MissingRelationError, SchemaNotFoundError):
            # a schema with no runplane tables yet (`runplane console` before the first run)
            # holds nothing to show: the runs page shows its empty state, the rest is absent
            if api:
                return JSONResponse({"error": "not found", "code": "not_found"}, 404)
            return _html(pages.message_page("Not found", "Nothing here for this login."), 404)
        except ValueError:
            if api:
                return JSONResponse({"error": "bad request", "code": "invalid_input"}, 400)
            return _html(pages.message_page("Bad request", "The address is malformed."), 400)
        except EngineError as exc:  # the store is down, or a read ran past its time limit
            log.warning("console: a read failed: %s", type(exc).__name__)
            text = "The store did not answer in time; try again."
            if api:
                return JSONResponse({"error": text, "code": "store_unavailable"}, 503)
            return _html(pages.message_page("Unavailable", text), 503)

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        body = _static(name)
        if body is None:
            return Response("not found", status_code=404)
        return Response(body, media_type=STATIC_TYPES[name.rsplit(".", 1)[1]])

    # -- runs ------------------------------------------------------------------------------------
    async def _runs(self, request: Request, viewer: Viewer) -> _RunsListing:
        query = request.query_params
        org = query.get("org") or None
        if viewer.org is not None:
            if org not in (None, viewer.org):
                raise NotFound()
            org = viewer.org
        play = query.get("play") or None
        state = query.get("state") or None
        if state is not None and state not in RUN_STATES:
            raise ValueError("state")
        wanted = queries.RunsQuery(org, viewer.play_filter, play=play,
                                   state=None if state is None else RUN_STATES[state],
                                   before_epoch=params.epoch(query.get("before")),
                                   runs=viewer.runs, limit=queries.RUNS_PAGE + 1)
        port = await self.c.port_for(org or self.c.default_org)
        try:
            found = await queries.list_runs(port, wanted)
        except (MissingRelationError, SchemaNotFoundError):  # no runplane tables yet
            return _RunsListing(org, play, state, [], None, empty_schema=port.schema)
        following = found[queries.RUNS_PAGE - 1].epoch if len(found) > queries.RUNS_PAGE else None
        return _RunsListing(org, play, state, found[:queries.RUNS_PAGE], following,
                            replica_lag_s=await queries.replica_lag(port))

    async def runs(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            got = await self._runs(request, viewer)
            plays = sorted({run.play for run in got.runs} | (
                set() if viewer.every_play else set(viewer.plays)))
            page = pages.runs_page(got.runs, show_org=viewer.org is None, org=got.org,
                                   play=got.play, state=got.state, plays=plays,
                                   next_epoch=got.next_epoch, empty_schema=got.empty_schema)
            if request.query_params.get("before") is None and got.empty_schema is None:
                page = pages.with_live_runs(page, org=got.org if viewer.org is None else None,
                                            play=got.play, state=got.state)
            if got.replica_lag_s is not None:
                page = pages.with_notice(page, f"reading from a replica, "
                                               f"{got.replica_lag_s:.1f} s behind its primary")
            return _html(page)
        return await self.guarded(request, False, render)

    async def api_runs(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            got = await self._runs(request, viewer)
            return JSONResponse({"runs": [_run_json(run) for run in got.runs],
                                 "next_before": got.next_epoch,
                                 "schema_ready": got.empty_schema is None,
                                 "replica_lag_s": got.replica_lag_s})
        return await self.guarded(request, True, render)

    # -- a run -------------------------------------------------------------------------------------
    async def _run(self, request: Request, viewer: Viewer) -> tuple[Port, queries.RunRow]:
        org, play = self.play(request, viewer)
        try:
            run_id = RunScope(org, play, params.segment(request.path_params["run_id"],
                                                        "run_id")).run_id
        except EngineError:
            raise NotFound() from None
        if not viewer.sees_run(run_id):
            raise NotFound()
        port = await self.c.port_for(org)
        run = await queries.get_run(port, org, play, run_id)
        if run is None:
            raise NotFound()
        return port, run

    async def run(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            port, run = await self._run(request, viewer)
            tables = await queries.run_tables(port, run.org_id, run.play, run.run_id)
            workers = await queries.play_workers(port, run.org_id, run.play)
            show_org = viewer.org is None
            live = pages.q(f"/ui/live/runs/{params.seg(run.play)}/{params.seg(run.run_id)}",
                           org=run.org_id if show_org else None)
            may_cancel = viewer.may(actions.CANCEL) and self.c.writer_for is not None
            events = await timeline.run_timeline(port, run.org_id, run.play, run.run_id)
            notice = (await actions.no_worker_notice(port, run, workers)
                      or actions.DONE_WORDS.get(request.query_params.get("done")))
            return _html(pages.run_page(
                run, tables, show_org=show_org, live_url=live.replace("&amp;", "&"),
                workers=workers, notice=notice,
                timeline=timeline.timeline_section(events),
                cancel_csrf=self.c.sessions.csrf(request.cookies.get(COOKIE))
                if may_cancel else None))
        return await self.guarded(request, False, render)

    async def api_run(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            port, run = await self._run(request, viewer)
            tables = await queries.run_tables(port, run.org_id, run.play, run.run_id,
                                              with_errors=False)
            return JSONResponse({"run": _run_json(run), "maps": [
                {"table": t.namespace, "state": t.mine.state, **t.mine.figures.as_dict(),
                 "sheet": None if t.counters is None else attrs.asdict(
                     t.counters, value_serializer=_plain)} for t in tables],
                "timeline": [{"at": e.at.isoformat(), "event": e.kind.value, "text": e.text,
                              "table": e.table} for e in await timeline.run_timeline(
                                  port, run.org_id, run.play, run.run_id)]})
        return await self.guarded(request, True, render)

    async def live(self, request: Request) -> Response:
        session_id = request.cookies.get(COOKIE) or ""

        async def render(viewer: Viewer) -> Response:
            port, run = await self._run(request, viewer)
            stream = live.open_stream(self.c.streams, MAX_STREAMS, self.c.sessions, session_id,
                                      self.c.closing, port, run)
            if stream is None:
                return JSONResponse({"error": "too many live streams", "code": "busy"}, 503)
            return stream
        return await self.guarded(request, True, render)

    # -- a table and its failures ----------------------------------------------------------------
    async def _page(self, request: Request, viewer: Viewer, failed_only: bool):
        org, play = self.play(request, viewer)
        namespace = self.namespace(request)
        query = request.query_params
        # checked before any query: a malformed status or cursor is a 400 (`ValueError`)
        wanted = rows.RowsQuery(
            status=RowStatus.FAILED if failed_only else (query.get("status") or None),
            key_prefix=None if failed_only else (query.get("key") or None),
            cause=_cause(request) if failed_only else None, after=_cursor(query.get("after")))
        status, key = wanted.status, wanted.key_prefix
        port = await self.c.port_for(org)
        page = await rows.rows_page(port, org, play, namespace, wanted)
        if page.counters is None:
            raise NotFound()
        return port, org, play, namespace, page, status, key

    async def table(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            port, org, play, namespace, page, status, key = await self._page(request, viewer, False)
            show_org = viewer.org is None
            search = await row_routes.table_search(port, org, play, namespace, page,
                                                   show_org=show_org)
            links = [(label, pages.q(f"/ui/export/{params.seg(play)}/{params.seg(namespace)}.{fmt}",
                                     org=org if show_org else None, status=status))
                     for label, fmt in (("JSON lines", "jsonl"), ("CSV", "csv"))]
            failed = 0 if page.counters is None else page.counters.failed
            again = actions.retry_forms(self, request, viewer, play, namespace, failed,
                                        org if show_org else None)
            return _html(pages.table_page(org, play, namespace, page, show_org=show_org,
                                          status=status, key=key,
                                          tools=pages.TableTools(tuple(links), search, again)))
        return await self.guarded(request, False, render)

    async def export(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            org, play = self.play(request, viewer)
            namespace = self.namespace(request)
            fmt = request.path_params["fmt"]
            status = request.query_params.get("status") or None
            if fmt not in export.FORMATS or status not in (None, *STATUSES):
                raise ValueError("format or status")
            port = await self.c.port_for(org)
            if await rows.table_exists(port, org, play, namespace) is None:
                raise NotFound()
            name = f"{play}-{namespace}.{fmt}".encode("ascii", "replace").decode()
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            return StreamingResponse(
                export.export_chunks(port, org, play, namespace, fmt, status),
                media_type=export.FORMATS[fmt],
                headers={"content-disposition": f'attachment; filename="{safe}"'})
        return await self.guarded(request, True, render)

    async def failures(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            port, org, play, namespace, page, _, _ = await self._page(request, viewer, True)
            errors = await rows.top_errors(port, org, play, namespace, limit=rows.FAILURE_CAUSES)
            return _html(pages.failures_page(org, play, namespace, page, errors,
                                             show_org=viewer.org is None,
                                             cause=_cause(request)))
        return await self.guarded(request, False, render)

    async def api_table(self, request: Request) -> Response:
        return await self.guarded(request, True, lambda v: self._api_page(request, v, False))

    async def api_failures(self, request: Request) -> Response:
        return await self.guarded(request, True, lambda v: self._api_page(request, v, True))

    async def _api_page(self, request: Request, viewer: Viewer, failed_only: bool) -> Response:
        port, org, play, namespace, page, _, _ = await self._page(request, viewer, failed_only)
        following = None if page.next is None else [page.next.input_index, page.next.created,
                                                    page.next.key]
        body: JsonObject = {"fields": page.fields, "rows": page.rows, "next": following}
        if failed_only:  # the commonest causes (None: counting them took too long)
            causes = await rows.top_errors(port, org, play, namespace, limit=rows.FAILURE_CAUSES)
            body["causes"] = None if causes is None else [attrs.asdict(c) for c in causes]
        return JSONResponse(body)


def _cause(request: Request) -> str | None:
    """The failures page's cause filter (`?cause=`: a stored cause, `sheets.causes`)."""
    return request.query_params.get("cause") or None


def _cursor(text: str | None) -> rows.Cursor | None:
    found = params.cursor(text)
    return None if found is None else rows.Cursor(*found)


def _plain(_inst: type, _field: attrs.Attribute, value: object) -> object:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _run_json(run: queries.RunRow) -> JsonObject:
    return {"org": run.org_id, "play": run.play, "run_id": run.run_id, "epoch": run.epoch,
            "state": run.state.word, "started": run.started.isoformat(),
            "duration_s": round(run.duration_s, 3),
            "figures": None if run.figures is None else run.figures.as_dict(),
            "resume": run.command if run.state is OutboxState.OPEN else None}
