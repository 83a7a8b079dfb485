"""The console's routes of single rows: a row's page and the search by input value.

How it works
- `GET /ui/rows/<play>/<table>/<key>` (and `/ui/api/rows/…`) shows one row (`rowpage`): its
  inputs, its outputs with their cells (`_cells`), its failure and the runs that touched it.
- `GET /ui/search/<play>/<table>?field=F&value=V` (and `/ui/api/search/…`) finds the rows whose
  input `F` equals `V` (`search`): one match redirects (303) to its row's page, more (or none)
  are listed with what kind of search answered (an index, or a bounded scan that says so).
- Every check is the other pages' (`routes._Handlers.guarded`, `play`, `namespace`): a session,
  the viewer's org and play, bounded parameters; a missing field or value, or a field that is no
  input, is a 400 before any row is read; an unknown table or row is a 404.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from ..errors import InvalidInputError
from ..ports import Port
from . import params, row_html, rowpage, search
from .auth import Viewer
from .rows import RowsPage

if TYPE_CHECKING:
    from .routes import _Handlers


async def _row(h: _Handlers, request: Request, viewer: Viewer):
    from .routes import NotFound

    org, play = h.play(request, viewer)
    namespace = h.namespace(request)
    key = params.segment(request.path_params["key"], "key")
    port = await h.c.port_for(org)
    found = await rowpage.rows_by_key(port, org, play, namespace, [key], cells=True)
    if not found:
        raise NotFound()
    (row,) = found
    return org, play, namespace, row, await rowpage.touching_runs(port, org, play, row)


async def row(h: _Handlers, request: Request) -> Response:
    """`GET /ui/rows/<play>/<table>/<key>`."""
    async def render(viewer: Viewer) -> Response:
        org, play, namespace, one, runs = await _row(h, request, viewer)
        return HTMLResponse(row_html.row_page(org, play, namespace, one, runs,
                                              show_org=viewer.org is None))
    return await h.guarded(request, False, render)


async def api_row(h: _Handlers, request: Request) -> Response:
    """`GET /ui/api/rows/<play>/<table>/<key>`."""
    async def render(viewer: Viewer) -> Response:
        _, _, _, one, runs = await _row(h, request, viewer)
        return JSONResponse(row_html.row_json(one, runs))
    return await h.guarded(request, True, render)


async def _search(h: _Handlers, request: Request, viewer: Viewer):
    from .routes import NotFound

    org, play = h.play(request, viewer)
    namespace = h.namespace(request)
    field = request.query_params.get("field") or ""
    value = request.query_params.get("value")
    if not field or value is None:
        raise ValueError("a search needs field and value")
    port = await h.c.port_for(org)
    try:
        found = await search.find_rows(port, org, play, namespace, field, value)
    except InvalidInputError as exc:  # an unknown field, an output: the request is wrong
        raise ValueError(str(exc)) from None
    if found is None:
        raise NotFound()
    rows = await rowpage.rows_by_key(port, org, play, namespace, found.keys) or []
    return port, org, play, namespace, found, rows


async def find(h: _Handlers, request: Request) -> Response:
    """`GET /ui/search/<play>/<table>?field=&value=`."""
    async def render(viewer: Viewer) -> Response:
        port, org, play, namespace, found, rows = await _search(h, request, viewer)
        show_org = viewer.org is None
        if len(rows) == 1 and not found.more:
            url = row_html.row_url(org, play, namespace, rows[0].key, show_org)
            return RedirectResponse(url.replace("&amp;", "&"), status_code=303)
        fields = await search.sheet_inputs(port, org, play, namespace)
        form = row_html.search_form(
            org, play, namespace, fields,
            await search.indexed_fields(port, org, play, namespace, fields),
            show_org=show_org, field=found.field, value=found.value)
        return HTMLResponse(row_html.matches_page(org, play, namespace, found, rows, form,
                                                  show_org=show_org))
    return await h.guarded(request, False, render)


async def api_find(h: _Handlers, request: Request) -> Response:
    """`GET /ui/api/search/<play>/<table>?field=&value=`."""
    async def render(viewer: Viewer) -> Response:
        _, _, _, _, found, rows = await _search(h, request, viewer)
        return JSONResponse({
            "field": found.field, "value": found.value, "indexed": found.indexed,
            "scanned": found.scanned, "complete": found.complete, "timed_out": found.timed_out,
            "more": found.more, "rows": [{"key": r.key, "status": r.status,
                                          "attempts": r.attempts} for r in rows]})
    return await h.guarded(request, True, render)


async def table_search(port: Port, org: str, play: str, namespace: str, page: RowsPage, *,
                       show_org: bool) -> str:
    """The search form of a table's page (its input fields, those with an index marked)."""
    fields = search.input_fields(page.fields, page.outputs)
    indexed = await search.indexed_fields(port, org, play, namespace, fields)
    return row_html.search_form(org, play, namespace, fields, indexed, show_org=show_org)
