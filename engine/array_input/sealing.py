"""Sealing an array input: verify every staged page, then write the seal under the locked guard.

How it works
1. One read (no lock) of guard, begin and seal. A completed seal that matches is reused as the
   proof that the same immutable pages were verified: `seal` returns without scanning.
2. The scan fetches `batch_size` (1, 4 or 8) pages per connection checkout. Each checkout's one
   statement also re-reads the guard and the seal, and returns no pages once the run is retired
   (`RetiredError`) or a peer completed the seal meanwhile (we return without writing). The
   permit is released before any page is decoded or hashed; verification (header, ordinal,
   contiguous offsets, row counts, recomputed digest, row shapes) runs outside the checkout with
   a checkpoint after every page, and the page digests are chained in order.
3. The total row count and the identities flag must match the begin fact.
4. The seal fact is written by one statement that locks the guard `FOR UPDATE`, so a retirement
   that ran during the released scan makes it refuse (`RetiredError`); pages are write-once and
   only retirement deletes them, so an open guard under the lock means every verified page is
   still there. A peer's identical seal is accepted; a different one is a `ConflictError`.
"""

from __future__ import annotations

import hashlib

import attrs
import trio

from .. import canonical
from ..actions import action
from ..values.codecs import BOOL, INT, MAP_SCOPE, STR, optional
from ..errors import ConflictError, CorruptFactError, InvalidInputError
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..runs.reissue import NotVisible
from ..values.scopes import MapScope
from . import facts as F
from . import pages as P
from . import values as V

_START = F.MANIFEST_SQL  # guard, begin and seal of the map, in one unlocked read

# $1 guard, $2 seal, $3 page keys in ordinal order
_SCAN_BATCH = """
WITH guard AS (
    SELECT status, run_id, output FROM {t} WHERE k = $1
), seal AS (
    SELECT status, run_id, output FROM {t} WHERE k = $2
)
SELECT 0 AS part, 0::bigint AS position, status, run_id, output::text AS output FROM guard
UNION ALL
SELECT 1, 0, status, run_id, output::text FROM seal
UNION ALL
SELECT 2, wanted.position, p.status, p.run_id, p.output::text
  FROM unnest($3::bytea[]) WITH ORDINALITY AS wanted(k, position)
  JOIN {t} AS p ON p.k = wanted.k
 WHERE NOT EXISTS (SELECT 1 FROM seal)
   AND EXISTS (SELECT 1 FROM guard WHERE guard.output->'retired' = 'false'::jsonb)
"""

# $1 guard, $2 begin, $3 seal, $4 run id, $5 fingerprint, $6 source rows, $7 identities, $8 seal
_WRITE_SEAL = """
WITH guard AS (
    SELECT status, run_id, output FROM {t} WHERE k = $1 FOR UPDATE
), begun AS (
    SELECT status, run_id, output FROM {t} WHERE k = $2
), written AS (
    INSERT INTO {t} (k, status, output, run_id)
    SELECT $3, {COMPLETED}, $8::jsonb, $4 FROM guard, begun
     WHERE {guard_open}
       AND begun.status = {COMPLETED} AND begun.run_id = $4 AND begun.output->>'kind' = 'array_input_begin'
       AND begun.output->>'source_fingerprint' = $5
       AND begun.output->'source_rows' = to_jsonb($6::bigint)
       AND begun.output->'has_source_identities' = to_jsonb($7::boolean)
    ON CONFLICT (k) DO NOTHING
    RETURNING 1
)
SELECT g.status AS g_status, g.run_id AS g_run, g.output::text AS g_output,
       b.status AS b_status, b.run_id AS b_run, b.output::text AS b_output,
       EXISTS (SELECT 1 FROM written) AS written,
       s.status AS s_status, s.run_id AS s_run, s.output::text AS s_output
  FROM (SELECT 1) AS one
  LEFT JOIN guard AS g ON true
  LEFT JOIN begun AS b ON true
  LEFT JOIN {t} AS s ON s.k = $3
"""


def _check_seal_args(source_rows: int, page_count: int, batch_size: int) -> None:
    V.check_count(source_rows, "source_rows")
    V.check_count(page_count, "page_count")
    if batch_size not in V.SEAL_BATCH_SIZES or type(batch_size) is not int:
        raise InvalidInputError(f"batch_size must be one of {V.SEAL_BATCH_SIZES}, got {batch_size!r}")
    least = -(-source_rows // V.MAX_PAGE_ROWS)
    if not least <= page_count <= source_rows:
        raise InvalidInputError(
            f"page_count {page_count} cannot hold {source_rows} rows in pages of 1 to "
            f"{V.MAX_PAGE_ROWS} rows"
        )


def _matching_seal(row_status, row_run, row_output, scope: MapScope, expected: dict) -> bool:
    """True when a stored seal equals the one we would write (its digest chain aside)."""
    seal = F.seal_output(row_status, row_run, row_output, scope)
    mine = {key: value for key, value in seal.items() if key != "digest_chain"}
    if mine != expected:
        raise ConflictError(
            f"array input {scope.map_invocation_id!r} is sealed with a different manifest: {mine}"
        )
    return True


@action("array_input.seal", params={"scope": MAP_SCOPE, "source_fingerprint": STR,
        "source_rows": INT, "page_count": INT, "batch_size": INT}, result=V.MANIFEST,
        deadline_s=75.0)
async def seal(
    port: Port, scope: MapScope, *, source_fingerprint: str, source_rows: int, page_count: int,
    batch_size: int = 4,
) -> V.Manifest:
    """Verify every page of the staged source and write the seal (or reuse a completed one);
    answers the sealed manifest (what `get_manifest` now reads), saving the caller that read."""
    scope = F.map_scope(port, scope)
    V.check_fingerprint(source_fingerprint)
    _check_seal_args(source_rows, page_count, batch_size)
    expected, sealed = await _begin_seal(port, scope, source_fingerprint, source_rows, page_count)
    if sealed:
        return _sealed_manifest(expected)  # a completed seal is the proof; no re-verification
    return await _verify_and_seal(port, scope, expected, batch_size)


def _sealed_manifest(expected: dict) -> V.Manifest:
    return V.Manifest("sealed", expected["source_fingerprint"], expected["source_rows"],
                      expected["has_source_identities"], expected["page_count"])


async def _verify_and_seal(port: Port, scope: MapScope, expected: dict,
                           batch_size: int) -> V.Manifest:
    """Steps 2 to 4: scan and verify every page, check the totals, write the seal."""
    scanned = await _scan_pages(port, scope, expected, batch_size)
    if scanned is not None:  # else a peer completed the same seal while we scanned
        _check_totals(scanned, expected)
        await _write_seal(port, scope, expected, scanned.digest_chain)
    return _sealed_manifest(expected)


async def _begin_seal(port: Port, scope: MapScope, source_fingerprint: str, source_rows: int,
                      page_count: int) -> tuple[dict, bool]:
    """Step 1, one statement: the guard must be open and the begin fact agree with the source;
    returns the seal's expected manifest and whether a completed seal already matches it."""
    start_args = (F.guard_key(scope), F.begin_key(scope), F.seal_key(scope))
    row = await F.run_statement(port, RECEIPTS_LANE, _START.format(t=table(port, "work_receipts")),
                                start_args, lambda r: r)
    F.require_open(row["g_status"], row["g_run"], row["g_output"], scope)
    begun = F.begin_output(row["b_status"], row["b_run"], row["b_output"], scope)
    if (begun["source_fingerprint"], begun["source_rows"]) != (source_fingerprint, source_rows):
        raise ConflictError(
            f"seal of {source_rows} rows ({source_fingerprint}) disagrees with the begun source of "
            f"{begun['source_rows']} rows ({begun['source_fingerprint']})"
        )
    expected = {"kind": F.SEAL_KIND, "source_fingerprint": source_fingerprint,
                "source_rows": source_rows, "has_source_identities": begun["has_source_identities"],
                "page_count": page_count}
    sealed = row["s_status"] is not None and _matching_seal(
        row["s_status"], row["s_run"], row["s_output"], scope, expected)
    return expected, sealed


@attrs.frozen
class _Scanned:
    """What the page scan found: the chained digest of the pages, their rows, and whether any
    page carries source identities."""

    digest_chain: str
    rows: int
    any_identity: bool


async def _scan_pages(port: Port, scope: MapScope, expected: dict,
                      batch_size: int) -> _Scanned | None:
    """Step 2: every page, `batch_size` a checkout, verified outside the checkouts (in order,
    each at the offset the previous ones end at); None when a peer's matching seal appears
    meanwhile. The guard must stay open, and a missing page is corrupt."""
    page_count = expected["page_count"]
    chain = hashlib.sha256()
    next_offset = 0
    any_identity = False
    scan_sql = _SCAN_BATCH.format(t=table(port, "work_receipts"))
    for first in range(0, page_count, batch_size):
        ordinals = range(first, min(first + batch_size, page_count))
        keys = [F.page_key(scope, ordinal) for ordinal in ordinals]
        rows = await with_connection(
            port, RECEIPTS_LANE,
            lambda conn: conn.fetch(scan_sql, F.guard_key(scope), F.seal_key(scope), keys),
        )
        guard_row = next((r for r in rows if r["part"] == 0), None)
        if guard_row is None:
            raise CorruptFactError(f"the run guard of run {scope.run_id!r} is missing")
        F.require_open(guard_row["status"], guard_row["run_id"], guard_row["output"], scope)
        seal_row = next((r for r in rows if r["part"] == 1), None)
        if seal_row is not None and _matching_seal(
            seal_row["status"], seal_row["run_id"], seal_row["output"], scope, expected
        ):
            return None
        found = {r["position"]: r for r in rows if r["part"] == 2}
        for position, ordinal in enumerate(ordinals, start=1):
            fact_row = found.get(position)
            if fact_row is None:
                raise CorruptFactError(f"page {ordinal} of {page_count} is missing; cannot seal")
            fact = F.fact_output(fact_row["status"], fact_row["run_id"], fact_row["output"],
                                 scope, F.PAGE_KIND)
            page = P.verify_page(fact, source_fingerprint=expected["source_fingerprint"],
                                 ordinal=ordinal, offset=next_offset, build=False)
            chain.update(page.digest.encode())
            next_offset += page.row_count
            any_identity = any_identity or page.has_source_identities
            del fact, page, fact_row
            await trio.lowlevel.checkpoint()
        del rows, found
    return _Scanned(chain.hexdigest(), next_offset, any_identity)


def _check_totals(scanned: _Scanned, expected: dict) -> None:
    """Step 3: the pages' rows and source identities against the begin fact's."""
    page_count, source_rows = expected["page_count"], expected["source_rows"]
    identities = expected["has_source_identities"]
    if scanned.rows != source_rows:
        raise CorruptFactError(
            f"the {page_count} pages hold {scanned.rows} rows; the source has {source_rows}"
        )
    if scanned.any_identity != identities:
        raise CorruptFactError(
            f"the pages {'carry' if scanned.any_identity else 'lack'} source identities; the "
            f"begin fact says has_source_identities={identities}"
        )


async def _write_seal(port: Port, scope: MapScope, expected: dict, digest_chain: str) -> None:
    """Step 4, one statement under the locked guard: the seal is written unless one exists;
    the begin fact must not have changed, and an existing seal must match ours (a peer's seal
    committed after our snapshot is not visible yet: the statement is retried)."""
    source_fingerprint, source_rows = expected["source_fingerprint"], expected["source_rows"]
    identities = expected["has_source_identities"]
    output = dict(expected, digest_chain=digest_chain)

    def decide(row) -> None:
        F.require_open(row["g_status"], row["g_run"], row["g_output"], scope)
        begun = F.begin_output(row["b_status"], row["b_run"], row["b_output"], scope)
        if (begun["source_fingerprint"], begun["source_rows"], begun["has_source_identities"]) \
                != (source_fingerprint, source_rows, identities):
            raise ConflictError(f"the begin fact of {scope.map_invocation_id!r} changed during the seal")
        if row["written"]:
            return
        if row["s_status"] is None:
            raise NotVisible  # a peer's seal committed after our snapshot
        _matching_seal(row["s_status"], row["s_run"], row["s_output"], scope, expected)

    write_sql = F.fact_sql(_WRITE_SEAL, port, guard_run="$4")
    args = (F.guard_key(scope), F.begin_key(scope), F.seal_key(scope), scope.run_id,
            source_fingerprint, source_rows, identities, canonical.stable_dumps(output))
    await F.run_statement(port, RECEIPTS_LANE, write_sql, args, decide)



@action("array_input.put_and_seal", params={"scope": MAP_SCOPE, "source_fingerprint": STR,
        "source_rows": INT, "page": P.ENCODED_PAGE, "has_source_identities": optional(BOOL)},
        result=V.MANIFEST, deadline_s=75.0)
async def put_and_seal(port: Port, scope: MapScope, *, source_fingerprint: str, source_rows: int,
                       page: P.EncodedPage, has_source_identities: bool | None = None
                       ) -> V.Manifest:
    """A one-page source staged in one call: with `has_source_identities` its begin fact
    written first (`begin`), then its page put (`put_encoded_page`, ordinal 0) and the source
    sealed (`seal`), so a small list is staged in one request, not three. Each step is
    idempotent, so a retry of the whole is too. A begin fact written here is this source's
    (`begin` refuses any other), so the seal goes straight to verifying the page: the scan
    reads the guard and any seal again, and the seal's write checks the begin fact under the
    locked guard."""
    _check_seal_args(source_rows, 1, 1)  # before anything is written
    if has_source_identities is None:
        await F.put_encoded_page(port, scope, source_fingerprint=source_fingerprint, ordinal=0,
                                 offset=0, page=page)
        return await seal(port, scope, source_fingerprint=source_fingerprint,
                          source_rows=source_rows, page_count=1, batch_size=1)
    await F.begin(port, scope, source_fingerprint=source_fingerprint,
                  source_rows=source_rows, has_source_identities=has_source_identities)
    await F.put_encoded_page(port, scope, source_fingerprint=source_fingerprint, ordinal=0,
                             offset=0, page=page)
    expected = {"kind": F.SEAL_KIND, "source_fingerprint": source_fingerprint,
                "source_rows": source_rows, "has_source_identities": has_source_identities,
                "page_count": 1}
    return await _verify_and_seal(port, F.map_scope(port, scope), expected, 1)
