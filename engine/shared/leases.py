"""The leases of a shared map's units: claims, renewals, and the checks that guard writes.

How it works
- `claim_units` takes, in one statement, free or expired units of an open map (`FOR UPDATE
  SKIP LOCKED`), at most `ceil(claimable units / live workers)` and at most the caller's
  limit (`MAX_CLAIM`), so every live worker gets a share. One claim names one fresh holder
  (`worker/claim number`) for all its units: the attempt id their rows are admitted under, so
  a holder whose lease was taken over is fenced by the sheet too (`attempt_superseded`).
  Each lease carries the unit's settled mask (below), so a new holder runs only what is left.
- `renew` extends the caller's leases of one map (and its heartbeat) in one statement and says
  which units it still holds: none once the map is no longer open (the worker stops its rows).
- A unit's rows are settled bit by bit: `counters` holds, besides the counters its holders
  recorded, `settled`, a hex mask of the unit's row offsets whose outcome is recorded (a cache
  hit, a blocked or skipped row found at admission, a row completed or failed). A worker
  records its progress in small batches (`settle`, in the transaction of the rows'
  completion): compare-and-set from the mask it knows (`before`) to the new one (`after`),
  adding the batch's counters and marking the unit done once every row is settled. A replay
  of a batch whose commit reply was lost finds `after` and changes nothing; a holder that lost
  the lease finds another holder and gets `LeaseLostError`: the transaction rolls back.
- `release_process` ends, at once, the leases held by a worker process that is known to be
  gone (its parent, the coordinator of a `workers=N` map, reaped it): its units are claimable
  now instead of when their leases run out, and the process no longer counts as a live worker.
  Like an expired lease, this fences the dead holder's late statements (none can come: the
  process is gone, and a COMMIT the server had already received is waited on by the next
  holder's row locks and reconciled by the settled mask).
- `lease_check` is the `within` hook of a claim's admission: every unit still held by the
  caller in an open map, the rows locked (`FOR SHARE`) until the admission commits.
Every statement reaches its rows by primary-key prefix (org, play, run, map): never the sheet.
"""

from __future__ import annotations

import bisect
import json
import re
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

import attrs

from ..actions import action
from ..limits.bounds import is_int
from ..values.codecs import BOOL, INT, INT32, RUN_REF, TEXT, dict_of, list_of, record
from ..errors import InvalidInputError, LeaseLostError
from ..pg import Connection
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..sheets.model import FencedRow, RowOutcome
from ..values.scopes import RunRef, check_scope
from .maps import COUNTERS, MapState, map_key

MAX_CLAIM = 8  # units one claim takes, at most
_MASK = re.compile(r"^(|[1-9a-f][0-9a-f]*)$")


def mask_text(mask: int) -> str:
    """A settled mask as stored: lowercase hex without leading zeros, '' for none."""
    return format(mask, "x") if mask else ""


def mask_of(text: str) -> int:
    return int(text, 16) if text else 0


def _mask(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not _MASK.match(value):
        raise InvalidInputError(f"{attribute.name} must be a settled mask (lowercase hex "
                                f"without leading zeros), got {value!r}")


@attrs.frozen
class UnitLease:
    """A claimed unit: rows `low…low+row_count-1` of staged page `page`, held by `holder`;
    `settled` is its mask of rows already recorded when it was claimed."""

    unit: int
    page: int
    low: int
    row_count: int
    holder: str
    claims: int
    settled: str = attrs.field(default="", validator=_mask)

    @property
    def full(self) -> int:
        return (1 << self.row_count) - 1


@attrs.frozen
class Settlement:
    """A batch of one unit's progress: its mask from `before` to `after`, the counters that go
    with it (`tally`, besides what the completion applies), `done` once every row is settled."""

    lease: UnitLease
    before: str = attrs.field(validator=_mask)
    after: str = attrs.field(validator=_mask)
    done: bool
    tally: Mapping[str, int] = attrs.field(factory=dict)


UNIT_LEASE = record(UnitLease, unit=INT32, page=INT32, low=INT32, row_count=INT32, holder=TEXT,
                    claims=INT, settled=TEXT)
SETTLEMENT = record(Settlement, lease=UNIT_LEASE, before=TEXT, after=TEXT, done=BOOL,
                    tally=dict_of(INT))


_OPEN = MapState.OPEN.sql  # units are claimed, renewed and written only while their map is open
_CLAIM = f"""
WITH m AS (
    SELECT lease_s FROM {{maps}}
     WHERE org_id = $1 AND play = $2 AND run_id = $3 AND map_invocation_id = $4 AND state = {_OPEN}
), live AS (
    SELECT greatest(1, count(*)) AS n FROM {{workers}}
     WHERE org_id = $1 AND play = $2
       AND seen_at > now() - make_interval(secs => (SELECT lease_s FROM m))
), free AS (
    SELECT count(*) AS n FROM {{units}}
     WHERE org_id = $1 AND play = $2 AND run_id = $3 AND map_invocation_id = $4 AND NOT done
       AND (expires_at IS NULL OR expires_at < now())
), picked AS (
    SELECT unit FROM {{units}}
     WHERE org_id = $1 AND play = $2 AND run_id = $3 AND map_invocation_id = $4 AND NOT done
       AND (expires_at IS NULL OR expires_at < now()) AND EXISTS (SELECT 1 FROM m)
     ORDER BY unit
     LIMIT (SELECT least($6::int, ceil(free.n::float8 / live.n)::int) FROM free, live)
       FOR UPDATE SKIP LOCKED
)
UPDATE {{units}} AS u
   SET holder = $5, claims = u.claims + 1,
       expires_at = now() + make_interval(secs => (SELECT lease_s FROM m))
  FROM picked
 WHERE u.org_id = $1 AND u.play = $2 AND u.run_id = $3 AND u.map_invocation_id = $4
   AND u.unit = picked.unit
RETURNING u.unit, u.page, u.low, u.row_count, u.holder, u.claims,
          coalesce(u.counters->>'settled', '') AS settled
"""


@action("shared_maps.claim_units", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "holder": TEXT, "limit": INT,
}, result=list_of(UNIT_LEASE))
async def claim_units(port: Port, ref: RunRef, map_invocation_id: str, holder: str, *,
                      limit: int = MAX_CLAIM) -> list[UnitLease]:
    """Lease free or expired units of an open map to `holder` (a name no other claim used:
    `worker id/claim number`), its fair share and at most `limit`, in unit order; none when
    the map is not open or nothing is claimable."""
    check_scope(port, ref)
    if not is_int(limit, 1, MAX_CLAIM):
        raise InvalidInputError(f"limit must be an integer from 1 to {MAX_CLAIM}, got {limit!r}")
    sql = _CLAIM.format(maps=table(port, "shared_maps"), units=table(port, "shared_units"),
                        workers=table(port, "shared_workers"))
    rows = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetch(
        sql, *map_key(ref, map_invocation_id), holder, limit))
    return sorted((UnitLease(r["unit"], r["page"], r["low"], r["row_count"], r["holder"],
                             r["claims"], r["settled"]) for r in rows),
                  key=lambda lease: lease.unit)


_RENEW = f"""
WITH beat AS (
    UPDATE {{workers}} SET seen_at = now() WHERE org_id = $1 AND play = $2 AND worker_id = $5
), renewed AS (
    UPDATE {{units}} AS u SET expires_at = now() + make_interval(secs => m.lease_s)
      FROM {{maps}} AS m
     WHERE u.org_id = $1 AND u.play = $2 AND u.run_id = $3 AND u.map_invocation_id = $4
       AND u.unit = ANY($6::int[]) AND u.holder = ANY($7::text[]) AND NOT u.done
       AND m.org_id = $1 AND m.play = $2 AND m.run_id = $3 AND m.map_invocation_id = $4
       AND m.state = {_OPEN}
    RETURNING u.unit
)
SELECT coalesce(array_agg(unit), '{{{{}}}}') FROM renewed
"""


@action("shared_maps.renew", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "worker_id": TEXT, "leases": list_of(UNIT_LEASE),
}, result=list_of(INT))
async def renew(port: Port, ref: RunRef, map_invocation_id: str, worker_id: str,
                leases: Sequence[UnitLease]) -> list[int]:
    """Extend the worker's leases of one map; the units it still holds (none once the map is
    no longer open)."""
    check_scope(port, ref)
    sql = _RENEW.format(maps=table(port, "shared_maps"), units=table(port, "shared_units"),
                        workers=table(port, "shared_workers"))
    held = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetchval(
        sql, *map_key(ref, map_invocation_id), worker_id, [lease.unit for lease in leases],
        [lease.holder for lease in leases]))
    return sorted(held)


# The lease check of a claim's admission: every unit still ours (and its map open); the row
# locks (FOR SHARE) keep claims off them until the admission commits.
_CHECK = f"""
SELECT count(*) FROM (
    SELECT 1 FROM {{units}} AS u
      JOIN unnest($5::int[], $6::text[]) AS l(unit, holder)
        ON l.unit = u.unit AND l.holder = u.holder
      JOIN {{maps}} AS m ON m.org_id = u.org_id AND m.play = u.play AND m.run_id = u.run_id
                      AND m.map_invocation_id = u.map_invocation_id
     WHERE u.org_id = $1 AND u.play = $2 AND u.run_id = $3 AND u.map_invocation_id = $4
       AND NOT u.done AND m.state = {_OPEN}
       AND ($7::boolean IS NOT TRUE OR m.config->>'concurrent' = 'true')
       FOR SHARE OF u
) AS held
"""

# A batch of progress: per unit, compare-and-set of the settled mask with its counters added
# (a replay finds `after` and changes nothing); the worker credited with the units it finished.
_SETTLE = f"""
WITH i AS (
    SELECT * FROM jsonb_to_recordset($5::jsonb)
        AS i(unit int, holder text, before text, after text, done boolean, delta jsonb)
), was AS (
    SELECT u.unit, u.done FROM {{units}} AS u JOIN i ON i.unit = u.unit
     WHERE u.org_id = $1 AND u.play = $2 AND u.run_id = $3 AND u.map_invocation_id = $4
), settled AS (
    UPDATE {{units}} AS u
       SET counters = CASE WHEN coalesce(u.counters->>'settled', '') = i.before
                           THEN (SELECT jsonb_object_agg(k, coalesce((u.counters->>k)::bigint, 0)
                                                            + coalesce((i.delta->>k)::bigint, 0))
                                   FROM unnest($6::text[]) AS k)
                                || jsonb_build_object('settled', i.after)
                           ELSE u.counters END,
           done = CASE WHEN coalesce(u.counters->>'settled', '') = i.before THEN i.done
                       ELSE u.done END,
           expires_at = now() + make_interval(secs => m.lease_s)
      FROM i, {{maps}} AS m
     WHERE u.org_id = $1 AND u.play = $2 AND u.run_id = $3 AND u.map_invocation_id = $4
       AND u.unit = i.unit AND u.holder = i.holder
       AND coalesce(u.counters->>'settled', '') IN (i.before, i.after)
       AND m.org_id = $1 AND m.play = $2 AND m.run_id = $3 AND m.map_invocation_id = $4
       AND m.state = {_OPEN} AND ($8::boolean IS NOT TRUE OR m.config->>'concurrent' = 'true')
    RETURNING u.unit, u.done
), credited AS (
    UPDATE {{workers}}
       SET units_done = units_done + (SELECT count(*) FROM settled JOIN was USING (unit)
                                       WHERE settled.done AND NOT was.done),
           seen_at = now()
     WHERE org_id = $1 AND play = $2 AND worker_id = $7
)
SELECT count(*) FROM settled
"""


# Holders are `worker_id/claim number`, and a worker id starts with `host:pid:` (`new_worker_id`).
_RELEASE = """
WITH gone AS (
    UPDATE {workers} SET seen_at = '-infinity'
     WHERE org_id = $1 AND play = $2 AND left(worker_id, length($5)) = $5
)
UPDATE {units} SET expires_at = now() - interval '1 millisecond'
 WHERE org_id = $1 AND play = $2 AND run_id = $3 AND map_invocation_id = $4 AND NOT done
   AND left(holder, length($5)) = $5 AND expires_at > now()
RETURNING unit
"""


async def release_process(port: Port, ref: RunRef, map_invocation_id: str, host: str,
                          pid: int) -> int:
    """End the leases of the map's units held by worker process `pid` on `host`, which its
    caller knows has exited (module docstring); how many units were released. Not a gateway
    action: only a `workers=N` coordinator, which needs a direct connection, starts processes."""
    check_scope(port, ref)
    if not is_int(pid, 1, 2**31 - 1) or not isinstance(host, str) or not host:
        raise InvalidInputError("release_process needs the exited worker's host and pid")
    sql = _RELEASE.format(workers=table(port, "shared_workers"),
                          units=table(port, "shared_units"))
    rows = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetch(
        sql, *map_key(ref, map_invocation_id), f"{host}:{pid}:"))
    return len(rows)


def _tables(port: Port) -> dict[str, str]:
    return dict(maps=table(port, "shared_maps"), units=table(port, "shared_units"),
                workers=table(port, "shared_workers"))


def lease_check(port: Port, ref: RunRef, map_invocation_id: str, leases: Sequence[UnitLease],
                concurrent: bool = False
                ) -> Callable[[Connection, frozenset[str], dict], Awaitable[None]]:
    """The `within` hook of an admission of `leases`' rows (see the module docstring); a
    `concurrent` admission also needs the map published for concurrent writers."""
    sql = _CHECK.format(**_tables(port))
    key = map_key(ref, map_invocation_id)

    async def within(conn: Connection, _committed: frozenset[str], _fenced: dict) -> None:
        held = await conn.fetchval(sql, *key, [lease.unit for lease in leases],
                                   [lease.holder for lease in leases], concurrent)
        if held != len(leases):
            raise LeaseLostError(f"units of map {map_invocation_id!r} are no longer all held by "
                                 f"{leases[0].holder!r}")

    return within


async def settle(conn: Connection, port: Port, ref: RunRef, map_invocation_id: str,
                 worker_id: str, entries: Iterable[tuple[Settlement, Mapping[str, int]]],
                 concurrent: bool = False) -> None:
    """Record a batch of progress (each settlement with its counters delta) in the caller's
    transaction; `LeaseLostError` when some unit is no longer held by its settlement's holder
    in an open map (or, for a `concurrent` write, in a map not published for concurrent
    writers): the transaction must roll back."""
    rows = [{"unit": s.lease.unit, "holder": s.lease.holder, "before": s.before,
             "after": s.after, "done": s.done, "delta": dict(delta)} for s, delta in entries]
    if not rows:
        return
    sql = _SETTLE.format(**_tables(port))
    count = await conn.fetchval(sql, *map_key(ref, map_invocation_id), json.dumps(rows),
                                list(COUNTERS), worker_id, concurrent)
    if count != len(rows):
        raise LeaseLostError(f"units of map {map_invocation_id!r} are no longer all held by "
                             f"{rows[0]['holder']!r}")


def check_settlements(settlements: Sequence[Settlement]) -> None:
    """Bad settlements refused before any query: one holder, each unit once, masks within the
    unit, `after` covering `before`, `done` exactly when every row is settled."""
    if not settlements:
        raise InvalidInputError("settlements must not be empty")
    holders = {s.lease.holder for s in settlements}
    if len(holders) != 1:
        raise InvalidInputError("settlements must all be of one claim (one holder)")
    units = [s.lease.unit for s in settlements]
    if len(set(units)) != len(units):
        raise InvalidInputError("settlements must name each unit once")
    for i, s in enumerate(settlements):
        before, after, full = mask_of(s.before), mask_of(s.after), s.lease.full
        if after & ~full or before & ~after:
            raise InvalidInputError(f"settlements[{i}]: after must cover before, within the unit")
        if s.done != (after == full):
            raise InvalidInputError(f"settlements[{i}]: done must say whether every row is "
                                    "settled")
        unknown = set(s.tally) - set(COUNTERS)
        if unknown:
            raise InvalidInputError(f"settlements[{i}].tally: unknown counters {sorted(unknown)}")


def unit_finder(leases: Sequence[UnitLease]) -> Callable[[object], UnitLease | None]:
    """The lease whose unit holds an input index (None for any other index)."""
    ordered = sorted(leases, key=lambda lease: lease.low)
    lows = [lease.low for lease in ordered]

    def find(input_index: object) -> UnitLease | None:
        if type(input_index) is not int:
            return None
        at = bisect.bisect_right(lows, input_index) - 1
        if at < 0 or input_index >= ordered[at].low + ordered[at].row_count:
            return None
        return ordered[at]

    return find


def settlement_entries(settlements: Sequence[Settlement], outcomes: Sequence[RowOutcome],
                       committed: frozenset[str], fenced: Mapping[str, FencedRow]
                       ) -> list[tuple[Settlement, dict[str, int]]]:
    """Each settlement with its counters delta: its tally plus, of the completion's outcomes
    in its unit, those applied (completed, failed) and those fenced."""
    deltas = {s.lease.unit: dict(s.tally) for s in settlements}
    find = unit_finder([s.lease for s in settlements])
    for outcome in outcomes:
        lease = find(outcome.input_index)
        if lease is None:
            continue
        delta = deltas[lease.unit]
        if outcome.key in fenced:
            delta["fenced"] = delta.get("fenced", 0) + 1
        elif outcome.key in committed:
            delta[outcome.status] = delta.get(outcome.status, 0) + 1
    return [(s, deltas[s.lease.unit]) for s in settlements]
