"""A run's own figures on the console, read from its run history (`run_maps`, written by
`engine.runs.history`).

How it works
- What a run did is what its maps recorded: admitted, cached, completed, failed, retried (calls
  of this run that raised and were called again), blocked, its source rows and the rows it has
  in flight. Those are the run's own counts, kept per map of the run, so they never change when
  a later run (a `force` run, a rerun) rewrites the same rows, and they grow monotonically while
  the run runs: the runs list, a run's page and its live stream show them, never "the rows a run
  last wrote" (a sheet scan by `_run_id`).
- Both reads are primary-key ranges of `run_maps` (org, play, run): `run_totals` sums a page of
  runs in one statement, `run_maps` reads one run's maps with the database's clock (when each
  entry was written, and now), which the live stream's rates are computed from (`rates`).
- A map whose entry says `running` but was not written for `history.LIVE_S` seconds is shown
  as `interrupted` (a crash, Ctrl-C): its counts are its last ones, until a wake replaces them.
- Callers run these inside `queries.read` (read-only, bounded); they check the viewer first.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from ..runs.history import LIVE_S, MapRunState
from ..pg import Connection, Record
from ..ports import Port, table

_FIGURES = ("source_rows", "admitted", "cached", "completed", "failed", "blocked", "retried",
            "in_flight")


@attrs.frozen
class RunFigures:
    """What a run did on some tables (summed over its maps), from its run history."""

    source_rows: int = 0
    admitted: int = 0
    cached: int = 0
    completed: int = 0
    failed: int = 0
    blocked: int = 0
    retried: int = 0
    in_flight: int = 0  # admitted and not yet given an outcome

    @property
    def outcomes(self) -> int:
        """Rows given an outcome (what rows/s counts)."""
        return self.completed + self.failed

    @property
    def remaining(self) -> int:
        """Source rows that have neither an outcome nor a cache hit nor a block yet."""
        return max(0, self.source_rows - self.outcomes - self.cached - self.blocked)

    def __add__(self, other: "RunFigures") -> "RunFigures":
        return RunFigures(*(getattr(self, f) + getattr(other, f) for f in _FIGURES))

    def as_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in _FIGURES}


@attrs.frozen
class MapFigures:
    """A run's maps of one table: their figures, state and when their entry was last written."""

    namespace: str
    state: MapRunState  # shown as its `words.MAP_STATE_WORDS` word
    figures: RunFigures
    written_at: float  # seconds since the epoch, the database's clock

    @property
    def running(self) -> bool:
        return self.state is MapRunState.RUNNING


_TOTALS = f"""
SELECT m.org_id, m.play, m.run_id,
       sum(m.source_rows)::bigint AS source_rows, sum(m.admitted)::bigint AS admitted,
       sum(m.cached)::bigint AS cached, sum(m.completed)::bigint AS completed,
       sum(m.failed)::bigint AS failed, sum(m.blocked)::bigint AS blocked,
       sum(m.retried)::bigint AS retried,
       sum(m.running) FILTER (WHERE m.state = {MapRunState.RUNNING.sql}
                                AND m.updated_at > now() - make_interval(secs => $4))::bigint
           AS in_flight
  FROM unnest($1::text[], $2::text[], $3::text[]) AS g(org_id, play, run_id)
  JOIN {{run_maps}} AS m USING (org_id, play, run_id)
 GROUP BY m.org_id, m.play, m.run_id
"""

_MAPS = """
SELECT table_namespace, state, source_rows, admitted, cached, completed, failed, blocked, retried,
       running AS in_flight, updated_at <= now() - make_interval(secs => $4) AS stale,
       extract(epoch FROM updated_at)::float8 AS written_at,
       extract(epoch FROM now())::float8 AS now
  FROM {run_maps}
 WHERE org_id = $1 AND play = $2 AND run_id = $3
 ORDER BY started_at, map_key
"""


def _figures(record: Record) -> RunFigures:
    return RunFigures(*(record[f] or 0 for f in _FIGURES))


async def run_totals(conn: Connection, port: Port, runs: Iterable[tuple[str, str, str]]
                     ) -> dict[tuple[str, str, str], RunFigures]:
    """Each run's figures summed over its maps, by (org, play, run id); a run that recorded no
    map is absent. One statement for a page of runs."""
    keys = list(runs)
    if not keys:
        return {}
    records = await conn.fetch(_TOTALS.format(run_maps=table(port, "run_maps")),
                               [k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys],
                               LIVE_S)
    return {(r["org_id"], r["play"], r["run_id"]): _figures(r) for r in records}


async def run_maps(conn: Connection, port: Port, org: str, play: str, run_id: str
                   ) -> tuple[list[MapFigures], float | None]:
    """The run's maps, one per table in the order the run first mapped it (maps of the same
    table summed), and the database's clock now (None when the run recorded no map)."""
    records = await conn.fetch(_MAPS.format(run_maps=table(port, "run_maps")),
                               org, play, run_id, LIVE_S)
    by_table: dict[str, list[Record]] = {}
    for record in records:
        by_table.setdefault(record["table_namespace"], []).append(record)
    found = []
    running, interrupted = MapRunState.RUNNING, MapRunState.INTERRUPTED
    for namespace, entries in by_table.items():
        # a value no member spells is kept as stored (and shown so)
        states = [interrupted if e["state"] == running and e["stale"]
                  else MapRunState.coerce(e["state"]) for e in entries]
        state = next((s for s in (running, interrupted) if s in states), states[-1])
        figures = RunFigures()
        for e in entries:
            mine = _figures(e)
            figures += mine if e["state"] == running and not e["stale"] else attrs.evolve(
                mine, in_flight=0)
        found.append(MapFigures(namespace, state, figures, max(e["written_at"] for e in entries)))
    return found, (records[0]["now"] if records else None)
