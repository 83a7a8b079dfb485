"""Run history: what each map of each run did, kept in the tenant's `run_maps` table.

How it works
- One row per map of a run, keyed by the run and the map's key (its map invocation id, such as
  `map-0` for a list source, or `stream-N` for the N-th async-iterable map of the run):
  the table namespace, the map's state, its counters (source rows, admitted, cached,
  completed, failed, blocked, retried, and `running`: rows admitted and not yet written) and
  when it started, was last written and ended.
- `record_map` writes it in one upsert, and answers in the same statement whether the run was
  asked to cancel (`engine.runs.cancel`): a map's heartbeat is also its run's cancellation poll,
  so a process writing history needs no separate poll. A running map writes it about once a
  second (state `running`, so `runplane status --watch` sees rows in flight from another
  terminal; less often while the store is slow to answer: `actors.history`) and once
  more when it ends (`finished`, `stopped_early`, `superseded` or `failed`; `interrupted` when
  its process cancelled it, Ctrl-C or SIGTERM, after flushing what it computed). A crashed
  map's row stays `running` with its last counters (read as interrupted once it is `LIVE_S`
  old) until a wake of the run runs the map again and replaces them with its own.
- `list_maps` reads the rows of some runs of a play (`runplane runs`, `runs PLAY RUN_ID`);
  `live_maps` reads the running maps of a play written in the last `LIVE_S` seconds (its rows in
  flight, for `status`). Each row carries `age_s`, seconds since it was last written, measured
  by the server's clock. `live_maps(..., only_runs=R)` reads the maps of runs `R` only (the
  gateway fills it with a run-scoped token's `runs` claim; `list_maps` names its runs, which
  the gateway checks against that claim).
- A `running` write never replaces an ended entry of the same map call (same `started_at`): a
  heartbeat that lands after the map's last entry changes nothing; a wake, which starts the
  map again, replaces it.
- Its writes commit asynchronously (`synchronous_commit` off for that transaction: no wait for
  the WAL flush on a map's path). History is a record: a server crash within the WAL writer's
  delay loses at most the entry's latest write, and any later synchronous commit (the run's
  retirement, a sheet write) flushes it first, because the WAL is written in order.
"""

from __future__ import annotations

import datetime
from typing import Sequence

import attrs

from .. import canonical
from ..canonical import JsonObject
from ..limits.bounds import is_int
from ..actions import action
from ..values.codecs import (
    BOOL, FLOAT, INT, PLAY_SCOPE, RAW, RUN_SCOPE, STR, TEXT, TIMESTAMP, enum_of, list_of,
    optional, record,
)
from ..errors import InvalidInputError
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..sql import SqlLiteral
from ..values.scopes import PlayScope, RunScope, check_scope



class MapRunState(SqlLiteral):
    """A `run_maps` row's `state` (see the module docstring); SQL text writes `.sql`."""

    RUNNING = "running"
    FINISHED = "finished"
    STOPPED_EARLY = "stopped_early"
    SUPERSEDED = "superseded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


MAP_STATES = tuple(state.value for state in MapRunState)
COUNTERS = ("source_rows", "admitted", "cached", "completed", "failed", "blocked", "retried",
            "running")
LIVE_S = 10.0  # a running map's row older than this is a crashed one
MAX_TEXT = 2000


@attrs.frozen
class MapRecord:
    """What one map of a run did (so far, while `state` is `running`)."""

    map_key: str
    table_namespace: str
    state: MapRunState = attrs.field(converter=MapRunState.coerce)
    started_at: datetime.datetime
    ended_at: datetime.datetime | None = None
    source_rows: int = 0
    admitted: int = 0
    cached: int = 0
    completed: int = 0
    failed: int = 0
    blocked: int = 0
    retried: int = 0
    running: int = 0
    # A user's error text: NUL (which text columns cannot store) becomes U+FFFD.
    stop_reason: str | None = attrs.field(
        default=None, converter=lambda v: v.replace("\x00", "\ufffd") if isinstance(v, str) else v)
    # What the map ran (its function's name and its policies, `engine.runs.retry_spec`), for a
    # retry: written with the entry, kept when a later write carries none; never read back here.
    spec: JsonObject | None = None

    def __attrs_post_init__(self) -> None:  # an invalid record cannot be built
        if self.state not in MAP_STATES:
            raise InvalidInputError(
                f"state must be one of {', '.join(MAP_STATES)}, got {self.state!r}")
        for name in ("map_key", "table_namespace"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > MAX_TEXT or "\x00" in value:
                raise InvalidInputError(
                    f"{name} must be a non-empty string without NUL of at most {MAX_TEXT} "
                    "characters")
        for name in COUNTERS:
            value = getattr(self, name)
            if not is_int(value, 0):
                raise InvalidInputError(f"{name} must be an integer >= 0, got {value!r}")
        if self.spec is not None and not isinstance(self.spec, dict):
            raise InvalidInputError(f"spec must be a JSON object or null, got {self.spec!r}")

    @property
    def map_id(self) -> str:
        """The map's id within its table (`map-N`, `stream-N`): a run writes `map_key` as
        `<table>/<id>`, since ids count per table (older entries hold the id alone)."""
        return self.map_key.rpartition("/")[2]

    @property
    def duration_s(self) -> float | None:
        if self.ended_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds()


MAP_RECORD = record(MapRecord, map_key=TEXT, table_namespace=TEXT, state=enum_of(MapRunState),
                    started_at=TIMESTAMP,
                    ended_at=optional(TIMESTAMP), source_rows=INT, admitted=INT, cached=INT,
                    completed=INT, failed=INT, blocked=INT, retried=INT, running=INT,
                    stop_reason=optional(STR), spec=optional(RAW))


@attrs.frozen
class StoredMap:
    """A `run_maps` row as read back: the run it belongs to, its record, its age."""

    run_id: str
    record: MapRecord
    age_s: float


STORED_MAP = record(StoredMap, run_id=STR, record=MAP_RECORD, age_s=FLOAT)

_RECORD = """
WITH written AS (
INSERT INTO {run_maps} AS m (org_id, play, run_id, map_key, table_namespace, state, started_at,
                             ended_at, source_rows, admitted, cached, completed, failed,
                             blocked, retried, running, stop_reason, spec, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18::jsonb, now())
ON CONFLICT (org_id, play, run_id, map_key) DO UPDATE SET
    table_namespace = EXCLUDED.table_namespace, state = EXCLUDED.state,
    started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at,
    source_rows = EXCLUDED.source_rows, admitted = EXCLUDED.admitted, cached = EXCLUDED.cached,
    completed = EXCLUDED.completed, failed = EXCLUDED.failed, blocked = EXCLUDED.blocked,
    retried = EXCLUDED.retried, running = EXCLUDED.running, stop_reason = EXCLUDED.stop_reason,
    spec = coalesce(EXCLUDED.spec, m.spec), updated_at = now()
 WHERE NOT (EXCLUDED.state = {running} AND m.state <> {running}
            AND m.started_at = EXCLUDED.started_at)
RETURNING 1
)
SELECT cancel_requested_at IS NOT NULL, set_config('synchronous_commit', 'off', true)
  FROM {runs}
 WHERE org_id = $1 AND play = $2 AND run_id = $3
"""

_COLUMNS = """run_id, map_key, table_namespace, state, started_at, ended_at, source_rows, admitted,
       cached, completed, failed, blocked, retried, running, stop_reason,
       extract(epoch FROM now() - updated_at)::float8 AS age_s"""

_LIST = f"""
SELECT {_COLUMNS} FROM {{run_maps}}
 WHERE org_id = $1 AND play = $2 AND run_id = ANY($3::text[])
 ORDER BY run_id, started_at, map_key
"""

_LIVE = f"""
SELECT {_COLUMNS} FROM {{run_maps}}
 WHERE org_id = $1 AND play = $2 AND state = {MapRunState.RUNNING.sql}
   AND updated_at > now() - make_interval(secs => $3)
   AND ($4::text[] IS NULL OR run_id = ANY($4::text[]))
 ORDER BY started_at
"""


@action("history.record_map", params={"scope": RUN_SCOPE, "record": MAP_RECORD}, result=BOOL)
async def record_map(port: Port, scope: RunScope, record: MapRecord) -> bool:
    """Write what a map of run `scope` did (so far), in one upsert; answers whether the run
    was asked to cancel (False for a run never registered)."""
    check_scope(port, scope)
    if not isinstance(record, MapRecord):
        raise InvalidInputError(f"record must be a MapRecord, got {type(record).__name__}")
    reason = None if record.stop_reason is None else record.stop_reason[:MAX_TEXT]
    sql = _RECORD.format(run_maps=table(port, "run_maps"), runs=table(port, "runs"),
                         running=MapRunState.RUNNING.sql)
    cancelled = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetchval(
        sql, scope.org_id, scope.play, scope.run_id, record.map_key, record.table_namespace,
        record.state.value, record.started_at, record.ended_at,
        *(getattr(record, name) for name in COUNTERS), reason,
        None if record.spec is None else canonical.stable_dumps(
            canonical.normalize(record.spec, "spec"))))
    return bool(cancelled)


def _stored(row) -> StoredMap:
    fields = {name: row[name] for name in (
        "map_key", "table_namespace", "state", "started_at", "ended_at", *COUNTERS,
        "stop_reason")}
    return StoredMap(row["run_id"], MapRecord(**fields), row["age_s"])


@action("history.list_maps", params={"scope": PLAY_SCOPE, "run_ids": list_of(TEXT)},
        result=list_of(STORED_MAP), writes=False)
async def list_maps(port: Port, scope: PlayScope, run_ids: list[str]) -> list[StoredMap]:
    """The maps of these runs of the play, each run's in the order they started."""
    check_scope(port, scope)
    if not isinstance(run_ids, (list, tuple)) or not all(isinstance(r, str) for r in run_ids):
        raise InvalidInputError("run_ids must be a list of run ids")
    sql = _LIST.format(run_maps=table(port, "run_maps"))
    rows = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetch(
        sql, scope.org_id, scope.play, list(run_ids)))
    return [_stored(row) for row in rows]


@action("history.live_maps", params={"scope": PLAY_SCOPE}, result=list_of(STORED_MAP),
        writes=False, context=("only_runs",))
async def live_maps(port: Port, scope: PlayScope, *,
                    only_runs: Sequence[str] | None = None) -> list[StoredMap]:
    """The play's maps (of `only_runs`, when given) running now: state `running`, written in
    the last `LIVE_S` seconds."""
    check_scope(port, scope)
    sql = _LIVE.format(run_maps=table(port, "run_maps"))
    runs = None if only_runs is None else list(only_runs)
    rows = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetch(
        sql, scope.org_id, scope.play, LIVE_S, runs))
    return [_stored(row) for row in rows]
