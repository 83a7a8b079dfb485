"""The console's HTML of single rows: a row's page, the search form and its matches.

How it works
- Built like every page (`pages.frame`, every stored or requested value through `pages.esc`);
  values are shown as the JSON text stored, shortened in listings, whole on a row's page.
- A row's page shows its inputs, then each output with its cell (`_cells`: status,
  completed_at, the run that wrote it, attempts, and the value last stored when the cell is not
  completed), the row's failure (error and cause, linked to the failures of that cause) and the
  runs that touched it, each linked to its page.
- The search form (on a table's page) names the input fields, marking those with an index; its
  answer page lists the matches (one match goes straight to the row's page) and says when the
  search was a bounded scan and how to make it exact (`runplane index PLAY TABLE FIELD`).
"""

from __future__ import annotations

import json

from ..canonical import JsonObject
from .pages import _stat, esc, frame, row_url, run_url, shorten, table_url, when
from .params import seg
from .rowpage import RowView, TouchingRun
from .search import SearchResult
from .words import row_state


def _json(text: str | None, limit: int | None = None) -> str:
    if text is None:
        return '<span class="muted">∅</span>'
    return f"<code>{esc(text if limit is None else shorten(text, limit))}</code>"


def search_form(org: str, play: str, namespace: str, fields: list[str], indexed: set[str], *,
                show_org: bool, field: str | None = None, value: str = "") -> str:
    """The form that finds rows by an input value (a GET of `/ui/search/PLAY/TABLE`)."""
    if not fields:
        return ""
    options = "".join(
        f'<option value="{esc(f)}"{" selected" if f == field else ""}>'
        f'{esc(f)}{" (indexed)" if f in indexed else ""}</option>' for f in fields)
    action = f"/ui/search/{esc(seg(play))}/{esc(seg(namespace))}"
    return (f'<form class="filters" id="search" method="get" action="{action}">'
            + (f'<input type="hidden" name="org" value="{esc(org)}">' if show_org else "")
            + f'<label>find rows where<select name="field">{options}</select></label>'
            f'<label>equals<input name="value" value="{esc(value)}" required></label>'
            '<button type="submit">Find</button></form>')


def search_note(play: str, namespace: str, found: SearchResult) -> str:
    """What kind of search answered: an index, a whole scan, a bounded one, or none in time."""
    command = f"runplane index {play} {namespace} {found.field}"
    if found.indexed:
        return f'<p class="muted" id="search-note">Answered from the index of {esc(found.field)}.</p>'
    if found.timed_out:
        return (f'<p class="notice" id="search-note">No index on {esc(found.field)}, and scanning '
                f'the table took too long: <code>{esc(command)}</code> makes this search exact '
                'and fast.</p>')
    if found.complete:
        return (f'<p class="muted" id="search-note">No index on {esc(found.field)}: searched all '
                f'{found.scanned} rows (<code>{esc(command)}</code> makes it an index lookup).</p>')
    return (f'<p class="notice" id="search-note">No index on {esc(found.field)}: searched the '
            f'first {found.scanned:,} rows; <code>{esc(command)}</code> makes this exact.</p>')


def matches_page(org: str, play: str, namespace: str, found: SearchResult, rows: list[RowView],
                 form: str, *, show_org: bool) -> str:
    lines = "".join(
        f'<tr><td><a href="{row_url(org, play, namespace, r.key, show_org)}"><code>'
        f'{esc(r.key)}</code></a></td><td>{esc(row_state(r.status))}</td>'
        f'<td class="num">{esc(r.attempts)}</td><td>{_inputs_inline(r)}</td></tr>' for r in rows)
    grid = (f'<table id="matches"><thead><tr><th>key</th><th>status</th><th class="num">attempts'
            f'</th><th>inputs</th></tr></thead><tbody>{lines}</tbody></table>'
            if lines else '<p class="muted" id="no-matches">No row matches.</p>')
    more = (f'<p class="muted">The first {len(rows)} matches in row order; there are more.</p>'
            if found.more else "")
    back = f'<p><a href="{table_url("tables", org, play, namespace, show_org)}">all rows</a></p>'
    title = f"Rows of table {namespace} where {found.field} = {found.value}"
    body = (f"<h1>{esc(title)}</h1>{back}{form}{search_note(play, namespace, found)}{grid}"
            f"{more}")
    return frame(f"Search {namespace}", body)


def _inputs_inline(row: RowView) -> str:
    text = "{" + ", ".join(f"{json.dumps(f)}: {v}" for f, v in row.inputs.items()
                           if v is not None) + "}"
    return f"<code>{esc(shorten(text, 400))}</code>"


def _cell_rows(org: str, play: str, row: RowView, show_org: bool) -> str:
    lines = []
    for field, shown in row.outputs.items():
        cell: JsonObject = row.cells.get(field) or {}
        run_id = cell.get("run_id")
        run = (f'<a href="{run_url(org, play, run_id, show_org)}"><code>{esc(run_id)}</code></a>'
               if isinstance(run_id, str) else "-")
        last = cell.get("last_value")
        kept = ("" if shown is not None or last is None
                else _json(json.dumps(last, ensure_ascii=False)))
        lines.append(
            f'<tr data-cell="{esc(field)}"><td>{esc(field)}</td><td>{_json(shown)}</td>'
            f'<td data-field="cell-status">{esc(cell.get("status", "-"))}</td>'
            f'<td>{esc(cell.get("completed_at") or "-")}</td><td>{run}</td>'
            f'<td class="num">{esc(cell.get("attempts", "-"))}</td><td>{kept}</td></tr>')
    return "".join(lines)


def row_page(org: str, play: str, namespace: str, row: RowView, runs: list[TouchingRun], *,
             show_org: bool) -> str:
    stats = ('<div class="stats">' + _stat("status", "status", row_state(row.status))
             + _stat("attempts", "attempts", "-" if row.attempts is None else row.attempts,
                     "calls of the function, across runs")
             + _stat("runs failed in", "failed_runs",
                     "-" if row.failed_runs is None else row.failed_runs)
             + _stat("input index", "input_index",
                     "-" if row.input_index is None else row.input_index)
             + _stat("created", "created", when(row.created))
             + _stat("last written", "updated", when(row.updated)) + "</div>")
    inputs = "".join(f"<tr><td>{esc(f)}</td><td>{_json(v)}</td></tr>"
                     for f, v in row.inputs.items())
    parts = [f'<h1>Row <code>{esc(row.key)}</code></h1>',
             f'<p>Table <a href="{table_url("tables", org, play, namespace, show_org)}">'
             f'{esc(namespace)}</a> of play {esc(play)}</p>', stats,
             f'<h2>Inputs</h2><table id="inputs"><tr><th>field</th><th>value</th></tr>{inputs}'
             '</table>']
    cells = _cell_rows(org, play, row, show_org)
    if cells:
        parts.append('<h2>Outputs</h2><table id="outputs"><tr><th>field</th><th>value</th>'
                     '<th>cell</th><th>completed at</th><th>run</th><th class="num">attempts'
                     f'</th><th>last value kept</th></tr>{cells}</table>')
    if row.error is not None or row.cause is not None:
        cause = "" if row.cause is None else (
            f'<p>Cause: <a href="{table_url("failures", org, play, namespace, show_org, cause=row.cause)}">'
            f'<code>{esc(row.cause)}</code></a></p>')
        runs_failed = ("" if not row.failed_runs else
                       f'<p class="muted">It failed in {row.failed_runs} run(s); the error '
                       'kept is the last one.</p>')
        parts.append(f'<h2>Failure</h2><section id="failure"><pre class="mono">'
                     f'{esc(row.error or "(no message)")}</pre>{cause}{runs_failed}</section>')
    if runs:
        items = "".join(
            f'<li><a href="{run_url(org, play, r.run_id, show_org)}"><code>{esc(r.run_id)}'
            f'</code></a> (epoch {r.epoch}, started {esc(when(r.started))}): '
            f'{esc(", ".join(r.roles) or "touched it")}</li>' for r in runs)
        parts.append(f'<h2>Runs that touched it</h2><ul id="row-runs">{items}</ul>')
    return frame(f"Row {row.key}", "".join(parts))


def row_json(row: RowView, runs: list[TouchingRun]) -> JsonObject:
    """A row's page as JSON (`/ui/api/rows/...`): values as stored JSON (parsed)."""
    def parse(text: str | None) -> object:
        return None if text is None else json.loads(text)

    return {"key": row.key, "status": row.status, "error": row.error, "cause": row.cause,
            "attempts": row.attempts, "failed_runs": row.failed_runs, "run_id": row.run_id,
            "input_index": row.input_index, "created_at": row.created.isoformat(),
            "updated_at": row.updated.isoformat(),
            "inputs": {f: parse(v) for f, v in row.inputs.items()},
            "outputs": {f: parse(v) for f, v in row.outputs.items()},
            "_cells": row.cells,
            "runs": [{"run_id": r.run_id, "epoch": r.epoch, "started": r.started.isoformat(),
                      "roles": list(r.roles)} for r in runs]}
