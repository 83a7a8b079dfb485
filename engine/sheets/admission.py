"""Admission: put a page of input rows into a sheet under the run's write version.

How it works
- Rows are validated, normalized, keyed (`row_key`, or the explicit `keys`) and deduplicated in
  Python before any query (the first occurrence wins; later ones count as `skipped`).
- Chunks of at most `ADMIT_CHUNK_ROWS` rows go to one statement each, all in one sheet write
  transaction (`sheet_txn.run_sheet_transaction`). The statement (`admission_sql`) inserts the
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
      `blocked` (`attempt_active`); so is, in a plain admission (no unit guard) on a login
      that reads unit leases, a row of one of the run's shared-map units leased now, even
      once the row's own lease lapsed, and such a row missing is not inserted: only the
      unit's holder admits it (`unit_fence`);
    * with `give_up_after=N`, `failed` in N or more runs (`_failed_runs`, counted by
      completion) → `blocked` (`gave_up`); a larger N, or None, lets it run again;
    * otherwise → (re-)admitted to ours: status pending/running, our run, version, input index
      and lease, error cleared, stored input cells refreshed, earlier output cells and cell meta
      kept — except under `force`: then every cell meta entry turns `pending` for our run
      (`admission_sql.pending_cells`; the values stay stored but no reader shows them until
      they complete again, `reading.shown_cell`) and the column counters lose those cells in
      the same statement. Rows already exactly so are left untouched.
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
- What is written where, and how, is one `SheetWrite` (`sheet_write`), built and checked once:
  by `admit` from its arguments, or by the caller of `admit_write` (a map builds it once).
  The call's rows and where they sit are one `AdmitBatch`. A shared map's unit admission adds
  a `UnitGuard` (`sheet_txn`: its lease check runs last inside the transaction; it may make the
  transaction concurrent); it is no argument of the action `sheets.admit`, whose parameters are
  its JSON body. `admit_prepared` is admission after its checks; the write modes (`writes`)
  run it with a prelude in the same transaction.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable, Mapping, Sequence, TypeVar

import attrs

from .. import array_input, canonical
from ..actions import action, routes_remote
from ..values.codecs import BOOL, INT, RUN_REF, STR, USER_JSON, list_of, optional
from ..errors import ConflictError, CorruptFactError, DatabaseError, InvalidInputError
from ..pg import Connection, Record
from ..ports import Port
from ..values.scopes import RunRef

from . import unit_fence
from .admission_sql import PageRows, PayloadRows, admit_statement
from .inputs import PreparedRows, prepare_rows
from .layout import layout_for
from .sheet_txn import SheetTxn, UnitGuard, run_sheet_transaction
from .write_group import group_for
from .telemetry import PhaseClock
from .model import (
    Admission,
    AdmittedRow,
    Attempt,
    BlockedRow,
    CellPolicy,
    SheetContract,
    StagedPage,
    Timing,
    ADMISSION, ATTEMPT, CELL_POLICIES, CONTRACT, STAGED_PAGE,
)
from .previous_cells import PREVIOUS_CELLS_BUDGET_BYTES, previous_of, with_previous
from .sheet_write import ADMIT_ARGUMENTS, PREVIOUS_ARGUMENTS, SheetWrite

ADMIT_CHUNK_ROWS = 10_000
ADMIT_STATEMENT_TIMEOUT_MS = 120_000

# What a write mode runs first in the admission's transaction (`engine.sheets.writes`): it may
# change the sheet and returns how much to add to every row's input index.
Prelude = Callable[[Connection, SheetTxn], Awaitable[int]]


def _check_staged(run: RunRef, staged_page: object, rows: object) -> StagedPage:
    if not isinstance(staged_page, StagedPage):
        raise InvalidInputError("staged_page must be a StagedPage or None")
    scope = staged_page.scope
    if (scope.org_id, scope.play, scope.run_id) != (run.scope.org_id, run.scope.play, run.run_id):
        raise InvalidInputError("staged_page must be an array input of the admitting run")
    array_input.values.check_count(staged_page.ordinal, "staged_page.ordinal")
    if not isinstance(rows, Sequence) or not 1 <= len(rows) <= array_input.MAX_PAGE_ROWS:
        raise InvalidInputError(
            f"with staged_page, rows must be the page's 1 to {array_input.MAX_PAGE_ROWS} rows"
        )
    return staged_page


@attrs.frozen
class AdmitBatch:
    """The rows of one admission call and where they sit in the input: at `input_offset` +
    position, or at `input_indexes` (one per row); with the `keys` and canonical `texts` a
    caller computed already, or read from a sealed `staged_page` of the run (see `admit`)."""

    rows: Sequence[dict]
    input_offset: int = 0
    keys: Sequence[str] | None = None
    input_indexes: Sequence[int] | None = None
    staged_page: StagedPage | None = None
    texts: Sequence[str] | None = None
    expect_new: bool = False  # the caller expects every row new (`admit_statement`)
    # The rows as `prepare_rows` made them in this process (a map's page, keyed and encoded
    # ahead, its duplicates dropped and counted by the caller): admission on this port takes
    # them as they are instead of checking them again. Never sent: through a remote port the
    # rows, keys and texts go, and are checked there.
    prepared: PreparedRows | None = None

    def arguments(self) -> dict[str, object]:
        """The batch's part of the action `sheets.admit`'s keyword arguments
        (`input_indexes` and `expect_new` only when given: a body without them reads as
        before, and a gateway that does not list `expect_new` is sent none)."""
        given = {"rows": self.rows, "input_offset": self.input_offset, "keys": self.keys,
                 "staged_page": self.staged_page, "texts": self.texts}
        if self.input_indexes is not None:
            given["input_indexes"] = self.input_indexes
        if self.expect_new:
            given["expect_new"] = True
        return given


UNIQUE_VIOLATION = "23505"
T = TypeVar("T")


class _PageRefused(Exception):
    """The staged page fact was not the expected one; the transaction rolls back."""


@action("sheets.admit", params={
    "run": RUN_REF, "table_namespace": STR, "contract": CONTRACT, "rows": list_of(USER_JSON),
    "input_offset": INT, "keys": optional(list_of(STR)), "attempt": optional(ATTEMPT),
    "cell_policies": optional(CELL_POLICIES), "input_indexes": optional(list_of(INT)),
    "give_up_after": optional(INT), "cache_hits": STR, "staged_page": optional(STAGED_PAGE),
    "texts": optional(list_of(STR)), "force": BOOL, "previous_cells": BOOL,
    "previous_cells_budget_bytes": INT, "expect_new": BOOL,
}, result=ADMISSION)  # the server's 30 s; the client waits up to 10 minutes (retries)
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
    previous_cells: bool = False,
    previous_cells_budget_bytes: int = PREVIOUS_CELLS_BUDGET_BYTES,
    expect_new: bool = False,
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
    `previous_cells=True` gives every pending row `row["_previous"]`: a re-admitted row's
    completed output cells, within `previous_cells_budget_bytes` of cell text for the call
    (`engine.sheets.previous_cells`).
    `expect_new=True`: the caller expects every row new (a unit it sent ahead); the rows are
    inserted without `ON CONFLICT`, and the ordinary admission runs instead when one exists
    (`admit_prepared`) — a hint for speed, the outcome is the same either way.
    (Its parameters are the action's JSON body, field by field.)
    """
    started = time.perf_counter()
    write = SheetWrite(run, table_namespace, contract, attempt=attempt,
                       cell_policies=cell_policies, give_up_after=give_up_after,
                       cache_hits=cache_hits, force=force, previous_cells=previous_cells,
                       previous_cells_budget_bytes=previous_cells_budget_bytes)
    batch = AdmitBatch(rows, input_offset, keys, input_indexes, staged_page, texts, expect_new)
    return await _admit_here(port, write, batch, started=started)


async def _send_admit(port: Port, write: SheetWrite, batch: AdmitBatch, *,
                      guard: UnitGuard | None = None) -> Admission:
    """`admit_write` through a remote port: the action `sheets.admit`, its body made of the
    write and the batch. A unit guard runs inside the write's own transaction: it cannot
    travel."""
    if guard is not None:
        raise InvalidInputError("a unit guard runs in the admission's own transaction; "
                                "a remote port cannot take one")
    names = ADMIT_ARGUMENTS + (PREVIOUS_ARGUMENTS if write.previous_cells else ())
    return await admit(port, **batch.arguments(), **write.arguments(*names))


@routes_remote(_send_admit)
async def admit_write(port: Port, write: SheetWrite, batch: AdmitBatch, *,
                      guard: UnitGuard | None = None) -> Admission:
    """`admit` of a `SheetWrite` built (and checked) by the caller, for `batch`; `guard`: a
    shared map's unit admission, its lease check last inside the transaction (what it raises
    rolls the admission back), concurrent when it says so. Through a remote port the action
    layer sends `sheets.admit` instead (`_send_admit`)."""
    return await _admit_here(port, write, batch, started=time.perf_counter(), guard=guard)


async def _admit_here(port: Port, write: SheetWrite, batch: AdmitBatch, *, started: float,
                      guard: UnitGuard | None = None) -> Admission:
    """Admission on this port: the per-call arguments checked, the rows prepared."""
    write.check_port(port)
    rows, input_offset, input_indexes = batch.rows, batch.input_offset, batch.input_indexes
    staged_page = batch.staged_page
    if staged_page is not None:
        staged_page = _check_staged(write.run, staged_page, rows)
        if input_indexes is not None:
            raise InvalidInputError("staged_page and input_indexes cannot be combined")
    prepared = batch.prepared
    if prepared is None or staged_page is not None:
        prepared = prepare_rows(
            rows, write.table_namespace, input_offset=input_offset, keys=batch.keys,
            need_texts=bool(write.contract.inputs) and staged_page is None,
            input_indexes=input_indexes, texts=batch.texts,
        )
    page = None
    if staged_page is not None:
        page = _page_rows(prepared, staged_page, len(rows), input_offset)
    return await admit_prepared(port, write, prepared, started=started, page=page, guard=guard,
                                expect_new=batch.expect_new)


def _page_rows(prepared: PreparedRows, staged_page: StagedPage, page_size: int,
               offset: int) -> PageRows:
    """The page's rows zipped positionally: a key (None for a duplicate) and an input index per
    page row; the statement's ordinals are then page positions."""
    keys: list[str | None] = [None] * page_size
    for key, index in zip(prepared.keys, prepared.indexes):
        keys[index - offset] = key
    return PageRows(keys, [offset + position for position in range(page_size)], staged_page,
                    offset)


async def admit_prepared(
    port: Port, write: SheetWrite, prepared: PreparedRows, *, started: float,
    page: PageRows | None = None, prelude: Prelude | None = None,
    guard: UnitGuard | None = None, expect_new: bool = False,
) -> Admission:
    """Admission after its checks: `prepared` rows, validated and keyed. `prelude` (not with a
    staged page) runs first in the same transaction; what it returns shifts every input index;
    a `guard`'s hook runs last in it (see `admit_write`). `expect_new`: the rows are inserted
    without `ON CONFLICT` (`admit_statement`); when one was there after all, the transaction
    rolls back on its unique violation and runs again as an ordinary admission, so the
    outcome is the ordinary one either way."""
    units = guard is None and unit_fence.reads_unit_leases(port)  # a plain admission
    layout = layout_for(port, write.run.scope.play_scope, write.table_namespace)
    group = group_for(port, layout.counter_args, write,
                      guarded=guard is not None or prelude is not None)
    guard = guard or UnitGuard()
    clock = PhaseClock()
    clock.add("prepare", time.perf_counter() - started)
    n = len(prepared.keys)
    shift = 0

    async def op(conn: Connection, sheet: SheetTxn) -> list[tuple[int, Record]]:
        nonlocal shift
        budget = write.previous_cells_budget_bytes  # what this call's chunks may hand out
        if page is not None:
            statement = admit_statement(port, layout, write, sheet.columns, page,
                                        concurrent=sheet.concurrent, previous_budget=budget,
                                        units=units, expect_new=expect_new)
            record = await clock.measure("statement", conn.fetchrow(statement.sql,
                                                                    *statement.args))
            if not record["page_ok"]:
                raise _PageRefused
            return [(0, record)]
        indexes = prepared.indexes
        if prelude is not None:
            shift = await clock.measure("prelude", prelude(conn, sheet))
            indexes = [index + shift for index in indexes]
        results = []
        texts = prepared.texts
        for low in range(0, n, ADMIT_CHUNK_ROWS):
            high = min(low + ADMIT_CHUNK_ROWS, n)
            chunk = PayloadRows(prepared.keys[low:high], indexes[low:high],
                                "[" + ",".join(texts[low:high]) + "]" if texts is not None
                                else None)
            statement = admit_statement(port, layout, write, sheet.columns, chunk,
                                        concurrent=sheet.concurrent, previous_budget=budget,
                                        units=units, expect_new=expect_new)
            record = await clock.measure("statement", conn.fetchrow(statement.sql,
                                                                    *statement.args))
            if write.previous_cells:
                budget = max(0, budget - record["previous_bytes"])
            results.append((low, record))
        if guard.within is not None:
            await guard.within(conn, frozenset(), {})
        return results

    results = []
    if n or prelude is not None:
        def transaction(new_only: bool) -> Awaitable[list[tuple[int, Record]]]:
            nonlocal expect_new
            expect_new = new_only  # what `op` builds its statements with
            return run_sheet_transaction(
                port, layout, write.contract.fields, op,
                timeout_ms=ADMIT_STATEMENT_TIMEOUT_MS, clock=clock, concurrent=guard.concurrent,
                group=group, keys=prepared.keys,
            )

        try:
            results = await _new_rows_first(transaction, expect_new)
        except _PageRefused:
            assert page is not None
            await _explain_refused_page(port, page.page)
    if page is None:
        locate: Callable[[int, int], int] = lambda low, ord_: low + ord_ - 1
    else:
        position_of = {key: i for i, key in enumerate(prepared.keys)}
        locate = lambda _low, ord_: position_of[page.keys[ord_ - 1]]  # type: ignore[index]
    if shift:
        prepared = attrs.evolve(prepared, indexes=[index + shift for index in prepared.indexes])
    clock_total = time.perf_counter() - started
    clock.add("total", clock_total)
    timings = tuple(Timing(phase, ms, n) for phase, ms in clock.ms.items())
    return _admission(prepared, write, results, locate, timings)


async def _new_rows_first(transaction: Callable[[bool], Awaitable[T]], expect_new: bool) -> T:
    """`transaction(True)` when the rows are expected new, and `transaction(False)` (the
    ordinary admission) when one was there after all (its unique violation rolled the first
    back) or none was expected new."""
    if expect_new:
        try:
            return await transaction(True)
        except DatabaseError as exc:
            if exc.sqlstate != UNIQUE_VIOLATION:
                raise
    return await transaction(False)


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


def _admission(prepared: PreparedRows, write: SheetWrite, results: list[tuple[int, Record]],
               locate: Callable[[int, int], int], timings: tuple[Timing, ...]) -> Admission:
    """The `Admission` the chunks' result records (with the chunk's first row) say."""
    inserted = 0
    cached = 0
    completed: list[AdmittedRow] = []
    blocked: list[BlockedRow] = []
    taken: set[int] = set()
    pending_at: list[int] = []
    counting = write.cache_hits == "count"
    outputs = write.contract.outputs
    loads = canonical.loads
    previous: dict[int, dict] | None = {} if write.previous_cells else None
    for low, record in results:
        inserted += record["inserted"]
        if previous is not None:
            previous_of(record, low, locate, previous)
        for ord_, reason in zip(record["blocked_ords"] or [], record["blocked_reasons"] or []):
            i = locate(low, ord_)
            blocked.append(BlockedRow(prepared.keys[i], prepared.indexes[i], reason))
            taken.add(i)
        if counting:
            cached += record["cached"]
            if record["inserted"] == record["input_rows"]:  # all new: nothing was looked up
                pending_at.extend(range(low, low + record["input_rows"]))
            else:
                pending_at.extend(locate(low, ord_) for ord_ in record["pending_ords"] or [])
            continue
        ords = record["completed_ords"] or []
        # each output column comes back as one JSON array (one decode per chunk and column)
        columns = [loads(record[f"o{i}"]) or [] for i in range(len(outputs))]
        for j, ord_ in enumerate(ords):
            i = locate(low, ord_)
            row = dict(prepared.rows[i])
            for field, values in zip(outputs, columns):
                row[field] = values[j]
            completed.append(AdmittedRow(prepared.keys[i], prepared.indexes[i], row))
            taken.add(i)
        cached += len(ords)
    if not counting:
        pending_at = [i for i in range(len(prepared.keys)) if i not in taken]
    pending_at.sort()
    keys, indexes, rows = prepared.keys, prepared.indexes, prepared.rows
    if previous is not None:
        rows = {i: with_previous(rows[i], previous.get(i)) for i in pending_at}
    if previous is None and len(pending_at) == len(keys):  # every row pending, in order
        pending = tuple(map(AdmittedRow, keys, indexes, rows))
    else:
        pending = tuple(AdmittedRow(keys[i], indexes[i], rows[i]) for i in pending_at)
    return Admission(
        inserted=inserted, skipped=prepared.skipped, pending=pending, completed=tuple(completed),
        blocked=tuple(blocked), write_version=write.run.epoch, timings=timings, cached=cached,
    )
