"""Array-input facts in `work_receipts`: keys, the run guard, and the one-statement operations.

How it works
- Every fact is a `work_receipts` row with status completed, the run id, a NULL epoch and an
  `output` object whose `kind` names it. Keys come from `engine.values.keys.fact_key`:
    guard  [org, play, "array_input_guard", run]                     {kind, retired}
    begin  [org, play, "array_input_begin", run, namespace, map]     {kind, source_fingerprint,
                                                                      source_rows, has_source_identities}
    page   [org, play, "array_input_page",  run, namespace, map, n]  {kind, source_fingerprint, ordinal,
                                                                      offset, row_count, rows, digest}
    seal   [org, play, "array_input_seal",  run, namespace, map]     {kind, source_fingerprint, source_rows,
                                                                      has_source_identities, page_count,
                                                                      digest_chain}
  so the begin, page and seal facts of a run each lie in that run's key-prefix range of their
  kind, and retirement finds them without touching any other run's rows.
- The run guard is created by the first `begin` (or `retire`) and never deleted. Writers lock
  it in the same statement that writes: `begin` and the final seal write `FOR UPDATE`,
  `put_page` `FOR SHARE` — which excludes retirement exactly as `FOR UPDATE` would, while letting
  a map's page puts run in parallel. Once retired, every write and read raises `RetiredError`.
  Readers (`get_manifest`, `read_page`, the seal's scan) read the guard without a lock.
- Each operation here is ONE statement (one round trip; autocommit, or inside the caller's
  transaction under an execution role): a CTE locks or creates the guard, checks the begin
  fact, writes if absent, and returns what Python needs to name the outcome. The write is
  conditioned in SQL on the same facts Python then checks, so a refusal never leaves a write.
  READ COMMITTED detail: a row committed by a peer after our statement's snapshot is seen by
  `ON CONFLICT` but not by our reads; the statement then reports "not visible" and is issued
  again (at most a few times, only under such a race).
- Decoding and digest checks run after the connection is released.
- Known, harmless window: a put of a page at an ordinal *beyond* the sealed page count that
  waited for the guard while the final seal write held it may still insert that page (its
  snapshot predates the seal). Such a page is never read (`read_page` is bounded by the seal's
  page count) and is deleted with the run; a put at a sealed ordinal is always checked against
  the stored page.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from .. import canonical
from ..actions import action
from ..values.codecs import BOOL, INT, MAP_SCOPE, NOTHING, STR
from ..errors import ConflictError, CorruptFactError, InvalidInputError, RetiredError, ScopeError
from ..values.keys import fact_key
from ..pg import Record
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..receipts import SQL_STATUSES, ReceiptStatus
from ..runs.reissue import NotVisible, fetchrow_until_visible
from ..values.scopes import MapScope, RunScope, check_scope
from . import pages as P
from . import values as V

T = TypeVar("T")

GUARD_KIND = "array_input_guard"
BEGIN_KIND = "array_input_begin"
PAGE_KIND = V.PAGE_KIND
SEAL_KIND = "array_input_seal"
FACT_KINDS = (BEGIN_KIND, PAGE_KIND, SEAL_KIND)  # what retirement deletes

GUARD_OPEN_TEXT = canonical.stable_dumps({"kind": GUARD_KIND, "retired": False})
GUARD_RETIRED_TEXT = canonical.stable_dumps({"kind": GUARD_KIND, "retired": True})



# -- scopes and keys ---------------------------------------------------------------------------


def map_scope(port: Port, scope: object) -> MapScope:
    if not isinstance(scope, MapScope):
        raise ScopeError(f"array inputs need a MapScope, got {type(scope).__name__}")
    check_scope(port, scope)
    return scope


def run_scope(port: Port, scope: object) -> RunScope:
    if not isinstance(scope, RunScope):
        raise ScopeError(f"retirement needs a RunScope, got {type(scope).__name__}")
    check_scope(port, scope)
    return scope


def guard_key(scope: MapScope | RunScope) -> bytes:
    return fact_key(scope.play_scope, GUARD_KIND, scope.run_id)


def begin_key(scope: MapScope) -> bytes:
    return fact_key(scope.play_scope, BEGIN_KIND, scope.run_id, scope.table_namespace,
                    scope.map_invocation_id)


def seal_key(scope: MapScope) -> bytes:
    return fact_key(scope.play_scope, SEAL_KIND, scope.run_id, scope.table_namespace,
                    scope.map_invocation_id)


def page_key(scope: MapScope, ordinal: int) -> bytes:
    return fact_key(scope.play_scope, PAGE_KIND, scope.run_id, scope.table_namespace,
                    scope.map_invocation_id, ordinal)


# -- decoding stored facts ---------------------------------------------------------------------


def fact_output(status: int | None, run_id: str | None, output_text: str | None, scope, kind: str) -> dict:
    """The output of a present fact of `kind`, or `CorruptFactError` when it is malformed."""
    output = canonical.loads(output_text)
    if status != ReceiptStatus.COMPLETED or run_id != scope.run_id or type(output) is not dict \
            or output.get("kind") != kind:
        raise CorruptFactError(f"the {kind} fact of run {scope.run_id!r} is malformed")
    return output


def guard_retired(status: int | None, run_id: str | None, output_text: str | None, scope) -> bool | None:
    """None when there is no guard; else whether the run is retired."""
    if status is None:
        return None
    guard = fact_output(status, run_id, output_text, scope, GUARD_KIND)
    if type(guard.get("retired")) is not bool:  # the same test the statements make in SQL
        raise CorruptFactError(f"the run guard of run {scope.run_id!r} is malformed")
    return guard["retired"]


def require_open(status: int | None, run_id: str | None, output_text: str | None, scope) -> None:
    """Raise unless the guard exists and is not retired."""
    retired = guard_retired(status, run_id, output_text, scope)
    if retired is None:
        raise CorruptFactError(
            f"array input of run {scope.run_id!r} was never begun (no run guard)"
        )
    if retired:
        raise RetiredError(f"run {scope.run_id!r} is retired: its array inputs are gone")


def begin_output(status: int | None, run_id: str | None, output_text: str | None, scope: MapScope) -> dict:
    if status is None:
        raise CorruptFactError(
            f"array input {scope.table_namespace}/{scope.map_invocation_id} has no begin fact"
        )
    begin = fact_output(status, run_id, output_text, scope, BEGIN_KIND)
    if (
        len(begin) != 4
        or not isinstance(begin.get("source_fingerprint"), str)
        or V.FINGERPRINT_PATTERN.fullmatch(begin["source_fingerprint"]) is None
        or not P.is_count(begin.get("source_rows"))
        or type(begin.get("has_source_identities")) is not bool
    ):
        raise CorruptFactError(f"the begin fact of {scope.map_invocation_id!r} is malformed")
    return begin


def seal_output(status: int | None, run_id: str | None, output_text: str | None, scope: MapScope) -> dict:
    seal = fact_output(status, run_id, output_text, scope, SEAL_KIND)
    if (
        len(seal) != 6
        or not isinstance(seal.get("source_fingerprint"), str)
        or not P.is_count(seal.get("source_rows"))
        or not P.is_count(seal.get("page_count"))
        or type(seal.get("has_source_identities")) is not bool
        or not isinstance(seal.get("digest_chain"), str)
        or V.FINGERPRINT_PATTERN.fullmatch(seal["digest_chain"]) is None
    ):
        raise CorruptFactError(f"the seal fact of {scope.map_invocation_id!r} is malformed")
    return seal


async def run_statement(
    port: Port, lane: str, sql: str, args: tuple, decide: Callable[[Record | None], T]
) -> T:
    """Issue `sql` and let `decide(row)` name the outcome; re-issued while it raises
    `NotVisible`, a bounded number of times (`engine.runs.reissue`)."""
    return await with_connection(
        port, lane,
        lambda conn: fetchrow_until_visible(conn, sql, args, decide, what="array input facts"),
    )


def fact_sql(template: str, port: Port, *, guard_run: str | None = None) -> str:
    """`template` for the port's schema: `{t}` is `work_receipts`, `{COMPLETED}` and the other
    statuses their values, and `{guard_open}` the open-guard test on the CTE `guard` for the run
    id parameter `guard_run` (e.g. `"$4"`)."""
    parts: dict[str, object] = dict(SQL_STATUSES, t=table(port, "work_receipts"))
    if guard_run is not None:
        parts["guard_open"] = GUARD_IS_OPEN.format(g="guard", run=guard_run, **SQL_STATUSES)
    return template.format(**parts)


GUARD_IS_OPEN = """{g}.status = {COMPLETED} AND {g}.run_id = {run} AND {g}.output->>'kind' = 'array_input_guard'
       AND {g}.output->'retired' = 'false'::jsonb"""


# -- manifest ----------------------------------------------------------------------------------

MANIFEST_SQL = """
SELECT g.status AS g_status, g.run_id AS g_run, g.output::text AS g_output,
       b.status AS b_status, b.run_id AS b_run, b.output::text AS b_output,
       s.status AS s_status, s.run_id AS s_run, s.output::text AS s_output
  FROM (SELECT 1) AS one
  LEFT JOIN {t} AS g ON g.k = $1
  LEFT JOIN {t} AS b ON b.k = $2
  LEFT JOIN {t} AS s ON s.k = $3
"""


@action("array_input.get_manifest", params={"scope": MAP_SCOPE}, result=V.MANIFEST, writes=False)
async def get_manifest(port: Port, scope: MapScope) -> V.Manifest:
    """What is staged for `scope`: absent, staging or sealed; `RetiredError` once retired."""
    scope = map_scope(port, scope)

    def decide(row) -> V.Manifest:
        if guard_retired(row["g_status"], row["g_run"], row["g_output"], scope):
            raise RetiredError(f"run {scope.run_id!r} is retired: its array inputs are gone")
        if row["b_status"] is None:
            if row["s_status"] is not None:
                raise CorruptFactError(f"{scope.map_invocation_id!r} has a seal but no begin fact")
            return V.Manifest("absent")
        begin = begin_output(row["b_status"], row["b_run"], row["b_output"], scope)
        fields = (begin["source_fingerprint"], begin["source_rows"], begin["has_source_identities"])
        if row["g_status"] is None or row["s_status"] is None:
            # No run guard (or no seal): not sealed, so still staging, whatever else is stored;
            # the writes that need the guard check it themselves.
            return V.Manifest("staging", *fields)
        seal = seal_output(row["s_status"], row["s_run"], row["s_output"], scope)
        if (seal["source_fingerprint"], seal["source_rows"], seal["has_source_identities"]) != fields:
            raise CorruptFactError(f"the seal of {scope.map_invocation_id!r} disagrees with its begin")
        return V.Manifest("sealed", *fields, seal["page_count"])

    sql = fact_sql(MANIFEST_SQL, port)
    args = (guard_key(scope), begin_key(scope), seal_key(scope))
    return await run_statement(port, RECEIPTS_LANE, sql, args, decide)


# -- begin -------------------------------------------------------------------------------------

# $1 guard key, $2 begin key, $3 open guard output, $4 run id, $5 begin output
_BEGIN = """
WITH created AS (
    INSERT INTO {t} (k, status, output, run_id) VALUES ($1, {COMPLETED}, $3::jsonb, $4)
    ON CONFLICT (k) DO NOTHING
    RETURNING status, run_id, output
), locked AS (
    SELECT status, run_id, output FROM {t} WHERE k = $1 FOR UPDATE
), guard AS (
    SELECT * FROM created UNION ALL SELECT * FROM locked
), written AS (
    INSERT INTO {t} (k, status, output, run_id)
    SELECT $2, {COMPLETED}, $5::jsonb, $4 FROM guard WHERE {guard_open}
    ON CONFLICT (k) DO NOTHING
    RETURNING 1
)
SELECT g.status AS g_status, g.run_id AS g_run, g.output::text AS g_output,
       EXISTS (SELECT 1 FROM written) AS written,
       b.status AS b_status, b.run_id AS b_run, b.output::text AS b_output
  FROM (SELECT 1) AS one
  LEFT JOIN guard AS g ON true
  LEFT JOIN {t} AS b ON b.k = $2
"""


@action("array_input.begin", params={"scope": MAP_SCOPE, "source_fingerprint": STR,
        "source_rows": INT, "has_source_identities": BOOL}, result=NOTHING)
async def begin(
    port: Port, scope: MapScope, *, source_fingerprint: str, source_rows: int,
    has_source_identities: bool,
) -> None:
    """Write the begin fact if absent; `ConflictError` when a different one exists."""
    scope = map_scope(port, scope)
    V.check_fingerprint(source_fingerprint)
    V.check_count(source_rows, "source_rows")
    if type(has_source_identities) is not bool:
        raise InvalidInputError(
            f"has_source_identities must be a bool, got {type(has_source_identities).__name__}"
        )
    expected = {"kind": BEGIN_KIND, "source_fingerprint": source_fingerprint,
                "source_rows": source_rows, "has_source_identities": has_source_identities}

    def decide(row) -> None:
        if row["g_status"] is None:
            raise NotVisible  # a peer created the guard after our snapshot
        require_open(row["g_status"], row["g_run"], row["g_output"], scope)
        if row["written"]:
            return
        if row["b_status"] is None:
            raise NotVisible  # a peer wrote the begin fact after our snapshot
        stored = begin_output(row["b_status"], row["b_run"], row["b_output"], scope)
        if stored != expected:
            raise ConflictError(
                f"array input {scope.map_invocation_id!r} changed after staging began: stored "
                f"{stored['source_rows']} rows with fingerprint {stored['source_fingerprint']}"
            )

    sql = fact_sql(_BEGIN, port, guard_run="$4")
    args = (guard_key(scope), begin_key(scope), GUARD_OPEN_TEXT, scope.run_id,
            canonical.stable_dumps(expected))
    await run_statement(port, RECEIPTS_LANE, sql, args, decide)


# -- put_page ----------------------------------------------------------------------------------

# $1 guard, $2 begin, $3 seal, $4 page key, $5 run id, $6 fingerprint, $7 offset + rows, $8 fact
_PUT_PAGE = """
WITH guard AS (
    SELECT status, run_id, output FROM {t} WHERE k = $1 FOR SHARE
), begun AS (
    SELECT status, run_id, output FROM {t} WHERE k = $2
), written AS (
    INSERT INTO {t} (k, status, output, run_id)
    SELECT $4, {COMPLETED}, $8::jsonb, $5 FROM guard, begun
     WHERE {guard_open}
       AND begun.status = {COMPLETED} AND begun.run_id = $5 AND begun.output->>'kind' = 'array_input_begin'
       AND begun.output->>'source_fingerprint' = $6
       AND jsonb_typeof(begun.output->'source_rows') = 'number'
       AND $7::bigint <= (begun.output->>'source_rows')::numeric
       AND NOT EXISTS (SELECT 1 FROM {t} WHERE k = $3)
    ON CONFLICT (k) DO NOTHING
    RETURNING 1
)
SELECT g.status AS g_status, g.run_id AS g_run, g.output::text AS g_output,
       b.status AS b_status, b.run_id AS b_run, b.output::text AS b_output,
       EXISTS (SELECT 1 FROM {t} WHERE k = $3) AS sealed,
       EXISTS (SELECT 1 FROM written) AS written,
       p.status AS p_status, p.run_id AS p_run,
       h.kind AS p_kind, h.source_fingerprint AS p_fingerprint, h.ordinal::text AS p_ordinal,
       h."offset"::text AS p_offset, h.row_count::text AS p_row_count, h.digest AS p_digest
  FROM (SELECT 1) AS one
  LEFT JOIN guard AS g ON true
  LEFT JOIN begun AS b ON true
  LEFT JOIN {t} AS p ON p.k = $4
  LEFT JOIN LATERAL jsonb_to_record(p.output) AS h(
      kind text, source_fingerprint text, ordinal jsonb, "offset" jsonb, row_count jsonb,
      digest text) ON true
"""


@action("array_input.put_page", params={"scope": MAP_SCOPE, "source_fingerprint": STR,
        "ordinal": INT, "offset": INT, "rows": V.OCCURRENCES}, result=NOTHING)
async def put_page(
    port: Port, scope: MapScope, *, source_fingerprint: str, ordinal: int, offset: int,
    rows,
) -> None:
    """Write page `ordinal` if absent; the same page again is a no-op, a different one conflicts."""
    scope = map_scope(port, scope)
    V.check_fingerprint(source_fingerprint)
    V.check_count(ordinal, "ordinal")
    V.check_count(offset, "offset")
    page = P.encode_page(source_fingerprint, ordinal, offset, rows)
    await put_encoded_page(port, scope, source_fingerprint=source_fingerprint, ordinal=ordinal,
                           offset=offset, page=page)


@action("array_input.put_encoded_page", params={"scope": MAP_SCOPE, "source_fingerprint": STR,
        "ordinal": INT, "offset": INT, "page": P.ENCODED_PAGE}, result=NOTHING)
async def put_encoded_page(
    port: Port, scope: MapScope, *, source_fingerprint: str, ordinal: int, offset: int,
    page: P.EncodedPage,
) -> None:
    """`put_page` of a page fact already encoded by this package (`encode_page`, or
    `EncodedSource.page`), so a source encoded once is not encoded again to be put."""
    scope = map_scope(port, scope)
    V.check_fingerprint(source_fingerprint)
    V.check_count(ordinal, "ordinal")
    V.check_count(offset, "offset")
    if not isinstance(page, P.EncodedPage) or not 1 <= page.row_count <= V.MAX_PAGE_ROWS:
        raise InvalidInputError("page must be an EncodedPage of 1 to 1000 rows")
    if not page.is_page(source_fingerprint, ordinal, offset):
        raise InvalidInputError(f"the encoded page is not page {ordinal} at offset {offset} of "
                                "that source")
    end = offset + page.row_count
    V.check_count(end, "offset + len(rows)")

    def decide(row) -> None:
        require_open(row["g_status"], row["g_run"], row["g_output"], scope)
        begun = begin_output(row["b_status"], row["b_run"], row["b_output"], scope)
        if begun["source_fingerprint"] != source_fingerprint or end > begun["source_rows"]:
            raise ConflictError(
                f"page {ordinal} (rows {offset}..{end - 1}) disagrees with the begun source of "
                f"{begun['source_rows']} rows"
            )
        if row["written"]:
            return
        if row["p_status"] is None:
            if row["sealed"]:
                raise ConflictError(f"array input is sealed without a page {ordinal}")
            raise NotVisible  # a peer wrote this page after our snapshot
        if row["p_status"] != ReceiptStatus.COMPLETED or row["p_run"] != scope.run_id or row["p_kind"] != PAGE_KIND:
            raise CorruptFactError(f"the stored page {ordinal} is malformed")
        stored = (row["p_digest"], row["p_fingerprint"], row["p_ordinal"], row["p_offset"],
                  row["p_row_count"])
        if stored != (page.digest, source_fingerprint, str(ordinal), str(offset), str(page.row_count)):
            raise ConflictError(f"a different page {ordinal} is already stored (pages are immutable)")

    sql = fact_sql(_PUT_PAGE, port, guard_run="$5")
    args = (guard_key(scope), begin_key(scope), seal_key(scope), page_key(scope, ordinal),
            scope.run_id, source_fingerprint, end, page.text)
    await run_statement(port, RECEIPTS_LANE, sql, args, decide)


# -- read_page ---------------------------------------------------------------------------------

_READ_PAGE = """
SELECT g.status AS g_status, g.run_id AS g_run, g.output::text AS g_output,
       s.status AS s_status, s.run_id AS s_run, s.output::text AS s_output,
       p.status AS p_status, p.run_id AS p_run, p.output::text AS p_output
  FROM (SELECT 1) AS one
  LEFT JOIN {t} AS g ON g.k = $1
  LEFT JOIN {t} AS s ON s.k = $2
  LEFT JOIN {t} AS p ON p.k = $3
"""


@action("array_input.read_page", params={"scope": MAP_SCOPE, "ordinal": INT}, result=V.PAGE,
        writes=False)
async def read_page(port: Port, scope: MapScope, ordinal: int) -> V.Page:
    """Page `ordinal` of a sealed input, its digest re-verified (`CorruptFactError` if not)."""
    scope = map_scope(port, scope)
    V.check_count(ordinal, "ordinal")
    sql = fact_sql(_READ_PAGE, port)
    args = (guard_key(scope), seal_key(scope), page_key(scope, ordinal))
    row = await run_statement(port, RECEIPTS_LANE, sql, args, lambda row: row)
    # The connection is back in the pool: decode and verify without holding a permit.
    require_open(row["g_status"], row["g_run"], row["g_output"], scope)
    if row["s_status"] is None:
        raise ConflictError(f"array input {scope.map_invocation_id!r} is not sealed: its pages are "
                            f"read once it is")  # a state, not corruption: a 409
    seal = seal_output(row["s_status"], row["s_run"], row["s_output"], scope)
    if ordinal >= seal["page_count"]:
        raise ConflictError(f"page {ordinal} is beyond the {seal['page_count']} sealed pages")
    if row["p_status"] is None:
        raise CorruptFactError(f"sealed page {ordinal} is missing")
    fact = fact_output(row["p_status"], row["p_run"], row["p_output"], scope, PAGE_KIND)
    verified = P.verify_page(fact, source_fingerprint=seal["source_fingerprint"], ordinal=ordinal)
    return V.Page(verified.offset, verified.rows)
