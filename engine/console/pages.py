"""The console's HTML: every page rendered on the server, every user value escaped.

How it works
- Pages are the `templates/base.html` frame around a body built here. Every value that comes
  from the store or the request goes through `esc` (text and attribute values alike), so a row
  value `<script>…` is shown as text; the frame loads one stylesheet and one script from
  `/ui/static/`, and the Content-Security-Policy the routes send forbids any inline script.
- Row states and figures are named by `words` (stored values such as `enriched` are never
  shown as such). A run's page shows that run's own figures (its run history) and, labelled
  as such, the rows of each table running now, whichever run holds them.
- Progress bars and the rows-per-second chart are inline SVG (no inline styles, so the policy
  can forbid those too); pages work without JavaScript, the script only keeps a run page live.
- Links are root-relative (`/ui/…`); the org rides along as `?org=` only where a viewer may see
  every org.
"""

from __future__ import annotations

import datetime
import html
import json
import string
import urllib.parse
from importlib import resources
from typing import Iterable

import attrs

from .figures import RunFigures
from .params import seg
from .queries import RunRow, RunTable, TableCounters
from ..runs.outbox import OutboxState
from ..sheets.causes import ErrorCause
from .rows import Cursor, RowsPage
from .words import (FIGURE_HINTS, MAP_STATE_WORDS, ROW_STATE_WORDS, RUN_FIGURES,
                    SHEET_COUNTERS, row_state)

VALUE_CHARS = 200
UNKNOWN = '<span class="muted" title="counting took too long">…</span>'
BAR_WIDTH = 600
CHART_W, CHART_H = 240, 48
_FRAME = string.Template(resources.files(__package__).joinpath("templates/base.html")
                         .read_text(encoding="utf-8"))


def esc(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def q(path: str, **params: object) -> str:
    """A root-relative URL with its query (None values left out), escaped for an attribute."""
    pairs = {k: v for k, v in params.items() if v not in (None, "")}
    return esc(path + ("?" + urllib.parse.urlencode(pairs) if pairs else ""))


def frame(title: str, body: str, *, logged_in: bool = True) -> str:
    nav = ('<nav><a href="/ui/">Runs</a></nav><form method="post" action="/ui/logout">'
           '<button type="submit">Log out</button></form>') if logged_in else ""
    return _FRAME.substitute(title=esc(title), nav=nav, body=body)


def with_notice(page: str, text: str) -> str:
    """`page` with one line of `text` first in its main part."""
    return page.replace("<main>\n", f'<main>\n<p class="muted notice">{esc(text)}</p>\n', 1)


def when(value: datetime.datetime | None) -> str:
    return "-" if value is None else value.astimezone(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def shorten(text: str | None, limit: int = VALUE_CHARS) -> str:
    if text is None:
        return ""
    return text if len(text) <= limit else text[:limit] + "…"


def _options(name: str, values: Iterable[str], chosen: str | None,
             labels: dict[str, str] | None = None) -> str:
    items = ['<option value="">any</option>'] + [
        f'<option value="{esc(v)}"{" selected" if v == chosen else ""}>'
        f'{esc((labels or {}).get(v, v))}</option>' for v in values]
    return f'<select name="{name}">{"".join(items)}</select>'


# -- login --------------------------------------------------------------------------------------
def login_page(*, token_login: bool, message: str | None = None, csrf: str = "") -> str:
    """The login page; `csrf` is the login form's token (see `origin`)."""
    problem = f'<p class="error">{esc(message)}</p>' if message else ""
    if token_login:
        form = ('<form method="post" action="/ui/login">'
                f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
                '<label for="token">Gateway token</label>'
                '<textarea id="token" name="token" required autocomplete="off"></textarea>'
                '<p><button type="submit">Log in</button></p></form>')
    else:
        form = ("<p>Open the one-time login link that <code>runplane console</code> printed "
                "when it started (each link works once; restart the console for a new one).</p>")
    body = f'<div class="login"><h1>Log in</h1>{problem}{form}</div>'
    return frame("Log in", body, logged_in=False)


def message_page(title: str, text: str) -> str:
    return frame(title, f"<h1>{esc(title)}</h1><p>{esc(text)}</p>")


# -- runs ---------------------------------------------------------------------------------------
def runs_page(runs: list[RunRow], *, show_org: bool, org: str | None, play: str | None,
              state: str | None, plays: list[str], next_epoch: int | None,
              empty_schema: str | None = None) -> str:
    """The runs page; `empty_schema`: the schema named has no runplane tables yet. Its list
    (`#runs-list`) is kept live once `with_live_runs` names its stream."""
    head = ["play", "run id", "state", "epoch", "started", "duration", *RUN_FIGURES]
    if show_org:
        head.insert(0, "org")
    numeric = ("epoch", *RUN_FIGURES)
    ths = "".join(f'<th class="num" title="{esc(FIGURE_HINTS.get(h, ""))}">{h}</th>'
                  if h in numeric else f"<th>{h}</th>" for h in head)
    lines = []
    resume = []
    for run in runs:
        link = run_url(run.org_id, run.play, run.run_id, show_org)
        cells = [esc(run.play), f'<a href="{link}"><code>{esc(run.run_id)}</code></a>',
                 f'<span class="state-{esc(run.state.word)}">{esc(run.state.word)}</span>',
                 f'<td class="num">{run.epoch}', when(run.started), duration(run.duration_s)]
        cells += [f'<td class="num" data-figure="{name}">'
                  f'{"-" if run.figures is None else getattr(run.figures, name)}'
                  for name in RUN_FIGURES]
        if show_org:
            cells.insert(0, esc(run.org_id))
        lines.append("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}" for c in cells)
                     + "</tr>")
        if run.state is OutboxState.OPEN:
            command = run.command or (f"(started from Python: wake it with actors.open_run("
                                      f"tenant, {run.play!r}, {run.run_id!r}))")
            resume.append(f'<li><a href="{link}"><code>{esc(run.run_id)}</code></a>: '
                          f'<code>{esc(command)}</code></li>')
    filters = ('<form class="filters" method="get" action="/ui/">'
               + (f'<label>org<input name="org" value="{esc(org or "")}"></label>' if show_org else "")
               + f'<label>play{_options("play", plays, play)}</label>'
               f'<label>state{_options("state", tuple(s.word for s in OutboxState), state)}</label>'
               '<button type="submit">Filter</button></form>')
    table = (f'<table id="runs"><thead><tr>{ths}</tr></thead><tbody>{"".join(lines)}</tbody></table>'
             '<p class="muted">Each run\'s own figures, from its run history: what it admitted, '
             'found cached, completed, failed and retried (- : no map recorded yet).</p>'
             ) + ("" if lines else '<p class="muted" id="no-runs">No runs.</p>')
    table = f'<div id="runs-list" data-show-org="{int(show_org)}">{table}</div>'
    older = q("/ui/", org=org if show_org else None, play=play, state=state, before=next_epoch)
    more = (f'<p class="pager"><a id="older" href="{older}">Older runs →</a></p>'
            if next_epoch is not None else "")
    open_runs = (f'<h2>Resume open runs</h2><ul class="resume">{"".join(resume)}</ul>'
                 if resume else "")
    if empty_schema is not None:
        table = (f'<p class="notice" id="empty">Nothing has run here yet: schema '
                 f'<code>{esc(empty_schema)}</code> holds no runplane tables. Start a run '
                 '(<code>runplane run …</code>) with this schema and its runs appear here; '
                 'the console itself creates nothing.</p>')
    return frame("Runs", f"<h1>Runs</h1>{filters}{table}{more}{open_runs}")


def with_live_runs(page: str, *, org: str | None, play: str | None, state: str | None) -> str:
    """The runs `page` with its list kept live by `/ui/live/runs` of the same filters (`org`:
    for a viewer of every org)."""
    feed = q("/ui/live/runs", org=org, play=play, state=state)
    return page.replace('<div id="runs-list"', f'<div id="runs-list" data-live="{feed}"', 1)


def run_url(org: str, play: str, run_id: str, show_org: bool) -> str:
    return q(f"/ui/runs/{seg(play)}/{seg(run_id)}", org=org if show_org else None)


def row_url(org: str, play: str, namespace: str, key: str, show_org: bool) -> str:
    """A row's page (`/ui/rows/PLAY/TABLE/KEY`)."""
    return q(f"/ui/rows/{seg(play)}/{seg(namespace)}/{seg(key)}",
             org=org if show_org else None)


def table_url(kind: str, org: str, play: str, namespace: str, show_org: bool, **params: object) -> str:
    return q(f"/ui/{kind}/{seg(play)}/{seg(namespace)}", org=org if show_org else None, **params)


# -- one run --------------------------------------------------------------------------------------
def bar(segments: list[tuple[str, int]], total: int) -> str:
    """A progress bar: one rect per (word, rows) segment, left to right, out of `total`."""
    total = max(total, sum(value for _, value in segments), 1)
    x = 0.0
    rects = [f'<rect class="track" x="0" y="0" width="{BAR_WIDTH}" height="14"/>']
    for name, value in segments:
        width = BAR_WIDTH * value / total
        rects.append(f'<rect class="{name}" data-seg="{name}" x="{x:.1f}" y="0" '
                     f'width="{width:.1f}" height="14"/>')
        x += width
    return (f'<svg class="bar" viewBox="0 0 {BAR_WIDTH} 14" width="{BAR_WIDTH}" height="14" '
            f'role="img" aria-label="progress">{"".join(rects)}</svg>')


def sheet_bar(c: TableCounters) -> str:
    """A table's rows by state, from its counters."""
    return bar([("completed", c.completed), ("failed", c.failed), ("leased", c.leased),
                ("queued", c.queued)], c.total)


def run_bar(f: RunFigures) -> str:
    """What a run did on a table, out of its source rows (the rest: not done yet)."""
    return bar([("completed", f.completed), ("cached", f.cached), ("failed", f.failed)],
               max(f.source_rows, f.admitted, f.outcomes + f.cached + f.blocked))


def legend(words: Iterable[str], rest: str | None = None) -> str:
    keys = "".join(f'<i class="{w}"></i>{esc(w)}' for w in words)
    if rest:
        keys += f'<i class="track"></i>{esc(rest)}'
    return f'<p class="legend">{keys}</p>'


def chart(series: list[float]) -> str:
    top = max(series + [1.0])
    step = CHART_W / 59
    points = " ".join(f"{CHART_W - (len(series) - 1 - i) * step:.1f},"
                      f"{CHART_H - 2 - (CHART_H - 4) * v / top:.1f}"
                      for i, v in enumerate(series))
    return (f'<svg class="chart" viewBox="0 0 {CHART_W} {CHART_H}" width="{CHART_W}" '
            f'height="{CHART_H}" role="img" aria-label="rows per second, last minute">'
            f'<rect class="frame" x="0" y="0" width="{CHART_W}" height="{CHART_H}"/>'
            f'<polyline points="{points}"/></svg>')


def _stat(label: str, field: str, value: object, hint: str | None = None) -> str:
    title = f' title="{esc(hint)}"' if hint else ""
    return (f'<div{title}><span>{esc(label)}</span><b data-field="{field}">{esc(value)}</b>'
            '</div>')


def run_page(run: RunRow, tables: list[RunTable], *, show_org: bool, live_url: str,
             workers: list = (), cancel_csrf: str | None = None,
             notice: str | None = None, timeline: str = "") -> str:
    """A run's page; `cancel_csrf` (the session's form token) adds the cancel button, `notice`
    says what an action just did, `timeline` is its timeline (`timeline.timeline_section`)."""
    org = run.org_id
    parts = [f'<h1>Run <code>{esc(run.run_id)}</code> of play {esc(run.play)}</h1>',
             *([f'<p class="notice">{esc(notice)}</p>'] if notice else []),
             '<div class="stats">', _stat("org", "org", org),
             _stat("state", "state", run.state.word), _stat("epoch", "epoch", run.epoch),
             _stat("started", "started", when(run.started)),
             _stat("duration", "duration", duration(run.duration_s)), "</div>"]
    if run.state is OutboxState.OPEN and run.command:
        parts.append(f'<p>Resume: <code>{esc(run.command)}</code></p>')
    if run.state is OutboxState.OPEN and cancel_csrf:
        action = q(f"/ui/runs/{seg(run.play)}/{seg(run.run_id)}/cancel",
                   org=org if show_org else None)
        parts.append(f'<form method="post" action="{action}" class="action">'
                     f'<input type="hidden" name="csrf" value="{esc(cancel_csrf)}">'
                     '<button type="submit" name="cancel">Cancel run</button></form>')
    if not tables:
        parts.append('<p class="muted">This run has recorded no maps yet.</p>')
    for t in tables:
        mine, f = t.mine, t.mine.figures
        errors = _cause_rows(t.top_errors or (), org, run.play, mine.namespace, show_org)
        links = (f'<a href="{table_url("tables", org, run.play, mine.namespace, show_org)}">rows</a> · '
                 f'<a href="{table_url("failures", org, run.play, mine.namespace, show_org)}">failures</a>')
        running = "-" if t.counters is None else t.counters.running
        parts.append(
            f'<section class="map" data-map="{esc(mine.namespace)}">'
            f'<h2>Table {esc(mine.namespace)}</h2><p>{links}</p>'
            + '<h3>This run</h3><div class="stats">'
            + _stat("map", "map_state", MAP_STATE_WORDS.get(mine.state, mine.state))
            + "".join(_stat(name, name, getattr(f, name), FIGURE_HINTS[name])
                      for name in RUN_FIGURES)
            + _stat("rows/s (last minute)", "rate", "-", "completed and failed rows a second, "
                    "over the last 60 s")
            + _stat("ETA", "eta", "-") + "</div>"
            + legend(("completed", "cached", "failed"), "not done yet") + run_bar(f)
            + f'<div class="stats"><div>{chart([])}</div></div>'
            + '<h3>This table now, all runs</h3><div class="stats">'
            + _stat("running (any run)", "running", running, FIGURE_HINTS["running"])
            + "</div>"
            + (f'<h3>Top errors of this run</h3>{_cause_table(errors)}' if errors else "")
            + (f'<p class="muted">Top errors of this run: {UNKNOWN} counting them took too '
               'long (a large sheet); the figures above stay live.</p>'
               if t.top_errors is None else "")
            + "</section>")
    parts.append(timeline)
    if workers:  # the play's shared-map workers (`runplane worker`, `run --workers`)
        rows = "".join(
            f'<tr><td class="num">{w.pid}</td><td>{esc(w.host)}</td><td class="num">'
            f'{w.units_done}</td><td class="num">{w.seen_s_ago:.0f} s ago</td></tr>'
            for w in workers)
        parts.append('<section class="workers"><h2>Workers of the play\'s shared maps</h2>'
                     '<table><tr><th class="num">pid</th><th>host</th><th class="num">units done'
                     f'</th><th class="num">last seen</th></tr>{rows}</table></section>')
    body = (f'<div id="live" data-live="{esc(live_url)}" '
            f'data-map-states="{esc(json.dumps(MAP_STATE_WORDS))}">{"".join(parts)}</div>')
    return frame(f"Run {run.run_id}", body)


# -- a table and its failures -------------------------------------------------------------------
def _value(text: str | None) -> str:
    return '<span class="muted">∅</span>' if text is None else f"<code>{esc(shorten(text))}</code>"


@attrs.frozen
class TableTools:
    """What a table's page offers besides its rows: export links (label, URL) and the search
    form by input value (`row_html.search_form`)."""

    exports: tuple[tuple[str, str], ...]
    search: str = ""
    again: str = ""  # the retry and recompute forms (`actions.retry_forms`)


def table_page(org: str, play: str, namespace: str, page: RowsPage, *, show_org: bool,
               status: str | None, key: str | None, tools: TableTools) -> str:
    """A table's page, with its export links and search form (`tools`)."""
    exports, search = tools.exports, tools.search
    c = page.counters
    counts = "" if c is None else (
        '<div class="stats">' + "".join(_stat(name, name, getattr(c, name))
                                        for name in SHEET_COUNTERS)
        + "</div>" + legend(("completed", "failed", "leased", "queued")) + sheet_bar(c))
    columns = "".join(f'<tr><td>{esc(f)}</td><td class="num">{done}</td><td class="num">{failed}</td></tr>'
                      for f, done, failed in page.columns)
    columns_table = (f'<h2>Column counters</h2><table class="columns"><tr><th>field</th>'
                     f'<th class="num">completed</th><th class="num">failed</th></tr>{columns}</table>'
                     if columns else "")
    export = ('<h2>Export</h2><p id="exports">' + " · ".join(
        f'<a href="{url}" download>{esc(name)}</a>' for name, url in exports)
        + (" (the rows shown by the status filter)" if status else "")
        + f' · Parquet: <code>runplane export {esc(play)} {esc(namespace)} --format parquet</code>'
        '</p>')
    filters = (f'<form class="filters" method="get" action="/ui/tables/{esc(seg(play))}/{esc(seg(namespace))}">'
               + (f'<input type="hidden" name="org" value="{esc(org)}">' if show_org else "")
               + f'<label>status{_options("status", ROW_STATE_WORDS, status, ROW_STATE_WORDS)}</label>'
               f'<label>key starts with<input name="key" value="{esc(key or "")}"></label>'
               '<button type="submit">Filter</button></form>')
    head = "".join(f"<th>{esc(f)}</th>" for f in page.fields)
    rows = "".join(
        f'<tr><td><a href="{row_url(org, play, namespace, r["_key"], show_org)}"><code>'
        f'{esc(r["_key"])}</code></a></td><td>{esc(row_state(r["_status"]))}</td>'
        f'<td class="num">{esc(r["_attempts"])}</td>'
        + "".join(f"<td>{_value(r.get(f))}</td>" for f in page.fields)
        + f'<td>{esc(shorten(r["_error"]))}</td></tr>' for r in page.rows)
    grid = (f'<table id="rows"><thead><tr><th>key</th><th>status</th><th class="num">attempts</th>'
            f'{head}<th>error</th></tr></thead><tbody>{rows}</tbody></table>'
            if page.rows else '<p class="muted">No rows.</p>')
    more = _next_link("tables", org, play, namespace, show_org, page.next, status=status, key=key)
    links = (f'<p><a href="{table_url("failures", org, play, namespace, show_org)}">failures</a></p>')
    body = (f"<h1>Table {esc(namespace)} of play {esc(play)}</h1>{links}{counts}{tools.again}"
            f"{search}{filters}{grid}{more}{columns_table}{export}")
    return frame(f"Table {namespace}", body)


def _next_link(kind: str, org: str, play: str, namespace: str, show_org: bool,
               cursor: Cursor | None, **params: object) -> str:
    if cursor is None:
        return ""
    after = json.dumps([cursor.input_index, cursor.created, cursor.key], separators=(",", ":"))
    url = table_url(kind, org, play, namespace, show_org, after=after, **params)
    return f'<p class="pager"><a id="next" href="{url}">Next page →</a></p>'


# -- top errors: causes (`sheets.causes`) -----------------------------------------------------------
def _cause_rows(causes: Iterable[ErrorCause], org: str, play: str, namespace: str,
                show_org: bool) -> str:
    """One row per cause: its failed rows, the cause (linked to the failures of that cause) and
    an example message with how many other messages it stands for."""
    lines = []
    for cause in causes:
        url = table_url("failures", org, play, namespace, show_org, cause=cause.pattern)
        example = "(no message)" if cause.example is None else shorten(cause.example)
        more = f' <span class="muted">(+{cause.variants - 1} like it)</span>' \
            if cause.variants > 1 else ""
        lines.append(f'<tr><td class="num">{cause.count}</td><td><a href="{url}"><code>'
                     f'{esc(shorten(cause.pattern))}</code></a></td><td>{esc(example)}{more}</td>'
                     '</tr>')
    return "".join(lines)


def _cause_table(rows: str) -> str:
    return (f'<table class="errors"><tr><th class="num">rows</th><th>cause</th>'
            f'<th>example</th></tr>{rows}</table>')


def failures_page(org: str, play: str, namespace: str, page: RowsPage,
                  errors: list[ErrorCause] | None, *, show_org: bool,
                  cause: str | None = None) -> str:
    inputs = [f for f in page.fields if f not in page.outputs]
    lines = []
    for r in page.rows:
        shown = {f: r.get(f) for f in inputs if r.get(f) is not None}
        text = "{" + ", ".join(f"{json.dumps(f)}: {v}" for f, v in shown.items()) + "}"
        error = r["_error"] or "(no message)"
        lines.append(
            f'<tr><td><a href="{row_url(org, play, namespace, r["_key"], show_org)}"><code>'
            f'{esc(r["_key"])}</code></a></td><td class="num">{esc(r["_attempts"])}</td>'
            f'<td><details><summary>{esc(shorten(error, 80))}</summary><pre class="mono">'
            f'{esc(error)}</pre></details></td><td><code>{esc(shorten(text, 400))}</code></td></tr>')
    grid = (f'<table id="failures"><thead><tr><th>key</th><th class="num">attempts</th>'
            f'<th>error</th><th>inputs</th></tr></thead><tbody>{"".join(lines)}</tbody></table>'
            if lines else '<p class="muted">No failed rows.</p>')
    top = _cause_rows(errors or (), org, play, namespace, show_org)
    heading = "<h2>Most common errors, by cause</h2>"
    top_table = f'{heading}<div id="causes">{_cause_table(top)}</div>' if top else ""
    if errors is None:
        top_table = f"{heading}<p>{UNKNOWN} (counting them took too long)</p>"
    more = _next_link("failures", org, play, namespace, show_org, page.next, cause=cause)
    back = f'<p><a href="{table_url("tables", org, play, namespace, show_org)}">all rows</a></p>'
    if cause is not None:  # the filter: the rows of one cause, and the way back to all of them
        count = next((c.count for c in errors or () if c.pattern == cause), None)
        rows_of = "" if count is None else f" ({count} row{'s' if count != 1 else ''})"
        back += (f'<p id="cause">Failures of cause <code>{esc(cause)}</code>{rows_of} · <a href="'
                 f'{table_url("failures", org, play, namespace, show_org)}">all failures</a></p>')
    body = f"<h1>Failures of table {esc(namespace)} of play {esc(play)}</h1>{back}{grid}{more}{top_table}"
    return frame(f"Failures of {namespace}", body)
