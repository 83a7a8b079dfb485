"""Cache hits belong to the run that reused them, recorded without touching the rows.

How it works
- A rerun that finds rows already enriched leaves them as they are: their `_run_id`, write
  version, outputs and cell meta stay those of the run that wrote them (reused cells keep
  status `completed` and count as completed). What it records instead is a membership: one
  `sheet_reuse` row per map (`record_reuse`, one INSERT), holding the keys of the admission
  units in which it found cache hits, and the run's epoch. Row keys travel and are stored as
  16-byte digests (one `bytea`, 160 kB for 10,000 rows); other keys as a text array.
- The keys may be a superset of the rows reused (a unit with one hit records all its keys):
  a reader keeps only the rows that are `enriched` with a write version older than the run's
  epoch. After the run's admission, no older run can write a row of its input (completion is
  fenced by write version), so those rows are exactly its cache hits; a row a newer run has
  rewritten since is that run's, not this one's.
- `read_rows(run_id=R)` reads R's own rows and, through `MEMBERS`, the rows R reused, each by
  a primary-key lookup from the recorded keys.
- A dataset (`engine.sheets.dataset`) with `run_id=R` filters the sheet's rows in its own order
  with `member_condition`: R's own rows, or a row whose key R recorded (a hashed set, built once
  per statement from R's membership rows) that is enriched at a write version older than R's
  epoch. A run has one epoch, so every membership row of R holds the same one. Each row is
  read once, so a page never holds a row twice.
"""

from __future__ import annotations

from typing import Sequence

from ..actions import action
from ..values.codecs import INT, RUN_REF, STR, list_of
from ..errors import InvalidInputError
from ..ports import SHEET_LANE, Port, table, with_connection
from ..values.scopes import RunRef, check_scope, normalize_namespace

from ..canonical import is_clean_str
from .inputs import ALWAYS_SAFE_KEY_CHARS, check_key
from .model import with_row_statuses

# $1 org, $2 play, $3 namespace, $4 run id, $5 epoch, $6 digests, $7 other keys
_RECORD = """
INSERT INTO {reuse} (org_id, play, table_namespace, run_id, epoch, digests, keys)
VALUES ($1, $2, $3, $4, $5, $6::bytea, $7::text[])
"""

# The rows run $3 reused, from the recorded keys (each found by its primary key), for
# `read_rows`: `{reuse}` the membership table, `{t}` the sheet; $4 org, $5 play, $6 namespace.
MEMBERS = with_row_statuses("""
recorded AS MATERIALIZED (
    SELECT r.epoch, r.digests || ''::bytea AS digests, r.keys FROM {reuse} AS r
     WHERE r.org_id = $4 AND r.play = $5 AND r.table_namespace = $6 AND r.run_id = $3
),
reused_keys AS MATERIALIZED (
    SELECT DISTINCT u.key, u.epoch FROM (
        SELECT encode(substring(r.digests FROM i * 16 + 1 FOR 16), 'hex') AS key, r.epoch
          FROM recorded AS r
          CROSS JOIN LATERAL generate_series(0, coalesce(length(r.digests), 0) / 16 - 1) AS i
        UNION ALL
        SELECT k.key, r.epoch FROM recorded AS r CROSS JOIN LATERAL unnest(r.keys) AS k(key)
    ) AS u
),
reused AS MATERIALIZED (
    SELECT s.*
      FROM reused_keys AS k
      CROSS JOIN LATERAL (SELECT * FROM {t} AS s WHERE s._key = k.key LIMIT 1) AS s
     WHERE s._status = {ENRICHED} AND s._write_version < k.epoch
       AND s._run_id IS DISTINCT FROM $3
)""")


# $run the run id, $org, $play, $namespace its sheet (bind expressions from the caller).
# `digests || ''` reads a membership row's digests once (they are stored uncompressed out of
# line, so each `substring` of the stored value would fetch its slice again).
_MEMBER = with_row_statuses("""(_run_id = {run} OR (_status = {ENRICHED} AND _key IN (
    SELECT encode(substring(r.digests FROM i * 16 + 1 FOR 16), 'hex')
      FROM (SELECT r.digests || ''::bytea AS digests FROM {reuse} AS r WHERE {recorded}
            OFFSET 0) AS r
      CROSS JOIN LATERAL generate_series(0, coalesce(length(r.digests), 0) / 16 - 1) AS i
    UNION ALL
    SELECT k.key FROM {reuse} AS r CROSS JOIN LATERAL unnest(r.keys) AS k(key) WHERE {recorded}
  ) AND _write_version < (SELECT max(r.epoch) FROM {reuse} AS r WHERE {recorded})))""")


def member_condition(reuse: str, run: str, org: str, play: str, namespace: str) -> str:
    """The WHERE condition of a run's rows (see the module docstring): `reuse` the membership
    table, the others bind expressions (`$n::text`) of the run id and the sheet's scope."""
    recorded = (f"r.org_id = {org} AND r.play = {play} AND r.table_namespace = {namespace}"
                f" AND r.run_id = {run}")
    return _MEMBER.format(run=run, reuse=reuse, recorded=recorded)


def split_keys(keys: Sequence[str]) -> tuple[bytes | None, Sequence[str] | None]:
    """The keys as 16-byte digests when every one is a row key (32 lowercase hex digits), else
    as text: a 10,000-key text array costs milliseconds to encode, its digests microseconds."""
    if set(map(len, keys)) == {32}:
        joined = "".join(keys)
        try:
            digests = bytes.fromhex(joined)
        except ValueError:
            digests = None
        if digests is not None and digests.hex() == joined:
            return digests, None
    return None, keys


@action("sheets.record_reuse", params={
    "run": RUN_REF, "table_namespace": STR, "keys": list_of(STR),
}, result=INT)
async def record_reuse(port: Port, run: RunRef, table_namespace: str, keys: Sequence[str]) -> int:
    """Record that `run` reused the enriched rows among `keys` (one statement); returns how
    many keys were recorded (0 writes nothing)."""
    check_scope(port, run)
    namespace = normalize_namespace(table_namespace)
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise InvalidInputError("keys must be a list of row keys")
    unique = list(dict.fromkeys(keys))
    if not unique:
        return 0
    digests, texts = split_keys(unique)
    if texts is not None:
        for i, key in enumerate(texts):
            if type(key) is not str or not 0 < len(key) <= ALWAYS_SAFE_KEY_CHARS \
                    or not is_clean_str(key):
                check_key(key, f"keys[{i}]")
    sql = _RECORD.format(reuse=table(port, "sheet_reuse"))
    scope = run.scope
    await with_connection(port, SHEET_LANE, lambda conn: conn.execute(
        sql, scope.org_id, scope.play, namespace, scope.run_id, run.epoch, digests, texts))
    return len(unique)
