"""Previous cells: what a re-admitted row already holds, handed to the function that reruns it.

How it works
- With `previous_cells=True` (`admit`, `run.map`, the action `sheets.admit`), every pending row
  of an admission carries `row["_previous"]`: for a row that was already stored and is
  re-admitted (it failed, some output is missing or stale, or `force` re-admits it), the
  output cells a cache hit would keep — present (not NULL, JSON null or ""), cell meta status
  `completed`, fresh under the cell policies (`dispositions.fresh_cell`) — as
  `{output: value}`; a new row gets `{}`. A function can then skip an output it completed in
  an earlier run (`actors.RowError` stores some outputs and fails the rest).
- The cells are read by the admission statement itself, from the snapshot it judges the rows
  by (the cells as they were before a forced admission marked them pending): no second query.
  When the option is off the statement has no such part at all.
- A budget bounds the cell text one admission call hands out (`PREVIOUS_CELLS_BUDGET_BYTES`,
  1 MiB, by default; `previous_cells_budget_bytes`): each re-admitted row's cells cost the
  bytes of their JSON text as the server writes it, summed in input order over the call (the
  statement of each chunk gets what earlier chunks left); a row with cells past the budget
  gets `{"_truncated": True}` instead of them — its function recomputes every output. A row
  with no completed cell costs nothing and always gets `{}`. A gateway client hands the
  pages of one call what is left after the earlier pages (measured as compact JSON on its
  side).
This module does no I/O.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from .. import canonical
from ..pg import Record

from .dispositions import Disposition, fresh_cell
from .sheet_write import PREVIOUS_CELLS_BUDGET_BYTES, check_budget

__all__ = ["PREVIOUS", "TRUNCATED", "PREVIOUS_CELLS_BUDGET_BYTES", "check_budget",
           "previous_cte", "previous_columns", "previous_of", "with_previous", "cells_bytes"]

PREVIOUS = "_previous"
TRUNCATED = "_truncated"


def previous_cte(outputs: Sequence[tuple[str, str, str | None]]) -> str:
    """The CTE `previous` over the admission statement's `decided`: for each re-admitted row
    (ordinal), its fresh completed cells and their bytes, and the running byte total in input
    order. `outputs` are (column, field bind, stale-after bind) as `output_binds` gives them;
    `decided` names the stored cells `o0`, `o1`, … and the cell meta `prev_meta`."""
    if outputs:
        values = ", ".join(
            f"({name}::text, d.o{i}, coalesce({fresh_cell(f'd.o{i}', f'(d.prev_meta -> {name})', seconds)}, false))"
            for i, (_col, name, seconds) in enumerate(outputs))
        cells = f"""CROSS JOIN LATERAL (
          SELECT coalesce(jsonb_object_agg(f.name, f.value), '{{}}'::jsonb) AS cells,
                 coalesce(sum(octet_length(f.value::text)), 0) AS bytes
            FROM (VALUES {values}) AS f(name, value, fresh)
           WHERE f.fresh) AS x"""
    else:
        cells = "CROSS JOIN LATERAL (SELECT '{}'::jsonb AS cells, 0::bigint AS bytes) AS x"
    return f"""
previous AS MATERIALIZED (
    SELECT d.ord, x.cells, x.bytes, sum(x.bytes) OVER (ORDER BY d.ord) AS running
      FROM decided d
      {cells}
     WHERE d.disposition = {Disposition.ADMIT.sql}
),"""


def previous_columns(budget: str) -> str:
    """The statement's result columns for previous cells, `budget` the bind of the bytes this
    chunk may hand out: `previous` (a JSON array of [ordinal, cells or null when past the
    budget]) and `previous_bytes` (the bytes of the cells handed out)."""
    shown = f"x.bytes = 0 OR x.running <= {budget}"
    return f""",
       (SELECT jsonb_agg(jsonb_build_array(x.ord, CASE WHEN {shown} THEN x.cells END)
                         ORDER BY x.ord) FROM previous AS x)::text AS previous,
       (SELECT coalesce(sum(x.bytes) FILTER (WHERE {shown}), 0)
          FROM previous AS x)::bigint AS previous_bytes"""


def previous_of(record: Record, low: int, locate: Callable[[int, int], int],
                into: dict[int, dict]) -> None:
    """Add the previous cells one chunk's result `record` reports (its first row at `low`) to
    `into`, by row position (`locate` maps a chunk ordinal to it)."""
    for ord_, cells in canonical.loads(record["previous"] or "[]"):
        into[locate(low, ord_)] = cells if cells is not None else {TRUNCATED: True}


def with_previous(row: Mapping[str, object], cells: dict | None) -> dict:
    """`row` with its previous cells (`{}` when it has none)."""
    return {**row, PREVIOUS: cells if cells is not None else {}}


def cells_bytes(cells: object) -> int:
    """What the previous cells handed to one row cost, measured on a client (compact JSON of
    each value; a truncated marker costs nothing)."""
    if not isinstance(cells, dict) or cells.get(TRUNCATED) is True:
        return 0
    return sum(len(canonical.stable_dumps(value).encode("utf-8")) for value in cells.values())
