"""A run's timeline: what happened to it, in time order, from what the store keeps.

How it works
- Read in one snapshot (`queries.read`), each a primary-key range of the run: the run's row
  (`runs`: registered at `created_at`, cancellation asked at `cancel_requested_at`), its outbox
  entry (`terminal_outbox`: the run ended, retiring or retired, at `updated_at`), its run history
  (`run_maps`: each map started at `started_at`, ended at `ended_at` with its state and stop
  reason and the calls it retried; a map still `running` whose row is older than
  `history.LIVE_S` is shown as no longer written since then), and for shared maps
  (`shared_maps`, `shared_units`) when each was published and how many of its units were claimed
  again (a unit's `claims` past its first: a lease taken over after it expired or was released).
- The outages the run rode out (`run_outages`, `engine.runs.outages`): when each wait began and
  how long it lasted, as its processes wrote them with a map's next heartbeat.
- Retries and lease takeovers are counted per map, not stamped one by one: they are shown on
  the map's end (or last write).
- `timeline_section` renders it for a run's page (every value escaped, `pages.esc`).
"""

from __future__ import annotations

import datetime
import enum

import attrs

from ..pg import Connection
from ..ports import Port, table
from ..runs.history import LIVE_S, MapRunState
from ..runs.outbox import OutboxState
from .pages import esc, when
from .queries import read
from .words import MAP_STATE_WORDS

MAX_MAPS = 200


class EventKind(enum.Enum):
    """What a timeline event is."""

    REGISTERED = "registered"
    PUBLISHED = "published"
    MAP_STARTED = "map_started"
    MAP_ENDED = "map_ended"
    MAP_LAST_WRITTEN = "map_last_written"
    CANCEL_REQUESTED = "cancel_requested"
    OUTAGE = "outage"
    RUN_ENDED = "run_ended"


@attrs.frozen
class Event:
    at: datetime.datetime
    kind: EventKind
    text: str
    table: str | None = None


_RUN = """
SELECT r.created_at, r.cancel_requested_at, o.state, o.updated_at AS settled
  FROM {runs} AS r
  LEFT JOIN {outbox} AS o ON o.org_id = r.org_id AND o.play = r.play AND o.run_id = r.run_id
 WHERE r.org_id = $1 AND r.play = $2 AND r.run_id = $3
"""

_MAPS = """
SELECT m.map_key, m.table_namespace, m.state, m.started_at, m.ended_at, m.updated_at,
       m.completed, m.failed, m.cached, m.retried, m.stop_reason,
       extract(epoch FROM now() - m.updated_at)::float8 AS age_s,
       s.created_at AS published_at,
       (SELECT coalesce(sum(greatest(u.claims - 1, 0)), 0) FROM {units} AS u
         WHERE u.org_id = m.org_id AND u.play = m.play AND u.run_id = m.run_id
           AND u.map_invocation_id = m.map_key)::bigint AS reclaimed
  FROM {maps} AS m
  LEFT JOIN {shared} AS s ON s.org_id = m.org_id AND s.play = m.play AND s.run_id = m.run_id
                         AND s.map_invocation_id = m.map_key
 WHERE m.org_id = $1 AND m.play = $2 AND m.run_id = $3
 ORDER BY m.started_at LIMIT {limit}
"""


_OUTAGES = """
SELECT began_at, seconds FROM {outages}
 WHERE org_id = $1 AND play = $2 AND run_id = $3
 ORDER BY began_at LIMIT {limit}
"""


def _map_end(r) -> str:
    state = MAP_STATE_WORDS.get(r["state"], r["state"])
    said = [f"{r['completed']} completed, {r['failed']} failed, {r['cached']} cached"]
    if r["retried"]:
        said.append(f"{r['retried']} calls retried")
    if r["reclaimed"]:
        said.append(f"{r['reclaimed']} units claimed again (leases taken over or released)")
    reason = f" ({r['stop_reason']})" if r["stop_reason"] else ""
    return f"map of {r['table_namespace']} {state}{reason}: " + "; ".join(said)


async def run_timeline(port: Port, org: str, play: str, run_id: str) -> list[Event]:
    """The run's events in time order (see the module docstring); [] for an unknown run."""
    run_sql = _RUN.format(runs=table(port, "runs"), outbox=table(port, "terminal_outbox"))
    maps_sql = _MAPS.format(maps=table(port, "run_maps"), units=table(port, "shared_units"),
                            shared=table(port, "shared_maps"), limit=MAX_MAPS)
    outages_table = table(port, "run_outages")  # (a schema older than version 14 has none)
    outages_sql = _OUTAGES.format(outages=outages_table, limit=MAX_MAPS)

    async def op(conn: Connection) -> list[Event]:
        run = await conn.fetchrow(run_sql, org, play, run_id)
        if run is None:
            return []
        events = [Event(run["created_at"], EventKind.REGISTERED, "run registered")]
        for r in await conn.fetch(maps_sql, org, play, run_id):
            ns = r["table_namespace"]
            if r["published_at"] is not None:
                events.append(Event(r["published_at"], EventKind.PUBLISHED,
                                    f"map of {ns} published for workers", ns))
            events.append(Event(r["started_at"], EventKind.MAP_STARTED, f"map of {ns} started",
                                ns))
            if r["ended_at"] is not None:
                events.append(Event(r["ended_at"], EventKind.MAP_ENDED, _map_end(r), ns))
            elif r["state"] == MapRunState.RUNNING and r["age_s"] > LIVE_S:
                events.append(Event(r["updated_at"], EventKind.MAP_LAST_WRITTEN,
                                    f"map of {ns} last written (its process is gone): "
                                    + _map_end(r).split(": ", 1)[1], ns))
        kept = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", outages_table)
        for r in await conn.fetch(outages_sql, org, play, run_id) if kept else ():
            events.append(Event(r["began_at"], EventKind.OUTAGE,
                                f"the database was away: the run waited {r['seconds']:.1f} s "
                                "and went on"))
        if run["cancel_requested_at"] is not None:
            events.append(Event(run["cancel_requested_at"], EventKind.CANCEL_REQUESTED,
                                "cancellation requested"))
        if run["state"] is not None and run["state"] != OutboxState.OPEN:
            word = OutboxState(run["state"]).word
            events.append(Event(run["settled"], EventKind.RUN_ENDED, f"run ended ({word})"))
        return sorted(events, key=lambda e: e.at)

    return await read(port, op)


def timeline_section(events: list[Event]) -> str:
    """The timeline of a run's page."""
    if not events:
        return ""
    items = "".join(f'<li data-event="{e.kind.value}"><time>{esc(when(e.at))}</time> '
                    f'{esc(e.text)}</li>' for e in events)
    return (f'<section id="timeline"><h2>Timeline</h2><ol class="timeline">{items}</ol>'
            '<p class="muted">Retries and units claimed again are counted per map.</p>'
            '</section>')
