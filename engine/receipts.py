"""Work receipts: at-most-one owner per key, fenced by run epochs.

Each operation is one statement: an `INSERT … ON CONFLICT DO UPDATE … WHERE <fence>` that
applies when the fence allows it, joined with a read of the stored row when it does not, so the
caller always learns the receipt as stored afterwards (ours, or the newer one that fenced us).
Fences: a write applies only where the stored epoch is ≤ ours; `fail` never overwrites a
completed or skipped receipt; an identical replay changes nothing. The statement returns no row
only when a concurrent insert of the same key committed after our snapshot; we then issue it
again, which sees that row through the conflict path.

Leases: `claim` leases a running receipt for `lease_s` seconds (`lease_expires_at`); a running
receipt whose lease has expired is claimable again by the same or a newer run, as a pending one
is (receipts claimed before leases existed have none and never expire). `complete_many` settles
many keys in one statement; `release` hands a run's running receipts back as pending.

Keys are user strings (1–1024 characters) stored under the play's scope with kind `receipt`, so
this API can never name an internal fact.
"""

from __future__ import annotations

import enum
import functools
from typing import Iterable, Mapping

import attrs

from .limits.bounds import is_number
from . import canonical
from .canonical import JsonValue
from .actions import action
from .values.codecs import (
    PLAY_SCOPE, RAW, RUN_REF, STR, BOOL, FLOAT, INT, USER_JSON, dict_of, enum_of, list_of, optional,
    record,
)
from .errors import InvalidInputError, RowNotVisibleError
from .values.keys import check_user_key, receipt_key
from .pg import Connection, Record
from .ports import RECEIPTS_LANE, Port, with_connection
from .runs.reissue import MAX_VISIBILITY_ATTEMPTS, fetchrow_until_visible
from .sql import SqlLiteral, qualified
from .values.scopes import PlayScope, RunRef, check_scope



class ReceiptStatus(enum.IntEnum):
    """`work_receipts.status`: the one definition Python and SQL text both use."""

    PENDING = 0
    RUNNING = 1
    COMPLETED = 2
    FAILED = 3
    SKIPPED = 4


# The names Receipt.status carries, and the values SQL templates write as `{COMPLETED}` etc.
STATUS_NAMES = {int(status): status.name.lower() for status in ReceiptStatus}
SQL_STATUSES = {status.name: int(status) for status in ReceiptStatus}



class ClaimDisposition(SqlLiteral):
    """What a `claim` found (the claim statement's `disposition`; SQL text writes `.sql`)."""

    CLAIMED = "claimed"  # the work is ours: the receipt is running under our epoch
    REUSED = "reused"  # already completed or skipped: its output is the answer
    RUNNING = "running"  # another holder's lease is live
    FENCED = "fenced"  # a newer run holds the key, or it failed under one


@attrs.frozen
class Receipt:
    key: str
    status: str
    output: JsonValue
    error: str | None
    run_id: str | None
    epoch: int | None = None


@attrs.frozen
class Claim:
    disposition: ClaimDisposition = attrs.field(converter=ClaimDisposition)
    receipt: Receipt


RECEIPT = record(Receipt, key=STR, status=STR, output=RAW, error=optional(STR),
                 run_id=optional(STR), epoch=optional(INT))
CLAIM = record(Claim, disposition=enum_of(ClaimDisposition), receipt=RECEIPT)


_COLUMNS = "status, output::text AS output, error, run_id, epoch"

DEFAULT_LEASE_S = 300.0
MAX_LEASE_S = 7 * 24 * 3600.0

# $1 key, $2 run id, $3 epoch, $4 reclaim running, $5 lease seconds. Fields in double braces
# are filled per schema (`_statement`); dispositions are written here.
_D = ClaimDisposition
_CLAIM = f"""
WITH claimed AS (
    INSERT INTO {{t}} AS r (k, status, output, error, run_id, epoch, updated_at, lease_expires_at)
    VALUES ($1, {{RUNNING}}, NULL, NULL, $2, $3, now(), now() + make_interval(secs => $5::float8))
    ON CONFLICT (k) DO UPDATE
       SET status = {{RUNNING}}, output = NULL, error = NULL, run_id = EXCLUDED.run_id,
           epoch = EXCLUDED.epoch, updated_at = now(),
           lease_expires_at = EXCLUDED.lease_expires_at
     WHERE coalesce(r.epoch, 0) <= EXCLUDED.epoch
       AND (r.status IN ({{PENDING}}, {{FAILED}})
            OR (r.status = {{RUNNING}} AND ($4 OR r.lease_expires_at <= now())))
    RETURNING {{cols}}
)
SELECT {_D.CLAIMED.sql} AS disposition, {{cols}} FROM claimed
UNION ALL
SELECT CASE WHEN status IN ({{COMPLETED}}, {{SKIPPED}}) THEN {_D.REUSED.sql}
            WHEN coalesce(epoch, 0) > $3 THEN {_D.FENCED.sql}
            WHEN status = {{RUNNING}} THEN {_D.RUNNING.sql}
            ELSE {_D.FENCED.sql} END,
       {{cols}}
  FROM {{t}} WHERE k = $1 AND NOT EXISTS (SELECT 1 FROM claimed)
"""

# $1 key, $2 run id, $3 epoch, $4 status, $5 output, $6 error
_SETTLE = """
WITH applied AS (
    INSERT INTO {t} AS r (k, status, output, error, run_id, epoch, updated_at)
    VALUES ($1, $4, $5::jsonb, $6, $2, $3, now())
    ON CONFLICT (k) DO UPDATE
       SET status = EXCLUDED.status, output = EXCLUDED.output, error = EXCLUDED.error,
           run_id = EXCLUDED.run_id, epoch = EXCLUDED.epoch, updated_at = now(),
           lease_expires_at = NULL
     WHERE coalesce(r.epoch, 0) <= EXCLUDED.epoch
       {extra_fence}
       AND (r.status, r.output, r.error, r.run_id, r.epoch)
           IS DISTINCT FROM (EXCLUDED.status, EXCLUDED.output, EXCLUDED.error,
                             EXCLUDED.run_id, EXCLUDED.epoch)
    RETURNING {cols}
)
SELECT {cols} FROM applied
UNION ALL
SELECT {cols} FROM {t} WHERE k = $1 AND NOT EXISTS (SELECT 1 FROM applied)
"""

_GET = "SELECT k, {cols} FROM {t} WHERE k = ANY($1::bytea[])"


@functools.lru_cache(maxsize=128)
def _statement(template: str, schema: str, extra_fence: str = "") -> str:
    """The statement text for a schema (memoized: formatting is on every call's path)."""
    return template.format(
        cols=_COLUMNS, t=qualified(schema, "work_receipts"),
        extra_fence=extra_fence.format(**SQL_STATUSES), **SQL_STATUSES,
    )


def _receipt(key: str, row: Record) -> Receipt:
    return Receipt(
        key=key,
        status=STATUS_NAMES[row["status"]],
        output=canonical.loads(row["output"]),
        error=row["error"],
        run_id=row["run_id"],
        epoch=row["epoch"],
    )


async def _fetch_until_row(port: Port, key: str, sql: str, *args: object) -> Record:
    return await with_connection(
        port, RECEIPTS_LANE,
        lambda conn: fetchrow_until_visible(conn, sql, args, what=f"receipt {key!r}"),
    )


@action("receipts.get", params={"scope": PLAY_SCOPE, "key": STR}, result=optional(RECEIPT),
        writes=False)
async def get(port: Port, scope: PlayScope, key: str) -> Receipt | None:
    return (await get_many(port, scope, [key]))[key]


@action("receipts.get_many", params={"scope": PLAY_SCOPE, "keys": list_of(STR)},
        result=dict_of(optional(RECEIPT)), writes=False)
async def get_many(port: Port, scope: PlayScope, keys: Iterable[str]) -> dict[str, Receipt | None]:
    """One entry per distinct key, in first-seen order (None where absent), in one query."""
    check_scope(port, scope)
    stored = {receipt_key(scope, key): key for key in dict.fromkeys(keys)}
    sql = _statement(_GET, port.schema)
    rows = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetch(sql, list(stored)))
    found = {bytes(row["k"]): row for row in rows}
    return {
        key: (_receipt(key, found[k]) if k in found else None) for k, key in stored.items()
    }


def _check_lease(lease_s: object) -> float:
    if not is_number(lease_s, high=MAX_LEASE_S, above=0):
        raise InvalidInputError(f"lease_s must be a number of seconds in (0, {MAX_LEASE_S:g}],"
                                f" got {lease_s!r}")
    return float(lease_s)


@action("receipts.claim", params={"run": RUN_REF, "key": STR, "reclaim_running": BOOL,
                                  "lease_s": FLOAT}, result=CLAIM)
async def claim(port: Port, run: RunRef, key: str, *, reclaim_running: bool = False,
                lease_s: float = DEFAULT_LEASE_S) -> Claim:
    """Take the work of `key` for `lease_s` seconds (see the module docstring for who wins)."""
    check_scope(port, run)
    lease = _check_lease(lease_s)
    k = receipt_key(run.scope, key)
    sql = _statement(_CLAIM, port.schema)
    row = await _fetch_until_row(port, key, sql, k, run.run_id, run.epoch, bool(reclaim_running),
                                 lease)
    return Claim(row["disposition"], _receipt(key, row))


async def _settle(
    port: Port, run: RunRef, key: str, status: ReceiptStatus, output: JsonValue,
    error: str | None,
    extra_fence: str = "",
) -> Receipt:
    check_scope(port, run)
    k = receipt_key(run.scope, key)
    text = None if output is None else canonical.stable_dumps(canonical.normalize(output, "output"))
    sql = _statement(_SETTLE, port.schema, extra_fence)
    row = await _fetch_until_row(port, key, sql, k, run.run_id, run.epoch, int(status), text, error)
    return _receipt(key, row)


@action("receipts.complete", params={"run": RUN_REF, "key": STR, "output": USER_JSON},
        result=RECEIPT)
async def complete(port: Port, run: RunRef, key: str, output: JsonValue) -> Receipt:
    """Store `output` as the completed result where our epoch is not older than the stored one."""
    check_user_key(key)
    return await _settle(port, run, key, ReceiptStatus.COMPLETED, output, None)


@action("receipts.skip", params={"run": RUN_REF, "key": STR, "output": USER_JSON},
        result=RECEIPT)
async def skip(port: Port, run: RunRef, key: str, output: JsonValue = None) -> Receipt:
    """Mark the work skipped (with an optional output), fenced like `complete`."""
    check_user_key(key)
    return await _settle(port, run, key, ReceiptStatus.SKIPPED, output, None)


@action("receipts.fail", params={"run": RUN_REF, "key": STR, "error": STR}, result=RECEIPT)
async def fail(port: Port, run: RunRef, key: str, error: str) -> Receipt:
    """Record a failure; never overwrites a completed or skipped receipt. NUL and lone
    surrogates in `error` are stored as U+FFFD."""
    check_user_key(key)
    if not isinstance(error, str) or not error:
        raise InvalidInputError("error must be a non-empty string")
    # NUL and lone surrogates cannot be stored as text: they become U+FFFD, as in jsonb.
    error = canonical.normalize(error)
    return await _settle(port, run, key, ReceiptStatus.FAILED, None, error,
                         "AND r.status NOT IN ({COMPLETED}, {SKIPPED})")


# $1 keys (sorted, so concurrent batches lock in one order), $2 outputs (JSON texts), $3 run id,
# $4 epoch. Each stored row is reached by its key (`LATERAL … LIMIT 1`).
_COMPLETE_MANY = """
WITH input AS MATERIALIZED (
    SELECT u.k, u.output::jsonb AS output
      FROM ROWS FROM (unnest($1::bytea[]), unnest($2::text[])) AS u(k, output)
),
applied AS (
    INSERT INTO {t} AS r (k, status, output, error, run_id, epoch, updated_at)
    SELECT i.k, {COMPLETED}, i.output, NULL, $3, $4, now() FROM input i ORDER BY i.k
    ON CONFLICT (k) DO UPDATE
       SET status = EXCLUDED.status, output = EXCLUDED.output, error = NULL,
           run_id = EXCLUDED.run_id, epoch = EXCLUDED.epoch, updated_at = now(),
           lease_expires_at = NULL
     WHERE coalesce(r.epoch, 0) <= EXCLUDED.epoch
       AND (r.status, r.output, r.error, r.run_id, r.epoch)
           IS DISTINCT FROM (EXCLUDED.status, EXCLUDED.output, EXCLUDED.error,
                             EXCLUDED.run_id, EXCLUDED.epoch)
    RETURNING k, {cols}
)
SELECT k, {cols} FROM applied
UNION ALL
SELECT s.k, s.status, s.output::text AS output, s.error, s.run_id, s.epoch
  FROM input i
  CROSS JOIN LATERAL (SELECT * FROM {t} AS s WHERE s.k = i.k LIMIT 1) AS s
 WHERE NOT EXISTS (SELECT 1 FROM applied a WHERE a.k = i.k)
"""

# $1 keys, $2 run id, $3 epoch
_RELEASE = """
UPDATE {t} AS r SET status = {PENDING}, lease_expires_at = NULL, updated_at = now()
 WHERE r.k = ANY($1::bytea[]) AND r.status = {RUNNING} AND r.run_id = $2 AND r.epoch = $3
RETURNING r.k
"""


@action("receipts.complete_many", params={"run": RUN_REF, "outputs": dict_of(USER_JSON)},
        result=dict_of(RECEIPT))
async def complete_many(port: Port, run: RunRef,
                        outputs: Mapping[str, JsonValue]) -> dict[str, Receipt]:
    """`complete` for every key of `outputs` in one statement: the receipt of each key as
    stored afterwards (ours, or the newer one that fenced us), in the mapping's order."""
    check_scope(port, run)
    if not isinstance(outputs, Mapping):
        raise InvalidInputError("outputs must map receipt keys to outputs")
    texts: dict[bytes, tuple[str, str | None]] = {}
    for key, output in outputs.items():
        check_user_key(key)
        text = None if output is None else canonical.stable_dumps(
            canonical.normalize(output, f"outputs[{key!r}]"))
        texts[receipt_key(run.scope, key)] = (key, text)
    sql = _statement(_COMPLETE_MANY, port.schema)
    found: dict[str, Receipt] = {}

    async def settle(conn: Connection) -> None:
        todo = sorted(texts)
        for _ in range(MAX_VISIBILITY_ATTEMPTS):  # see `engine.runs.reissue`: a peer's late insert
            rows = await conn.fetch(sql, todo, [texts[k][1] for k in todo], run.run_id, run.epoch)
            for row in rows:
                key = texts[bytes(row["k"])][0]
                found[key] = _receipt(key, row)
            todo = [k for k in todo if texts[k][0] not in found]
            if not todo:
                return
        raise RowNotVisibleError(f"{len(todo)} receipts kept changing under a concurrent writer;"
                                 " retry")

    if texts:
        await with_connection(port, RECEIPTS_LANE, settle)
    return {key: found[key] for key in outputs}


@action("receipts.release", params={"run": RUN_REF, "keys": list_of(STR)}, result=list_of(STR))
async def release(port: Port, run: RunRef, keys: Iterable[str]) -> list[str]:
    """Return the run's `running` receipts among `keys` to `pending` (claimable at once by
    anyone the epochs allow); the keys released, in first-seen order. Receipts of other runs,
    or not running, are left as they are."""
    check_scope(port, run)
    if isinstance(keys, str):
        raise InvalidInputError("keys must be a list of receipt keys, not a string")
    stored: dict[bytes, str] = {}
    for key in keys:
        check_user_key(key)
        stored[receipt_key(run.scope, key)] = key
    if not stored:
        return []
    sql = _statement(_RELEASE, port.schema)
    rows = await with_connection(port, RECEIPTS_LANE,
                                 lambda conn: conn.fetch(sql, list(stored), run.run_id, run.epoch))
    released = {bytes(row["k"]) for row in rows}
    return [key for k, key in stored.items() if k in released]
