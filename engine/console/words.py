"""The words the console shows people for row states and run figures: one table, every page.

How it works
- A sheet stores a row's state as `_status` (`pending`, `running`, `enriched`, `failed`); those
  values stay in storage and in API filters (`?status=enriched`). People read the words of
  §27 instead: `ROW_STATE_WORDS` maps each stored value to its word, and every page that shows
  a row's state, a status filter or a counter label takes its word from here (`row_state`).
- A run's own figures, from its run history, are named once in `RUN_FIGURES` (admitted,
  cached, completed, failed, retried: what the run did, never the rows it last wrote), and a
  map's history state in `MAP_STATE_WORDS`.
- Pure: no I/O; pages import it.
"""

from __future__ import annotations

from ..runs.history import MapRunState
from ..sheets.model import RowStatus

ROW_STATE_WORDS: dict[str, str] = {
    RowStatus.PENDING: "queued",
    RowStatus.RUNNING: "leased",  # admitted to a live attempt ("running" is in a call)
    RowStatus.ENRICHED: "completed",
    RowStatus.FAILED: "failed",
}
# The counters of a sheet (`sheet_summary`) by the word shown for each, in display order.
SHEET_COUNTERS = ("total", "queued", "running", "leased", "completed", "failed")
RUN_FIGURES = ("admitted", "cached", "completed", "failed", "retried")
FIGURE_HINTS = {
    "admitted": "source rows this run admitted (queued to run, or found cached or blocked)",
    "cached": "rows this run reused from earlier runs without calling the function",
    "completed": "rows this run completed",
    "failed": "rows this run gave a failed outcome",
    "retried": "calls of this run that raised and were called again",
    "running": "rows of this table inside a call of the function now, in any live process "
               "of any run",
    "leased": "rows of this table admitted to a live attempt and not yet written",
}
MAP_STATE_WORDS: dict[str, str] = {
    MapRunState.RUNNING: "running", MapRunState.FINISHED: "finished",
    MapRunState.STOPPED_EARLY: "stopped early", MapRunState.SUPERSEDED: "superseded",
    MapRunState.FAILED: "failed", MapRunState.INTERRUPTED: "interrupted (no longer written)"}


def row_state(status: str | None) -> str:
    """The word shown for a stored `_status` value (an unknown value is shown as stored)."""
    return ROW_STATE_WORDS.get(status or "", status or "")
