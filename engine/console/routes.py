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
- `POST /ui/login` is refused (403) unless it came from the console's own login page
  (`origin.login_allowed`: same-origin `Origin` / `Sec-Fetch-Site`, or the form's token);
  `GET /ui/login?once=` is not checked (a link opened from a terminal). The session cookie is
  `Secure` when the browser reached the console over https (`origin.https`, which believes
  `X-Forwarded-Proto` only from the proxies in `Console.forwarding`).
- The live stream (`/ui/live/runs/<play>/<run_id>`, see `live`): at most `MAX_STREAMS` per
  org at once, counted before the stream is accepted (one org's open pages cannot take
  another's streams); each ends with its session or when the server shuts down.
"""

from __future__ import annotations

import collections
import logging
from importlib import resources
from typing import Any, Awaitable, Callable

import attrs
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (HTMLResponse, JSONResponse, RedirectResponse, Response,
                                 StreamingResponse)
from starlette.routing import Route

from ..errors import AuthError, EngineError, MissingRelationError, SchemaNotFoundError, ScopeError
from ..ports import Port
from ..runs.outbox import OutboxState
from ..values.scopes import PlayScope, RunScope, normalize_namespace
from . import export, live, origin, pages, params, queries, rows
from .auth import COOKIE, COOKIE_PATH, Sessions, Viewer
from .words import ROW_STATE_WORDS

log = logging.getLogger("runplane.console")

MAX_STREAMS = 16  # per org
MAX_LOGIN_BYTES = 16 * 1024  # a login form holds one token; larger bodies are never read
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [(b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"), (b"referrer-policy", b"no-referrer"),
                    (b"cache-control", b"no-store")]
STATIC_TYPES = {"css": "text/css; charset=utf-8", "js": "text/javascript; charset=utf-8"}
STATUSES = tuple(ROW_STATE_WORDS)  # stored values: what `?status=` filters by


class NotFound(Exception):
    """Nothing to show: absent, or not the viewer's to see."""


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
    streams: collections.Counter = attrs.field(init=False, factory=collections.Counter)

    @property
    def forwarding(self) -> origin.Forwarding:
        return origin.Forwarding(self.forwarded_allow)


def console_app(console: Console) -> Any:
    """The ASGI application of the console, to mount at `/ui`."""
    h = _Handlers(console)
    app = Starlette(routes=[
        Route("/", h.runs, methods=["GET"]),
        Route("/login", h.login_form, methods=["GET"]),
        Route("/login", h.login, methods=["POST"]),
        Route("/logout", h.logout, methods=["POST"]),
        Route("/static/{name}", h.static, methods=["GET"]),
        Route("/runs/{play}/{run_id}", h.run, methods=["GET"]),
        Route("/tables/{play}/{table}", h.table, methods=["GET"]),
        Route("/failures/{play}/{table}", h.failures, methods=["GET"]),
        Route("/api/runs", h.api_runs, methods=["GET"]),
        Route("/api/runs/{play}/{run_id}", h.api_run, methods=["GET"]),
        Route("/api/tables/{play}/{table}", h.api_table, methods=["GET"]),
        Route("/api/failures/{play}/{table}", h.api_failures, methods=["GET"]),
        Route("/live/runs/{play}/{run_id}", h.live, methods=["GET"]),
        Route("/export/{play}/{table}.{fmt}", h.export, methods=["GET"]),
    ])

    async def secured(scope: Any, receive: Any, send: Any) -> None:
        started = trio.current_time()
        if scope["type"] == "http":  # a `%2F` inside a segment stays inside it
            scope = dict(scope, path=params.encoded_path(scope["path"], scope.get("raw_path")))

        async def with_headers(message: Any) -> None:
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

    def seen_as(self, request: Request) -> tuple[str, str | None, Any]:
        peer = request.client.host if request.client else None
        return request.url.scheme, peer, request.headers

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

    # -- login ---------------------------------------------------------------------------------
    def login_page(self, request: Request, message: str | None = None,
                   status: int = 200) -> Response:
        """The login page; with token login, its form token: the login-form cookie's, which a
        GET sets when the browser has none (an answer to a POST sets no cookie)."""
        if not self.c.token_login:
            return _html(pages.login_page(token_login=False, message=message), status)
        token = request.cookies.get(origin.LOGIN_COOKIE) or ""
        fresh = not origin.is_form_token(token) and request.method == "GET"
        if fresh:
            token = origin.new_form_token()
        response = _html(pages.login_page(token_login=True, message=message,
                                          csrf=token if origin.is_form_token(token) else ""),
                         status)
        if fresh:
            response.set_cookie(origin.LOGIN_COOKIE, token, path=COOKIE_PATH, httponly=True,
                                samesite="strict",
                                secure=origin.https(self.c.forwarding, *self.seen_as(request)))
        return response

    async def login_form(self, request: Request) -> Response:
        code = request.query_params.get("once")
        if code is None:
            return self.login_page(request)
        try:
            session = self.c.sessions.redeem(code)
        except AuthError as exc:
            return _html(pages.login_page(token_login=self.c.token_login, message=str(exc)), 401)
        return self._logged_in(request, session)

    async def login(self, request: Request) -> Response:
        declared = request.headers.get("content-length", "")
        if not declared.isdigit() or int(declared) > MAX_LOGIN_BYTES:
            return _html(pages.login_page(token_login=self.c.token_login,
                                          message="the login form is too large"), 413)
        form = await request.form(max_files=0, max_fields=4)
        token = form.get("token")
        try:
            if not isinstance(token, str):
                raise AuthError("paste a gateway token")
            if self.c.token_login and not origin.login_allowed(
                    self.c.forwarding, *self.seen_as(request),
                    request.cookies.get(origin.LOGIN_COOKIE), form.get("csrf")):
                return self.login_page(request, "this login did not come from this console's "
                                       "own login page: log in here", 403)
            session = self.c.sessions.login(token)
        except AuthError as exc:
            return self.login_page(request, str(exc), 401)
        except ScopeError as exc:
            return self.login_page(request, str(exc), 403)
        return self._logged_in(request, session)

    def _logged_in(self, request: Request, session: str) -> Response:
        response = RedirectResponse("/ui/", status_code=303)
        response.set_cookie(COOKIE, session, path=COOKIE_PATH, httponly=True, samesite="strict",
                            secure=origin.https(self.c.forwarding, *self.seen_as(request)))
        if origin.LOGIN_COOKIE in request.cookies:  # the login form's token has done its work
            response.delete_cookie(origin.LOGIN_COOKIE, path=COOKIE_PATH, httponly=True,
                                   samesite="strict")
        return response

    async def logout(self, request: Request) -> Response:
        self.c.sessions.logout(request.cookies.get(COOKIE))
        response = RedirectResponse("/ui/login", status_code=303)
        response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
        return response

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        body = _static(name)
        if body is None:
            return Response("not found", status_code=404)
        return Response(body, media_type=STATIC_TYPES[name.rsplit(".", 1)[1]])

    # -- runs ------------------------------------------------------------------------------------
    async def _runs(self, request: Request, viewer: Viewer) -> dict[str, Any]:
        query = request.query_params
        org = query.get("org") or None
        if viewer.org is not None:
            if org not in (None, viewer.org):
                raise NotFound()
            org = viewer.org
        play = query.get("play") or None
        state = query.get("state") or None
        if state is not None and state not in {s.word for s in OutboxState}:
            raise ValueError("state")
        before_epoch = params.epoch(query.get("before"))
        port = await self.c.port_for(org or self.c.default_org)
        try:
            found = await queries.list_runs(port, org=org, plays=viewer.play_filter, play=play,
                                            state=state, before_epoch=before_epoch,
                                            runs=viewer.runs, limit=queries.RUNS_PAGE + 1)
        except (MissingRelationError, SchemaNotFoundError):  # no runplane tables yet
            return {"org": org, "play": play, "state": state, "runs": [], "next": None,
                    "empty_schema": port.schema}
        following = found[queries.RUNS_PAGE - 1].epoch if len(found) > queries.RUNS_PAGE else None
        return {"org": org, "play": play, "state": state, "runs": found[:queries.RUNS_PAGE],
                "next": following, "empty_schema": None}

    async def runs(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            got = await self._runs(request, viewer)
            plays = sorted({run.play for run in got["runs"]} | (
                set() if viewer.every_play else set(viewer.plays)))
            return _html(pages.runs_page(got["runs"], show_org=viewer.org is None, org=got["org"],
                                         play=got["play"], state=got["state"], plays=plays,
                                         next_epoch=got["next"],
                                         empty_schema=got["empty_schema"]))
        return await self.guarded(request, False, render)

    async def api_runs(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            got = await self._runs(request, viewer)
            return JSONResponse({"runs": [_run_json(run) for run in got["runs"]],
                                 "next_before": got["next"],
                                 "schema_ready": got["empty_schema"] is None})
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
            return _html(pages.run_page(run, tables, show_org=show_org,
                                        live_url=live.replace("&amp;", "&"), workers=workers))
        return await self.guarded(request, False, render)

    async def api_run(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            port, run = await self._run(request, viewer)
            tables = await queries.run_tables(port, run.org_id, run.play, run.run_id,
                                              with_errors=False)
            return JSONResponse({"run": _run_json(run), "maps": [
                {"table": t.namespace, "state": t.mine.state, **t.mine.figures.as_dict(),
                 "sheet": None if t.counters is None else attrs.asdict(
                     t.counters, value_serializer=_plain)} for t in tables]})
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
        status = "failed" if failed_only else (query.get("status") or None)
        if status not in (None, *STATUSES):
            raise ValueError("status")
        key = None if failed_only else (query.get("key") or None)
        cause = _cause(request) if failed_only else None
        after = _cursor(query.get("after"))  # before any query: a malformed one is a 400
        port = await self.c.port_for(org)
        page = await rows.rows_page(port, org, play, namespace, status=status,
                                       key_prefix=key, after=after, cause=cause)
        if page.counters is None:
            raise NotFound()
        return port, org, play, namespace, page, status, key

    async def table(self, request: Request) -> Response:
        async def render(viewer: Viewer) -> Response:
            _, org, play, namespace, page, status, key = await self._page(request, viewer, False)
            show_org = viewer.org is None
            links = [(label, pages.q(f"/ui/export/{params.seg(play)}/{params.seg(namespace)}.{fmt}",
                                     org=org if show_org else None, status=status))
                     for label, fmt in (("JSON lines", "jsonl"), ("CSV", "csv"))]
            return _html(pages.table_page(org, play, namespace, page, show_org=show_org,
                                          status=status, key=key, exports=links))
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
            errors = await rows.top_errors(port, org, play, namespace)
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
        body: dict[str, Any] = {"fields": page.fields, "rows": page.rows, "next": following}
        if failed_only:  # the commonest causes (None: counting them took too long)
            causes = await rows.top_errors(port, org, play, namespace)
            body["causes"] = None if causes is None else [attrs.asdict(c) for c in causes]
        return JSONResponse(body)


def _cause(request: Request) -> str | None:
    """The failures page's cause filter (`?cause=`: a stored cause, `sheets.causes`)."""
    return request.query_params.get("cause") or None


def _cursor(text: str | None) -> rows.Cursor | None:
    found = params.cursor(text)
    return None if found is None else rows.Cursor(*found)


def _plain(_inst: Any, _field: Any, value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _run_json(run: queries.RunRow) -> dict[str, Any]:
    return {"org": run.org_id, "play": run.play, "run_id": run.run_id, "epoch": run.epoch,
            "state": run.state, "started": run.started.isoformat(),
            "duration_s": round(run.duration_s, 3),
            "figures": None if run.figures is None else run.figures.as_dict(),
            "resume": run.command if run.state == OutboxState.OPEN.word else None}
