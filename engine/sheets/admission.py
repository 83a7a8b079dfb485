"""Admission: put a page of input rows into a sheet under the run's write version.

How it works
- Rows are validated, normalized, keyed (`row_key`, or the explicit `keys`) and deduplicated in
  Python before any query (the first occurrence wins; later ones count as `skipped`).
- Chunks of at most `ADMIT_CHUNK_ROWS` rows go to one statement each, all in one sheet write
  transaction (`layout.run_sheet_transaction`). The statement (`admission_sql`) inserts the
  new rows (`ON CONFLICT DO NOTHING`), and only when some row already existed reads the
  existing rows from its snapshot (which predates the inserts), decides their dispositions and
  re-admits the rows that need it; it applies the exact counter deltas to `sheet_summary`, in
  one round trip:
    * absent → inserted `pending` (`running` under the attempt's lease);
    * `enriched` with every contract output present (not NULL, JSON null or "") and its cell
      meta status `completed`, and no cell stale under its `CellPolicy` → `completed`, a cache
      hit whichever run wrote it; the row is not touched;
    * otherwise, owned by a newer write version → `blocked` (`newer_run`);
    * of our write version, `pending`/`running` under another attempt's unexpired lease →
      `blocked` (`attempt_active`);
    * with `give_up_after=N`, `failed` in N or more runs (`_failed_runs`, counted by
      completion) → `blocked` (`gave_up`); a larger N, or None, lets it run again;
    * otherwise → (re-)admitted to ours: status pending/running, our run, version, input index
      and lease, error cleared, stored input cells refreshed, earlier output cells and cell meta
      kept. Rows already exactly so are left untouched.
- Cell meta `completed_at` is epoch seconds from the server clock, so staleness is judged on
  the server's clock only; policies for fields that are not contract outputs are ignored.
- Cache hits are not touched: their `_run_id` stays the run that wrote them; a map records
  the rows its run reused apart (`engine.sheets.reuse`), and `read_rows(run_id=...)` lists both.
- `cache_hits="count"` returns cache hits as a count only (`Admission.cached`; `completed` is
  empty): a page of hits costs a few bytes instead of its outputs. The default lists them with
  their outputs.
- `staged_page=StagedPage(...)`: the rows are those of a sealed array-input page of this run;
  the statement reads their input cells from the stored page fact after checking it (see
  `admission_sql`), so they are not sent again. A fact that is not the expected one writes
  nothing and raises `CorruptFactError` (`RetiredError` once the run is retired).
- `probe` (`probing`) answers "is every one of these rows already settled?" from keys alone,
  judging them by the same SQL fragments as admission.
- `admit_prepared` is admission after its checks; the write modes (`writes`) run it with a
  prelude in the same transaction.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

import attrs

from .. import array_input, canonical
from ..actions import action
from ..array_input import facts
from ..codecs import BOOL, INT, INT32_MAX, RUN_REF, STR, USER_JSON, list_of, optional
from ..errors import ConflictError, CorruptFactError, InvalidInputError, MissingRelationError
from ..pg import Connection
from ..ports import Port
from ..scopes import RunRef, normalize_namespace

from .admission_sql import CACHE_HITS_MODES, build_admit_sql
from .inputs import PreparedRows, check_write, prepare_rows
from .layout import PhaseClock, SheetTxn, layout_for, run_sheet_transaction
from .model import (
    Admission,
    AdmittedRow,
    Attempt,
    BlockedRow,
    RowStatus,
    CellPolicy,
    SheetContract,
    StagedPage,
    Timing,
    check_give_up_after,
    clean_field,
    ADMISSION, ATTEMPT, CELL_POLICIES, CONTRACT, STAGED_PAGE,
)

ADMIT_CHUNK_ROWS = 10_000
ADMIT_STATEMENT_TIMEOUT_MS = 120_000


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")


def check_policies(cell_policies: Any) -> dict[str, CellPolicy]:
    if cell_policies is None:
        return {}
    if not isinstance(cell_policies, Mapping):
        raise InvalidInputError("cell_policies must map field names to CellPolicy")
    out = {}
    for name, policy in cell_policies.items():
        field = clean_field(name, "cell_policies")
        if not isinstance(policy, CellPolicy):
            raise InvalidInputError(f"cell_policies[{name!r}] must be a CellPolicy")
        out[field] = policy
    return out


def _check_staged(run: RunRef, staged_page: Any, rows: Sequence[Any]) -> StagedPage:
    if not isinstance(staged_page, StagedPage):
        raise InvalidInputError("staged_page must be a StagedPage or None")
    scope = staged_page.scope
    if (scope.org_id, scope.play, scope.run_id) != (run.scope.org_id, run.scope.play, run.run_id):
        raise InvalidInputError("staged_page must be an array input of the admitting run")
    if not isinstance(rows, Sequence) or not 1 <= len(rows) <= array_input.MAX_PAGE_ROWS:
        raise InvalidInputError(
            f"with staged_page, rows must be the page's 1 to {array_input.MAX_PAGE_ROWS} rows"
        )
    return staged_page


def _fact_keys(scope: Any, ordinal: int) -> tuple[bytes, bytes, bytes]:
    """Page, seal and guard keys of an array input (see `engine.array_input.facts`)."""
    return facts.page_key(scope, ordinal), facts.seal_key(scope), facts.guard_key(scope)


class _PageRefused(Exception):
    """The staged page fact was not the expected one; the transaction rolls back."""


@action("sheets.admit", params={
    "run": RUN_REF, "table_namespace": STR, "contract": CONTRACT, "rows": list_of(USER_JSON),
    "input_offset": INT, "keys": optional(list_of(STR)), "attempt": optional(ATTEMPT),
    "cell_policies": optional(CELL_POLICIES), "input_indexes": optional(list_of(INT)),
    "give_up_after": optional(INT), "cache_hits": STR, "staged_page": optional(STAGED_PAGE),
    "texts": optional(list_of(STR)), "force": BOOL,
}, result=ADMISSION, local=("within",), deadline_s=30.0)
async def admit(
    port: Port,
    run: RunRef,
    table_namespace: str,
    contract: SheetContract,
    rows: Sequence[dict],
    *,
    input_offset: int = 0,
    keys: Sequence[str] | None = None,
    attempt: Attempt | None = None,
    cell_policies: Mapping[str, CellPolicy] | None = None,
    input_indexes: Sequence[int] | None = None,
    give_up_after: int | None = None,
    cache_hits: str = "rows",
    staged_page: StagedPage | None = None,
    texts: Sequence[str] | None = None,
    force: bool = False,
    within: Callable[[Connection, frozenset[str], dict], Awaitable[None]] | None = None,
) -> Admission:
    """Admit `rows` into the sheet of (run's play, `table_namespace`) at the run's epoch.

    `input_indexes` (one per row) replaces `input_offset` + position as each row's input index.
    `cache_hits="count"` counts cache hits instead of listing them; `staged_page` reads the
    input cells from that sealed page of this run (`rows` are its rows, `input_offset` its
    offset) instead of sending them. `texts` (with `keys`) are the rows' canonical texts, from
    a caller that encoded them already (`engine.array_input.encode_source`): taken at the
    caller's word, as `keys` are, so the rows are not encoded again.
    `force=True` re-admits enriched rows an older write version wrote (they run again); rows
    our version already enriched stay cache hits, so a wake of a forced run resumes it.
    `within(conn, frozenset(), {})` runs last inside the admission's transaction (a shared
    map's unit lease check): what it raises rolls the admission back.
    """
    started = time.perf_counter()
    check_write(port, run, contract, attempt)
    check_flag("force", force)
    policies = check_policies(cell_policies)
    check_give_up_after(give_up_after)
    if cache_hits not in CACHE_HITS_MODES:
        raise InvalidInputError(f"cache_hits must be one of {CACHE_HITS_MODES}, got {cache_hits!r}")
    if staged_page is not None:
        staged_page = _check_staged(run, staged_page, rows)
        if input_indexes is not None:
            raise InvalidInputError("staged_page and input_indexes cannot be combined")
    namespace = normalize_namespace(table_namespace)
    prepared = prepare_rows(
        rows, namespace, input_offset=input_offset, keys=keys,
        need_texts=bool(contract.inputs) and staged_page is None, input_indexes=input_indexes,
        texts=texts,
    )
    return await admit_prepared(
        port, run, namespace, contract, prepared, started=started, attempt=attempt,
        policies=policies, give_up_after=give_up_after, cache_hits=cache_hits,
        staged_page=staged_page, page_rows=rows, input_offset=input_offset, force=force,
        within=within,
    )


# What a write mode runs first in the admission's transaction (`engine.sheets.writes`): it may
# change the sheet and returns how much to add to every row's input index.
Prelude = Callable[[Connection, SheetTxn], Awaitable[int]]


async def admit_prepared(
    port: Port, run: RunRef, namespace: str, contract: SheetContract, prepared: PreparedRows, *,
    started: float, attempt: Attempt | None = None,
    policies: Mapping[str, CellPolicy] | None = None,
    give_up_after: int | None = None, cache_hits: str = "rows",
    staged_page: StagedPage | None = None, page_rows: Sequence[Any] = (), input_offset: int = 0,
    force: bool = False, prelude: Prelude | None = None,
    within: Callable[[Connection, frozenset[str], dict], Awaitable[None]] | None = None,
) -> Admission:
    """`admit` after its checks: `prepared` rows, validated and keyed. `prelude` (not with a
    staged page) runs first in the same transaction; what it returns shifts every input index;
    `within` runs last in it (see `admit`)."""
    rows = page_rows
    policies = policies or {}
    layout = layout_for(port, run.scope.play_scope, namespace)
    source = "payload" if staged_page is None else "page"
    status = (RowStatus.RUNNING if attempt is not None else RowStatus.PENDING).value
    common = [
        run.epoch, run.run_id,
        attempt.attempt_id if attempt else None,
        attempt.seq if attempt else None,
        float(attempt.lease_s) if attempt else 0.0,
        *layout.counter_args, status,
    ]
    clock = PhaseClock()
    clock.add("prepare", time.perf_counter() - started)
    n = len(prepared.keys)
    if staged_page is None:
        chunks = [(low, min(low + ADMIT_CHUNK_ROWS, n)) for low in range(0, n, ADMIT_CHUNK_ROWS)]
    else:
        chunks = [(0, n)]
        # One statement zips the page's rows positionally: a key (NULL for a duplicate) and an
        # input index per page row; result ordinals are page positions.
        page_keys: list[str | None] = [None] * len(rows)
        index_of_position: list[int] = [-1] * len(rows)
        for i, (key, index) in enumerate(zip(prepared.keys, prepared.indexes)):
            page_keys[index - input_offset] = key
            index_of_position[index - input_offset] = i
        page_args = [
            page_keys, [input_offset + position for position in range(len(rows))], *common,
            *_fact_keys(staged_page.scope, staged_page.ordinal), staged_page.digest,
            input_offset, len(rows), staged_page.ordinal,
        ]

    shift = [0]

    async def op(conn: Connection, sheet: SheetTxn) -> list[Any]:
        sql, extra = build_admit_sql(
            port, layout, contract, policies, sheet.columns,
            cache_hits=cache_hits, source=source, give_up_after=give_up_after,  # type: ignore[arg-type]
            force=force,
        )
        results = []
        if staged_page is not None:
            record = await clock.measure("statement", conn.fetchrow(sql, *page_args, *extra))
            if not record["page_ok"]:
                raise _PageRefused
            return [(0, record)]
        indexes = prepared.indexes
        if prelude is not None:
            shift[0] = await clock.measure("prelude", prelude(conn, sheet))
            indexes = [index + shift[0] for index in indexes]
        for low, high in chunks:
            args = [prepared.keys[low:high], indexes[low:high], *common]
            texts = prepared.texts
            args.append("[" + ",".join(texts[low:high]) + "]" if texts is not None else None)
            statement = conn.fetchrow(sql, *args, *extra)
            results.append((low, await clock.measure("statement", statement)))
        if within is not None:
            await within(conn, frozenset(), {})
        return results

    results = []
    if n or prelude is not None:
        try:
            results = await run_sheet_transaction(
                port, layout, contract.fields, op, timeout_ms=ADMIT_STATEMENT_TIMEOUT_MS,
                clock=clock,
            )
        except _PageRefused:
            await _explain_refused_page(port, staged_page)
    if staged_page is None:
        locate: Callable[[int, int], int] = lambda low, ord_: low + ord_ - 1
    else:
        locate = lambda _low, ord_: index_of_position[ord_ - 1]
    if shift[0]:
        prepared = attrs.evolve(prepared, indexes=[index + shift[0] for index in prepared.indexes])
    admission = _build_admission(prepared, contract, results, run.epoch, cache_hits, locate)
    clock.add("total", time.perf_counter() - started)
    timings = tuple(Timing(phase, ms, n) for phase, ms in clock.ms.items())
    return Admission(
        inserted=admission[0],
        skipped=prepared.skipped,
        pending=admission[1],
        completed=admission[2],
        blocked=admission[3],
        write_version=run.epoch,
        timings=timings,
        cached=admission[4],
    )


async def _explain_refused_page(port: Port, staged_page: StagedPage) -> None:
    """Raise the error a refused staged page deserves: `RetiredError` when the run is retired
    (from the manifest read), `ConflictError` when the input is not sealed, else
    `CorruptFactError`."""
    manifest = await array_input.get_manifest(port, staged_page.scope)
    if manifest.state != "sealed":  # a state the caller can see, not corruption: a 409
        raise ConflictError(
            f"array input {staged_page.scope.map_invocation_id!r} is not sealed; its page "
            f"{staged_page.ordinal} cannot be admitted"
        )
    raise CorruptFactError(
        f"array input page {staged_page.ordinal} of {staged_page.scope.map_invocation_id!r} "
        "does not match the rows admitted from it (missing, altered or another page)"
    )


def _build_admission(prepared: PreparedRows, contract: SheetContract, results, version: int,
                     cache_hits: str, locate: Callable[[int, int], int]):
    """(inserted, pending, completed, blocked, cached) from the chunks' result records."""
    inserted = 0
    cached = 0
    completed: list[AdmittedRow] = []
    blocked: list[BlockedRow] = []
    taken: set[int] = set()
    pending_at: list[int] = []
    loads = canonical.loads
    for low, record in results:
        inserted += record["inserted"]
        for ord_, reason in zip(record["blocked_ords"] or [], record["blocked_reasons"] or []):
            i = locate(low, ord_)
            blocked.append(BlockedRow(prepared.keys[i], prepared.indexes[i], reason))
            taken.add(i)
        if cache_hits == "count":
            cached += record["cached"]
            if record["inserted"] == record["input_rows"]:  # all new: nothing was looked up
                pending_at.extend(range(low, low + record["input_rows"]))
            else:
                pending_at.extend(locate(low, ord_) for ord_ in record["pending_ords"] or [])
            continue
        ords = record["completed_ords"] or []
        # each output column comes back as one JSON array (one decode per chunk and column)
        columns = [loads(record[f"o{i}"]) or [] for i in range(len(contract.outputs))]
        for j, ord_ in enumerate(ords):
            i = locate(low, ord_)
            row = dict(prepared.rows[i])
            for field, values in zip(contract.outputs, columns):
                row[field] = values[j]
            completed.append(AdmittedRow(prepared.keys[i], prepared.indexes[i], row))
            taken.add(i)
        cached += len(ords)
    if cache_hits == "count":
        pending_at.sort()
        pending = tuple(
            AdmittedRow(prepared.keys[i], prepared.indexes[i], prepared.rows[i]) for i in pending_at
        )
    else:
        pending = tuple(
            AdmittedRow(key, index, row)
            for i, (key, index, row) in enumerate(
                zip(prepared.keys, prepared.indexes, prepared.rows))
            if i not in taken
        )
    return inserted, pending, tuple(completed), tuple(blocked), cached
