"""The console's actions: POSTs that change a run, every check made before anything is written.

How it works
- `POST /ui/runs/<play>/<run_id>/cancel` cancels a run (`engine.runs.cancel`): every process of
  it stops its rows within seconds and the run ends retired.
- `POST /ui/tables/<play>/<table>/retry` runs the table's failed rows again (`kind=failed`,
  claim `maps.retry_failed`) or recomputes the rows of one status, or every row (`kind=recompute`,
  `status=...|all`, claim `maps.force`): a new run whose coordinator the console hosts
  (`Console.start_retry`, given by the command that serves the console: `actors.retrying`), its
  rows run by the play's `runplane worker`s (the console runs no user code). The answer is the
  new run's page (`?done=retry_started`), which says when no worker has come for 30 s.
- In order, before any write: a live session (else 401); a form of at most `MAX_FORM_BYTES`
  whose `csrf` field equals the session's own form token (`auth.Sessions.csrf`: random per
  session and printed only into the console's own pages, so a page of another site cannot
  forge the POST; else 403); the session's action claims allow the action (a `runplane
  console` session holds every claim; else 403); the org, play and run (or table) are the
  viewer's and exist (else 404, as for pages); and the console can act (`Console.writer_for`
  for a cancel, `Console.start_retry` for a retry; else 403, read-only). A retry's request
  is checked again by `start_retry` before its run is registered (a table with no recorded
  function is a 400 naming why).
- A form POST is answered with a redirect (303) back to the run's page, which shows what came
  of it (`?done=requested|already|finished`); `Accept: application/json` gets
  `{"answer": ...}` instead.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Awaitable, Callable

import attrs

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from ..errors import InvalidInputError
from ..runs.cancel import CancelAnswer, request_cancel
from ..ports import Port, table
from ..runs.outbox import OutboxState
from ..runs.retry_spec import FORCE, RETRY_FAILED
from ..shared.maps import MapState
from . import queries
from ..values.scopes import RunScope
from . import pages, params, rows
from .auth import COOKIE

if TYPE_CHECKING:
    from .routes import _Handlers

MAX_FORM_BYTES = 4 * 1024  # an action form holds its token and a choice or two
CANCEL = "runs.cancel"
RETRY_KINDS = ("failed", "recompute")
# what a recompute may choose, and the words its form shows (the stored status: the word)
RETRY_STATUSES = {"all": "every row", "failed": "failed", "enriched": "completed",
                  "pending": "queued", "running": "leased"}


@attrs.frozen
class RetryOrder:
    """A retry asked for from the console: the table's rows of `status` (None: every row) of
    `org`'s `play`, recomputed when `force`."""

    org: str
    play: str
    table: str
    status: str | None
    force: bool


# Starts a retry's run (hosted by the console's process) and answers its run id once it is
# registered; a refused order raises `InvalidInputError` before anything is written.
RetryStarter = Callable[[RetryOrder], Awaitable[str]]


def _refused(request: Request, status: int, text: str) -> Response:
    if _wants_json(request):
        return JSONResponse({"error": text, "code": "forbidden" if status == 403 else
                             "unauthenticated"}, status)
    return Response(pages.message_page("Not allowed", text), status,
                    media_type="text/html; charset=utf-8")


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


async def _form(request: Request) -> dict[str, str] | None:
    """The fields of a small form (text only); None for a large or missing one."""
    declared = request.headers.get("content-length", "")
    if not declared.isdigit() or int(declared) > MAX_FORM_BYTES:
        return None
    form = await request.form(max_files=0, max_fields=4)
    return {name: value for name, value in form.items() if isinstance(value, str)}


async def _checked(h: _Handlers, request: Request,
                   claim: Callable[[dict[str, str]], str]) -> Response | dict[str, str]:
    """The action's form when the session, its CSRF token and the claim `claim(form)` allow
    it; else the refusal to answer."""
    session_id = request.cookies.get(COOKIE)
    viewer = h.viewer(request)
    expected = h.c.sessions.csrf(session_id)
    if viewer is None or expected is None:
        return _refused(request, 401, "Log in first.")
    form = await _form(request)
    given = None if form is None else form.get("csrf")
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        return _refused(request, 403, "This action did not come from this console's own page.")
    needed = claim(form)
    if not viewer.may(needed):
        return _refused(request, 403, f"This login's token does not allow {needed}.")
    return form


async def cancel_run(h: _Handlers, request: Request) -> Response:
    """`POST /ui/runs/<play>/<run_id>/cancel` (see the module docstring)."""
    checked = await _checked(h, request, lambda _form: CANCEL)
    if isinstance(checked, Response):
        return checked
    if h.c.writer_for is None:
        return _refused(request, 403, "This console is read-only.")

    async def act(viewer) -> Response:
        _port, run = await h._run(request, viewer)  # 404 unless the viewer's and it exists
        writer = await h.c.writer_for(run.org_id)
        answer = await request_cancel(writer, RunScope(run.org_id, run.play, run.run_id))
        if _wants_json(request):
            return JSONResponse({"answer": answer.value})
        page = pages.q(f"/ui/runs/{params.seg(run.play)}/{params.seg(run.run_id)}",
                       org=run.org_id if viewer.org is None else None, done=answer.value)
        return RedirectResponse(page.replace("&amp;", "&"), status_code=303)
    return await h.guarded(request, _wants_json(request), act)


def _retry_claim(form: dict[str, str]) -> str:
    return FORCE if form.get("kind") == "recompute" else RETRY_FAILED


async def retry_table(h: _Handlers, request: Request) -> Response:
    """`POST /ui/tables/<play>/<table>/retry` (see the module docstring)."""
    checked = await _checked(h, request, _retry_claim)
    if isinstance(checked, Response):
        return checked
    kind, status = checked.get("kind", "failed"), checked.get("status", "failed")
    if kind not in RETRY_KINDS or status not in RETRY_STATUSES:
        return JSONResponse({"error": "kind or status", "code": "invalid_input"}, 400)
    start = h.c.start_retry
    if start is None:
        return _refused(request, 403, "This console cannot start retries (it hosts no "
                                      "coordinator): use `runplane retry`.")

    async def act(viewer) -> Response:
        org, play = h.play(request, viewer)
        namespace = h.namespace(request)
        port = await h.c.port_for(org)
        if await rows.table_exists(port, org, play, namespace) is None:
            from .routes import NotFound  # (the module that imports this one)

            raise NotFound()
        order = RetryOrder(org, play, namespace, None if kind == "recompute" and status == "all"
                           else ("failed" if kind == "failed" else status), kind == "recompute")
        try:
            run_id = await start(order)
        except InvalidInputError as exc:
            if _wants_json(request):
                return JSONResponse({"error": str(exc), "code": "invalid_input"}, 400)
            return Response(pages.message_page("Not started", str(exc)), 400,
                            media_type="text/html; charset=utf-8")
        if _wants_json(request):
            return JSONResponse({"run_id": run_id})
        page = pages.q(f"/ui/runs/{params.seg(play)}/{params.seg(run_id)}",
                       org=org if viewer.org is None else None, done="retry_started")
        return RedirectResponse(page.replace("&amp;", "&"), status_code=303)
    return await h.guarded(request, _wants_json(request), act)


DONE_WORDS = {
    CancelAnswer.REQUESTED.value: "Cancellation requested: every process of the run stops its "
                                  "rows within seconds.",
    CancelAnswer.ALREADY.value: "This run was already cancelled.",
    CancelAnswer.FINISHED.value: "This run had already finished: nothing to cancel.",
    "retry_started": "Retry started: the play's `runplane worker`s run its rows.",
}


def retry_forms(h: _Handlers, request: Request, viewer, play: str, namespace: str,
                failed: int, org_param: str | None) -> str:
    """The table page's retry buttons the session may use: "Retry failed rows" (with failed
    rows) and "Recompute" of a status or every row; none on a console that hosts no retry."""
    token = h.c.sessions.csrf(request.cookies.get(COOKIE))
    if h.c.start_retry is None or token is None:
        return ""
    action = pages.q(f"/ui/tables/{params.seg(play)}/{params.seg(namespace)}/retry",
                     org=org_param)
    hidden = f'<input type="hidden" name="csrf" value="{pages.esc(token)}">'
    forms = []
    if failed and viewer.may(RETRY_FAILED):
        forms.append(f'<form method="post" action="{action}" class="action">{hidden}'
                     '<input type="hidden" name="kind" value="failed">'
                     f'<button type="submit" name="retry">Retry {failed} failed rows</button>'
                     '</form>')
    if viewer.may(FORCE):
        options = "".join(f'<option value="{value}">{word}</option>'
                          for value, word in RETRY_STATUSES.items())
        forms.append(f'<form method="post" action="{action}" class="action">{hidden}'
                     '<input type="hidden" name="kind" value="recompute">'
                     f'<label>recompute <select name="status">{options}</select></label>'
                     '<button type="submit" name="recompute">Recompute</button></form>')
    if not forms:
        return ""
    return ('<h2>Run rows again</h2><p class="muted">A new run; the play\'s <code>runplane '
            'worker</code>s run its rows.</p>' + "".join(forms))


NO_WORKER_S = 30.0  # a run's shared map with no worker seen for this long is said to wait

_LIVE_SHARED = f"""
SELECT count(*) FROM {{maps}}
 WHERE org_id = $1 AND play = $2 AND run_id = $3
   AND state IN ({MapState.WAITING.sql}, {MapState.OPEN.sql})
"""


async def no_worker_notice(port: Port, run: queries.RunRow, workers: list) -> str | None:
    """What the run's page says when the run's shared map (a retry's, say) has had no worker of
    its play for `NO_WORKER_S`: which command to start; None otherwise."""
    if run.state is not OutboxState.OPEN or run.duration_s < NO_WORKER_S:
        return None
    if any(w.seen_s_ago <= NO_WORKER_S for w in workers):
        return None
    sql = _LIVE_SHARED.format(maps=table(port, "shared_maps"))
    live = await queries.read(port, lambda conn: conn.fetchval(
        sql, run.org_id, run.play, run.run_id))
    if not live:
        return None
    return (f"No worker of play {run.play} has been seen for {NO_WORKER_S:.0f} s, so this "
            f"run's rows wait: start `runplane worker PLAY.py` (for org {run.org_id}) where "
            "the play file is.")
