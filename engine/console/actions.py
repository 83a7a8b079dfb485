"""The console's actions: POSTs that change a run, every check made before anything is written.

How it works
- `POST /ui/runs/<play>/<run_id>/cancel` cancels a run (`engine.runs.cancel`): every process of
  it stops its rows within seconds and the run ends retired.
- In order, before any write: a live session (else 401); a form of at most `MAX_FORM_BYTES`
  whose `csrf` field equals the session's own form token (`auth.Sessions.csrf`: random per
  session and printed only into the console's own pages, so a page of another site cannot
  forge the POST; else 403); the session's action claims allow the action (`runs.cancel`; a
  `runplane console` session holds every claim; else 403); the org, play and run are the
  viewer's and exist (else 404, as for pages); and the console has a writer for the org
  (`Console.writer_for`; a console without one answers 403, read-only).
- A form POST is answered with a redirect (303) back to the run's page, which shows what came
  of it (`?done=requested|already|finished`); `Accept: application/json` gets
  `{"answer": ...}` instead.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from ..runs.cancel import CancelAnswer, request_cancel
from ..values.scopes import RunScope
from . import pages, params
from .auth import COOKIE

if TYPE_CHECKING:
    from .routes import _Handlers

MAX_FORM_BYTES = 4 * 1024  # an action form holds its token and nothing else
CANCEL = "runs.cancel"


def _refused(request: Request, status: int, text: str) -> Response:
    if _wants_json(request):
        return JSONResponse({"error": text, "code": "forbidden" if status == 403 else
                             "unauthenticated"}, status)
    return Response(pages.message_page("Not allowed", text), status,
                    media_type="text/html; charset=utf-8")


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


async def _form_token(request: Request) -> str | None:
    """The form's `csrf` field, read only from a small form; None otherwise."""
    declared = request.headers.get("content-length", "")
    if not declared.isdigit() or int(declared) > MAX_FORM_BYTES:
        return None
    form = await request.form(max_files=0, max_fields=4)
    token = form.get("csrf")
    return token if isinstance(token, str) else None


async def cancel_run(h: _Handlers, request: Request) -> Response:
    """`POST /ui/runs/<play>/<run_id>/cancel` (see the module docstring)."""
    session_id = request.cookies.get(COOKIE)
    viewer = h.viewer(request)
    expected = h.c.sessions.csrf(session_id)
    if viewer is None or expected is None:
        return _refused(request, 401, "Log in first.")
    given = await _form_token(request)
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        return _refused(request, 403, "This action did not come from this console's own page.")
    if not viewer.may(CANCEL):
        return _refused(request, 403, f"This login's token does not allow {CANCEL}.")
    if h.c.writer_for is None:
        return _refused(request, 403, "This console is read-only.")

    async def act(_viewer) -> Response:
        _port, run = await h._run(request, viewer)  # 404 unless the viewer's and it exists
        writer = await h.c.writer_for(run.org_id)
        answer = await request_cancel(writer, RunScope(run.org_id, run.play, run.run_id))
        if _wants_json(request):
            return JSONResponse({"answer": answer.value})
        page = pages.q(f"/ui/runs/{params.seg(run.play)}/{params.seg(run.run_id)}",
                       org=run.org_id if viewer.org is None else None, done=answer.value)
        return RedirectResponse(page.replace("&amp;", "&"), status_code=303)
    return await h.guarded(request, _wants_json(request), act)


DONE_WORDS = {
    CancelAnswer.REQUESTED.value: "Cancellation requested: every process of the run stops its "
                                  "rows within seconds.",
    CancelAnswer.ALREADY.value: "This run was already cancelled.",
    CancelAnswer.FINISHED.value: "This run had already finished: nothing to cancel.",
}
