"""Shared maps: one map's units handed out as leases to many worker processes.

How it works
- `publish` writes, in one statement, the map's row in `shared_maps` (run, map, epoch, table
  namespace, its configuration: contract and row policies as JSON, the function's qualified
  name, the play file's digest) and one `shared_units` row per unit: a slice of at most
  `UNIT_ROWS` rows of one staged page (page ordinal, first input index, row count). A map is
  published `waiting`; `set_state` opens it (workers may claim; the coordinator opens it once
  its workers joined) and closes it, `done` or `cancelled`, adding one to its sheet's `writes`
  as it moves it (a plain map's write group then leaves the sheet to it: `engine.sheets
  .write_group`). Publishing again (a wake) keeps
  the units and their done marks and makes a cancelled map waiting again.
- Workers `join` (one row in `shared_workers`, its heartbeat `seen_at`); `workers_joined`
  counts those seen since the map was published, `workers` lists them (pid, host, units done).
- The units' leases, claims, renewals and the checks that guard writes are in
  `engine.shared.leases`; the unit writes in `engine.shared.units`. `map_status` sums the
  counters every unit's holders recorded (each with the rows it counts, in one transaction)
  for the coordinator's result; `units_remaining` counts the play's units not done.
- A map's lease length is bounded (`receipts.MAX_LEASE_S`). `live_maps` and `units_remaining`
  take `only_runs` (the gateway fills it with a run-scoped token's `runs` claim): the maps of
  other runs are then neither listed nor counted.
- The table namespace is stored normalized (`normalize_namespace`), as the sheet knows it: a
  write without an attempt finds the leased units of its sheet by it (`engine.sheets
  .completion`) and is fenced on their rows.
Every statement reaches its rows by primary-key prefix (org, play, run, map), and the sheet's
summary row by its key when `set_state` moves a map: never the sheet's own table.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Mapping, Sequence

import attrs

from .. import canonical
from ..actions import action
from ..canonical import JsonObject, JsonValue
from ..limits.bounds import is_number
from ..values.codecs import (
    BOOL, FLOAT, INT, INT32, NOTHING, RAW, RUN_REF, TEXT, dict_of, enum_of, list_of, optional,
    record,
)
from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..receipts import MAX_LEASE_S
from ..sql import SqlLiteral
from ..values.scopes import RunRef, RunScope, check_scope, normalize_namespace

UNIT_ROWS = 500       # rows of one unit, at most (a slice of one staged page)
LEASE_S = 30.0        # a unit's lease (workers renew it every third of it while rows run)


class MapState(SqlLiteral):
    """A shared map's `state` in `shared_maps`; SQL text writes `MapState.X.sql`."""

    WAITING = "waiting"      # published, its units not yet handed out
    OPEN = "open"            # units are claimed by workers
    DONE = "done"            # every unit done: the map is closed
    CANCELLED = "cancelled"  # given up (a new publish of it starts it waiting again)


# The names callers use (`sm.OPEN`): members of `MapState`, not a second definition.
WAITING, OPEN, DONE, CANCELLED = MapState
LIVE = (WAITING, OPEN)  # the states a map can be opened or closed from
COUNTERS = ("rows", "cached", "blocked", "skipped", "executed", "completed", "failed",
            "fenced", "calls", "retried", "timed_out")


@attrs.frozen
class SharedMap:
    """A published map as a worker reads it."""

    ref: RunRef
    map_invocation_id: str
    table_namespace: str
    config: JsonObject
    function: str
    play_digest: str
    state: MapState = attrs.field(converter=MapState)
    lease_s: float


@attrs.frozen
class MapStatus:
    state: MapState | None = attrs.field(  # None: no such map
        converter=attrs.converters.optional(MapState))
    units: int
    done: int
    counters: Mapping[str, int]


@attrs.frozen
class WorkerInfo:
    """A worker that joined a play's shared maps."""

    worker_id: str
    pid: int
    host: str
    units_done: int
    seen_s_ago: float


SHARED_MAP = record(SharedMap, ref=RUN_REF, map_invocation_id=TEXT, table_namespace=TEXT,
                    config=RAW, function=TEXT, play_digest=TEXT, state=enum_of(MapState),
                    lease_s=FLOAT)
MAP_STATUS = record(MapStatus, state=optional(enum_of(MapState)), units=INT, done=INT, counters=dict_of(INT))
WORKER_INFO = record(WorkerInfo, worker_id=TEXT, pid=INT, host=TEXT, units_done=INT,
                     seen_s_ago=FLOAT)


def plan_units(cuts: Sequence[tuple[int, int]], unit_rows: int = UNIT_ROWS) -> list[tuple[int, int, int]]:
    """(page, low, row_count) of each unit of a staged input whose pages are `cuts`
    ((offset, rows) each): every page cut into slices of at most `unit_rows` rows."""
    units = []
    for page, (offset, count) in enumerate(cuts):
        for low in range(offset, offset + count, unit_rows):
            units.append((page, low, min(unit_rows, offset + count - low)))
    return units


def map_id_for(map_invocation_id: str, table_namespace: str) -> str:
    """The id a shared map is published under: its id within its sheet plus a digest of the
    sheet's namespace. Shared maps are keyed by run, and a run numbers the maps of each sheet
    from `map-0`, so two sheets' maps in one run would otherwise share an id."""
    digest = hashlib.sha256(normalize_namespace(table_namespace).encode()).hexdigest()[:12]
    return f"{map_invocation_id}-{digest}"


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


def map_key(ref: RunRef, map_invocation_id: str) -> tuple[str, str, str, str]:
    scope = ref.scope
    return scope.org_id, scope.play, scope.run_id, map_invocation_id


_PUBLISH = f"""
WITH published AS (
    INSERT INTO {{maps}} AS m (org_id, play, run_id, map_invocation_id, epoch, table_namespace,
                             config, function, play_digest, state, units, lease_s)
    VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8, $9, {WAITING.sql}, cardinality($10::int[]), $14)
    ON CONFLICT (org_id, play, run_id, map_invocation_id) DO UPDATE
       SET state = {WAITING.sql}, config = EXCLUDED.config, function = EXCLUDED.function,
           play_digest = EXCLUDED.play_digest, lease_s = EXCLUDED.lease_s
     WHERE m.state = {CANCELLED.sql}
), units AS (
    INSERT INTO {{units}} (org_id, play, run_id, map_invocation_id, unit, page, low, row_count)
    SELECT $1, $2, $3, $4, t.unit, t.page, t.low, t.row_count
      FROM unnest($10::int[], $11::int[], $12::int[], $13::int[]) AS t(unit, page, low, row_count)
    ON CONFLICT DO NOTHING
)
SELECT 1
"""


@action("shared_maps.publish", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "table_namespace": TEXT, "config": RAW,
    "function": TEXT, "play_digest": TEXT, "units": list_of(list_of(INT32)), "lease_s": FLOAT,
}, result=NOTHING)
async def publish(port: Port, ref: RunRef, map_invocation_id: str, table_namespace: str, *,
                  config: Mapping[str, JsonValue], function: str, play_digest: str,
                  units: Sequence[tuple[int, int, int]], lease_s: float = LEASE_S) -> None:
    """Publish a map and its units (see the module docstring); idempotent."""
    check_scope(port, ref)
    if not units:
        raise InvalidInputError("a shared map needs at least one unit")
    if not all(isinstance(u, (list, tuple)) and len(u) == 3 for u in units):
        raise InvalidInputError("units must be [page, low, row_count] triples")
    if not isinstance(config, Mapping):
        raise InvalidInputError("config must be a JSON object")
    config_text = canonical.stable_dumps(canonical.normalize(dict(config), "config"))
    if not is_number(lease_s, high=MAX_LEASE_S, above=0):
        raise InvalidInputError(f"lease_s must be a number of seconds > 0 and up to "
                                f"{MAX_LEASE_S:g}, got {lease_s!r}")
    sql = _PUBLISH.format(maps=table(port, "shared_maps"), units=table(port, "shared_units"))
    args = (*map_key(ref, map_invocation_id), ref.epoch, normalize_namespace(table_namespace),
            config_text, function, play_digest,
            list(range(len(units))), [u[0] for u in units], [u[1] for u in units],
            [u[2] for u in units], float(lease_s))
    await with_connection(port, RECEIPTS_LANE, lambda conn: conn.execute(sql, *args))


# Moving a map also adds one to its sheet's `writes` under the summary row's lock: that waits
# for a plain map's write group holding the row, and ends its turn (`engine.sheets.write_group`:
# a shared map's writers hold the row shared without a token).
_SET_STATE = """
WITH moved AS (
    UPDATE {maps} SET state = $5
     WHERE org_id = $1 AND play = $2 AND run_id = $3 AND map_invocation_id = $4
       AND state = ANY($6::text[])
    RETURNING org_id, play, table_namespace
), turned AS (
    UPDATE {summary} AS s SET writes = s.writes + 1
      FROM moved AS m
     WHERE s.org_id = m.org_id AND s.play = m.play AND s.table_namespace = m.table_namespace
    RETURNING 1
)
SELECT (SELECT count(*) FROM moved) AS moved, (SELECT count(*) FROM turned) AS turned
"""


@action("shared_maps.set_state", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "state": enum_of(MapState),
    "from_states": list_of(enum_of(MapState)),
}, result=BOOL)
async def set_state(port: Port, ref: RunRef, map_invocation_id: str, state: MapState,
                    from_states: Sequence[MapState]) -> bool:
    """Move the map to `state` if it is in one of `from_states`; whether it moved."""
    check_scope(port, ref)
    state = MapState.coerce(state)
    if not isinstance(state, MapState):
        raise InvalidInputError(f"state must be waiting, open, done or cancelled, got {state!r}")
    sql = _SET_STATE.format(maps=table(port, "shared_maps"),
                            summary=table(port, "sheet_summary"))
    moved = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetchval(
        sql, *map_key(ref, map_invocation_id), state.value,
        [s.value if isinstance(s, MapState) else s for s in from_states]))
    return bool(moved)



_JOIN = """
INSERT INTO {workers} (org_id, play, worker_id, pid, host) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (org_id, play, worker_id) DO UPDATE SET seen_at = now()
"""


@action("shared_maps.join", params={"play": TEXT, "worker_id": TEXT}, result=NOTHING)
async def join(port: Port, play: str, worker_id: str) -> None:
    """Register the worker with the play's maps (again: a heartbeat)."""
    sql = _JOIN.format(workers=table(port, "shared_workers"))
    await with_connection(port, RECEIPTS_LANE, lambda conn: conn.execute(
        sql, port.org_id, play, worker_id, os.getpid(), socket.gethostname()))


_JOINED = """
SELECT count(*) FROM {workers} AS w JOIN {maps} AS m ON m.org_id = w.org_id AND m.play = w.play
 WHERE m.org_id = $1 AND m.play = $2 AND m.run_id = $3 AND m.map_invocation_id = $4
   AND w.seen_at >= m.created_at
"""


@action("shared_maps.workers_joined", params={"ref": RUN_REF, "map_invocation_id": TEXT},
        result=INT, writes=False)
async def workers_joined(port: Port, ref: RunRef, map_invocation_id: str) -> int:
    """Workers of the play seen since the map was published."""
    check_scope(port, ref)
    sql = _JOINED.format(workers=table(port, "shared_workers"), maps=table(port, "shared_maps"))
    return await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetchval(
        sql, *map_key(ref, map_invocation_id)))


_LIVE_MAPS = f"""
SELECT run_id, epoch, map_invocation_id, table_namespace, config::text AS config, function,
       play_digest, state, lease_s
  FROM {{maps}} WHERE org_id = $1 AND play = $2 AND state IN ({MapState.sql_list(LIVE)})
   AND ($3::text[] IS NULL OR run_id = ANY($3::text[]))
 ORDER BY created_at
"""


@action("shared_maps.live_maps", params={"play": TEXT}, result=list_of(SHARED_MAP),
        writes=False, context=("only_runs",))
async def live_maps(port: Port, play: str, *,
                    only_runs: Sequence[str] | None = None) -> list[SharedMap]:
    """The play's maps (of `only_runs`, when given) that are waiting or open, oldest first."""
    sql = _LIVE_MAPS.format(maps=table(port, "shared_maps"))
    runs = None if only_runs is None else list(only_runs)
    rows = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetch(
        sql, port.org_id, play, runs))
    return [SharedMap(RunRef(RunScope(port.org_id, play, row["run_id"]), row["epoch"]),
                      row["map_invocation_id"], row["table_namespace"], json.loads(row["config"]),
                      row["function"], row["play_digest"], row["state"], row["lease_s"])
            for row in rows]


_STATUS = """
SELECT m.state, m.units,
       (SELECT count(*) FROM {units} AS u
         WHERE u.org_id = $1 AND u.play = $2 AND u.run_id = $3 AND u.map_invocation_id = $4
           AND u.done) AS done
  FROM {maps} AS m
 WHERE m.org_id = $1 AND m.play = $2 AND m.run_id = $3 AND m.map_invocation_id = $4
"""

_SUMS = """
SELECT c.key, sum(c.value::bigint) AS total
  FROM {units} AS u, jsonb_each_text(u.counters) AS c
 WHERE u.org_id = $1 AND u.play = $2 AND u.run_id = $3 AND u.map_invocation_id = $4
   AND c.key = ANY($5::text[])
 GROUP BY c.key
"""


@action("shared_maps.map_status", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "counters": BOOL,
}, result=MAP_STATUS, writes=False)
async def map_status(port: Port, ref: RunRef, map_invocation_id: str, *,
                     counters: bool = False) -> MapStatus:
    """The map's state and units done; with `counters`, the sums of the counters its units' holders recorded."""
    check_scope(port, ref)
    key = map_key(ref, map_invocation_id)
    status_sql = _STATUS.format(maps=table(port, "shared_maps"), units=table(port, "shared_units"))
    sums_sql = _SUMS.format(units=table(port, "shared_units"))

    async def read(conn: Connection) -> MapStatus:
        row = await conn.fetchrow(status_sql, *key)
        if row is None:
            return MapStatus(None, 0, 0, {})
        sums: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        if counters:
            sums.update({r["key"]: int(r["total"]) for r in await conn.fetch(sums_sql, *key, list(COUNTERS))})
        return MapStatus(row["state"], row["units"], row["done"], sums)

    return await with_connection(port, RECEIPTS_LANE, read)


_REMAINING = f"""
SELECT count(*) FROM {{maps}} AS m JOIN {{units}} AS u
    ON u.org_id = m.org_id AND u.play = m.play AND u.run_id = m.run_id
   AND u.map_invocation_id = m.map_invocation_id
 WHERE m.org_id = $1 AND m.play = $2 AND m.state IN ({MapState.sql_list(LIVE)}) AND NOT u.done
   AND ($3::text[] IS NULL OR m.run_id = ANY($3::text[]))
"""


@action("shared_maps.units_remaining", params={"play": TEXT}, result=INT, writes=False,
        context=("only_runs",))
async def units_remaining(port: Port, play: str, *,
                          only_runs: Sequence[str] | None = None) -> int:
    """Units not done of the play's waiting or open maps (of `only_runs`, when given)."""
    sql = _REMAINING.format(maps=table(port, "shared_maps"), units=table(port, "shared_units"))
    runs = None if only_runs is None else list(only_runs)
    return await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetchval(
        sql, port.org_id, play, runs))


_WORKERS = """
SELECT worker_id, pid, host, units_done,
       extract(epoch FROM now() - seen_at)::float8 AS seen_s_ago FROM {workers}
 WHERE org_id = $1 AND play = $2 ORDER BY worker_id
"""


@action("shared_maps.workers", params={"play": TEXT}, result=list_of(WORKER_INFO),
        writes=False)
async def workers(port: Port, play: str) -> list[WorkerInfo]:
    """The workers that joined the play's maps (pid, host, units done, last seen)."""
    sql = _WORKERS.format(workers=table(port, "shared_workers"))
    rows = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetch(
        sql, port.org_id, play))
    return [WorkerInfo(r["worker_id"], r["pid"], r["host"], r["units_done"], r["seen_s_ago"])
            for r in rows]
