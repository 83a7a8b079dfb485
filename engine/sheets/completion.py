"""Completion: write map outcomes into a sheet, fenced by write version and attempt.

How it works
- Outcomes are validated and encoded before any query; duplicates collapse to the last one.
  Completed and failed outcomes are chunked separately by at most `COMPLETE_CHUNK_ROWS` rows and
  `COMPLETE_CHUNK_BYTES` of patch JSON; every chunk is one statement, and all of them run in one
  sheet write transaction with a statement timeout (`sheet_txn.run_sheet_transaction`).
- One statement per chunk reads the rows by exact key, decides each row's fence, applies the
  unfenced changes, and applies the exact counter deltas (`sheet_summary` by status transition,
  `sheet_column_summary` by cell-meta status transition) — a CTE over unnest of arrays:
    * `_write_version` newer than ours → fenced `stale_write_version`; older → `unadmitted`;
    * with an attempt, a row leased to another attempt → `attempt_superseded` (our own lease
      still counts as ours after it expired); without one, a row of a shared-map unit leased
      now (`engine.shared.leases`) → `attempt_superseded` too, and such a row missing by key
      is not inserted at its input index: only the unit's holder (whose attempt the rows
      carry) writes them. That fence reads the run's units in the same statement (one key
      probe), on a login that reads them (`unit_fence.reads_unit_leases`);
    * an outcome naming a field the row stores as an input (a value without cell meta: only
      completions write cell meta) → `input_field`, whatever contract the request sent (the
      request's contract alone could omit the input and call it an output);
    * a failed outcome for an `enriched` row → `already_completed`, unless `force_failed`: then
      it applies, and every output it marks becomes a failed cell (completed ones included);
    * otherwise applied: completed → `enriched`, the data keys present patched, cell meta of
      every output `{status: completed, run_id, completed_at}` (epoch seconds, server clock)
      merged with the outcome's own cell meta; failed → `failed`, `_error` and `_cause` set
      (the cause computed in Python, `PreparedOutcome.cause`; completed clears both), cells patched
      likewise, and cell meta of every output the row has not completed `{status: failed,
      run_id}` (completed cells are kept), so column counters count a failed row's cells as
      failed and add up with the table's. The lease ends (`_attempt_expires_at`
      cleared). A row already exactly so is not touched: an identical replay is committed
      without a physical change (a replay only differing in `completed_at` keeps the old one).
    * an applied outcome adds the calls it took (`RowOutcome.attempts`) to `_attempts`; a
      failed one counts its run once in `_failed_runs` (`_failed_epoch` remembers which run
      was counted, so a wake or a replay adds nothing), a completed one sets it back to 0.
      Since an identical replay changes nothing, it adds no attempts either.
- "Every output" means the contract's outputs plus every non-input field of this call's data
  (fields outside the contract get their columns first, see `layout`). On PostgreSQL >= 18
  the statement is one fenced UPDATE per chunk returning the old status and cell meta
  (`RETURNING old.*`); older servers read the rows first and update from that snapshot.
- An outcome whose data holds a field named like one of the contract's inputs is refused with
  `InvalidInputError` before any query (and one naming a field the stored row holds as an
  input is fenced `input_field` by the statement, above) (it would write over the input cell, and the row would
  then look completed for its original key); a map fails such a row alone instead
  (`input_fields_problem`).
- Keys that no row has are repaired afterwards (never in the exact-key statement, so the common
  path never scans by input index): an outcome whose `input_index` matches a row of our write
  version (whose key is not among this call's keys) is applied to that row through the same
  statement; a completed outcome left unmatched is inserted `enriched`; a failed one is fenced
  `missing`.
- `on_diagnostics(CompletionDiagnostics)` (a plain or async callable) is observational and
  never delays or changes the result: the diagnostics are queued for the tenant's background
  task (`engine.diagnostics`; bounded, oldest dropped) and `complete` returns at once; what the
  sink raises is logged. A port with no such queue running delivers inline. With no sink, one
  JSON line per completion is logged at DEBUG.
- A shared map's unit completion is `complete_write` with a `UnitGuard` (`sheet_txn`), never
  the action `sheets.complete` (whose parameters are its JSON body).
"""

from __future__ import annotations

import logging
import time
from itertools import chain
from operator import attrgetter
from typing import Callable, Iterable, Sequence, TypeVar

import attrs

from ..actions import action, routes_remote
from ..values.codecs import BOOL, RUN_REF, STR, list_of, optional
from ..diagnostics import DiagnosticsQueue, call_sink, log_diagnostics
from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import Port
from ..values.scopes import RunRef

from . import unit_fence
from .completion_parts import CompletionSheet, OutcomeChunk
from .completion_repair_sql import insert_statement, repair_targets_statement
from .completion_sql import exact_statement
from .outcome_inputs import PreparedOutcome, prepare_outcomes
from .layout import SheetLayout, layout_for
from .sheet_txn import SheetTxn, UnitGuard, run_sheet_transaction
from .write_group import group_for
from .telemetry import PhaseClock
from .model import (
    ATTEMPT, COMPLETION, CONTRACT, ROW_OUTCOME, Attempt, Completion, CompletionDiagnostics,
    FencedRow, RowOutcome, SheetContract,
)
from .field_names import shown
from .sheet_write import COMPLETE_ARGUMENTS, SheetWrite

log = logging.getLogger("runplane.sheets")

T = TypeVar("T")
DiagnosticsSink = Callable[[CompletionDiagnostics], object]  # a plain or async callable

COMPLETE_CHUNK_ROWS = 10_000
COMPLETE_CHUNK_BYTES = 2 * 1024 * 1024
COMPLETE_STATEMENT_TIMEOUT_MS = 60_000

# PostgreSQL 18 added `RETURNING old.*`: from then on the one-probe statement is used.
RETURNING_OLD_SINCE = 180000


def input_fields_problem(names: Sequence[str], inputs: Sequence[str]) -> str | None:
    """Why outputs with these names cannot be stored beside these contract inputs, or None:
    an output named like an input would write over the input cell."""
    clash = [name for name in names if name in inputs]
    if not clash:
        return None
    return f"{shown(clash[0])} is an input of the contract; an output cannot be named like an input"


def _check_no_input_fields(prepared: list[PreparedOutcome], outcomes: Sequence[RowOutcome],
                           inputs: tuple[str, ...]) -> None:
    """Refuse (before any query) an outcome whose data names a contract input, naming the
    outcome by its position (the last occurrence of its key: the one that would be written)."""
    if not inputs:
        return
    checked: set[tuple[str, ...]] = set()  # most outcomes share one set of names
    for outcome in prepared:
        if outcome.data_keys in checked:
            continue
        problem = input_fields_problem(outcome.data_keys, inputs)
        if problem is not None:
            position = max(i for i, given in enumerate(outcomes) if given.key == outcome.key)
            raise InvalidInputError(f"outcomes[{position}].data: {problem}")
        checked.add(outcome.data_keys)


def _json_array(texts: Sequence[str]) -> str:
    """JSON texts as the text of one JSON array."""
    return "[" + ",".join(texts) + "]"


def _nullable(values: Sequence[T]) -> list[T] | None:
    """An array bind, or None when every entry is None: a NULL array, which a multi-argument
    unnest pads with NULLs, costs nothing to encode and send."""
    return None if values.count(None) == len(values) else list(values)


def _attempts(attempts: Sequence[int]) -> list[int | None] | None:
    """The calls each outcome took, as an array bind: NULL (one call each) in the common case."""
    if attempts.count(1) == len(attempts):
        return None
    return [a if a != 1 else None for a in attempts]


_key = attrgetter("key")
_size = attrgetter("size")
_data_keys = attrgetter("data_keys")


def _names(chunk: list[PreparedOutcome], names: attrgetter) -> set[str]:
    """The field names of a chunk's outcomes, each distinct tuple of names visited once (most
    outcomes share one)."""
    return _distinct(map(names, chunk))


def _distinct(name_tuples: Iterable[tuple[str, ...]]) -> set[str]:
    """The names of these tuples of names, each distinct tuple visited once."""
    return set(chain.from_iterable(set(name_tuples)))


def _chunks(outcomes: list[PreparedOutcome]) -> list[list[PreparedOutcome]]:
    if len(outcomes) <= COMPLETE_CHUNK_ROWS and sum(map(_size, outcomes)) <= COMPLETE_CHUNK_BYTES:
        return [outcomes] if outcomes else []  # the common case: what the loop would give
    chunks: list[list[PreparedOutcome]] = []
    current: list[PreparedOutcome] = []
    size = 0
    for outcome in outcomes:
        if current and (
            len(current) >= COMPLETE_CHUNK_ROWS or size + outcome.size > COMPLETE_CHUNK_BYTES
        ):
            chunks.append(current)
            current, size = [], 0
        current.append(outcome)
        size += outcome.size
    if current:
        chunks.append(current)
    return chunks


@attrs.define(eq=False)
class _Tally:
    """Results of one transaction attempt (rebuilt from scratch if it is retried)."""

    updated: int = 0
    chunks: int = 0
    committed: set[str] = attrs.field(factory=set)
    fenced: dict[str, FencedRow] = attrs.field(factory=dict)


@attrs.define(eq=False)
class _Writer:
    port: Port
    layout: SheetLayout
    write: SheetWrite
    base_fields: list[str]
    clock: PhaseClock
    force_failed: bool = False
    units: bool = False  # fence rows of shared-map units leased now (a write without attempt)
    sheet: SheetTxn | None = None  # set by each transaction attempt

    @property
    def target(self) -> CompletionSheet:
        """Where this transaction attempt's statements write, and how."""
        assert self.sheet is not None
        return CompletionSheet(
            self.port, self.layout, self.write, self.sheet.columns, self.base_fields,
            concurrent=self.sheet.concurrent, units=self.units,
            returning_old=self.sheet.server_version >= RETURNING_OLD_SINCE)

    def _chunk(self, chunk: list[PreparedOutcome], *, indexes: bool = False) -> OutcomeChunk:
        """A chunk as its statement's arrays; the counted fields are those whose cell-meta
        status it may move."""
        (keys, _failed, input_indexes, data_texts, metas, errors, data_keys, meta_keys, _sizes,
         attempts, causes) = zip(*chunk)  # the chunk's columns, in one pass
        return OutcomeChunk(
            keys=list(keys),
            data_json=_json_array(data_texts),
            metas=_nullable(metas),
            errors=_nullable(errors),
            causes=_nullable(causes),
            attempts=_attempts(attempts),
            fields=sorted(_distinct(data_keys)),
            counted=sorted(_distinct(meta_keys).union(self.base_fields)),
            indexes=list(input_indexes) if indexes else None,
        )

    async def exact(
        self, conn: Connection, chunk: list[PreparedOutcome], keys: list[str], failed: bool,
        phase: str, tally: _Tally,
    ) -> list[PreparedOutcome]:
        """Apply one chunk by exact key (`keys[i]` is the row for `chunk[i]`); return misses."""
        statement = exact_statement(self.target, attrs.evolve(self._chunk(chunk), keys=keys),
                                    failed=failed, force_failed=failed and self.force_failed)
        record = await self.clock.measure(phase, conn.fetchrow(statement.sql, *statement.args))
        tally.chunks += 1
        tally.updated += record["updated"]
        missing = set(record["missing_ords"] or ())
        fenced_ords = record["fenced_ords"] or []
        for ord_, reason, version in zip(
            fenced_ords, record["fenced_reasons"] or [], record["fenced_versions"] or []
        ):
            key = chunk[ord_ - 1].key
            tally.fenced[key] = FencedRow(key, reason, version)
        if not missing and not fenced_ords:  # the common case: every row was written
            tally.committed.update(map(_key, chunk))
        else:
            fenced = set(fenced_ords)
            for ord_, outcome in enumerate(chunk, start=1):
                if ord_ not in missing and ord_ not in fenced:
                    tally.committed.add(outcome.key)
        return [chunk[ord_ - 1] for ord_ in sorted(missing)]

    async def repair(
        self, conn: Connection, misses: list[PreparedOutcome], all_keys: list[str], tally: _Tally
    ) -> None:
        indexed = [(i, o) for i, o in enumerate(misses) if o.input_index is not None]
        targets: dict[int, str] = {}
        if indexed:
            statement = repair_targets_statement(
                self.layout, [i for i, _ in indexed], [o.input_index for _, o in indexed],
                self.write.run.epoch, all_keys)
            rows = await self.clock.measure("insert_missing",
                                            conn.fetch(statement.sql, *statement.args))
            used: set[str] = set()
            for row in rows:
                if row["ord"] in targets or row["_key"] in used:
                    continue
                targets[row["ord"]] = row["_key"]
                used.add(row["_key"])
        unmatched: list[PreparedOutcome] = []
        target_of = {id(misses[i]): key for i, key in targets.items()}
        for failed in (False, True):
            group = [o for o in misses if o.failed == failed and id(o) in target_of]
            for chunk in _chunks(group):
                keys = [target_of[id(o)] for o in chunk]
                unmatched += await self.exact(conn, chunk, keys, failed, "insert_missing", tally)
        unmatched += [o for i, o in enumerate(misses) if i not in targets]
        to_insert = [o for o in unmatched if not o.failed]
        for o in unmatched:
            if o.failed:
                tally.fenced[o.key] = FencedRow(o.key, "missing", None)
        for chunk in _chunks(to_insert):
            statement = insert_statement(self.target, self._chunk(chunk, indexes=True))
            record = await self.clock.measure("insert_missing",
                                              conn.fetchrow(statement.sql, *statement.args))
            tally.chunks += 1
            inserted = set(record["inserted_keys"] or ())
            leased = set(record["leased_keys"] or ())
            tally.updated += len(inserted)
            for o in chunk:
                if o.key in inserted:
                    tally.committed.add(o.key)
                elif o.key in leased:  # its index is a row of a unit another holder leases
                    tally.fenced[o.key] = FencedRow(o.key, "attempt_superseded", None)
                else:  # a concurrent writer cannot interleave; kept for completeness
                    tally.fenced[o.key] = FencedRow(o.key, "missing", None)


@action("sheets.complete", params={
    "run": RUN_REF, "table_namespace": STR, "contract": CONTRACT,
    "outcomes": list_of(ROW_OUTCOME), "attempt": optional(ATTEMPT), "force_failed": BOOL,
}, result=COMPLETION, local=("on_diagnostics",), deadline_s=75.0)
async def complete(
    port: Port,
    run: RunRef,
    table_namespace: str,
    contract: SheetContract,
    outcomes: Sequence[RowOutcome],
    *,
    attempt: Attempt | None = None,
    on_diagnostics: DiagnosticsSink | None = None,
    force_failed: bool = False,
) -> Completion:
    """Write `outcomes` into the sheet under the run's write version (see module docstring).
    An outcome may also come prepared (a `PreparedOutcome` of `prepared_completed`, as the
    gateway decodes a plain completed one).

    `force_failed=True` lets a failed outcome replace an enriched row of our write version:
    its completed cells become failed cells."""
    started = time.perf_counter()
    write = SheetWrite(run, table_namespace, contract, attempt=attempt)
    return await _complete_here(port, write, outcomes, started=started,
                                on_diagnostics=on_diagnostics, force_failed=force_failed)


async def _send_complete(
    port: Port, write: SheetWrite, outcomes: Sequence[RowOutcome], *,
    on_diagnostics: DiagnosticsSink | None = None,
    guard: UnitGuard | None = None,
) -> Completion:
    """`complete_write` through a remote port: the action `sheets.complete`, its body made of
    the value and the outcomes. A unit guard runs inside the write's own transaction: it
    cannot travel."""
    if guard is not None:
        raise InvalidInputError("a unit guard runs in the completion's own transaction; "
                                "a remote port cannot take one")
    return await complete(port, outcomes=outcomes, on_diagnostics=on_diagnostics,
                          **write.arguments(*COMPLETE_ARGUMENTS))


@routes_remote(_send_complete)
async def complete_write(
    port: Port, write: SheetWrite, outcomes: Sequence[RowOutcome], *,
    on_diagnostics: DiagnosticsSink | None = None,
    guard: UnitGuard | None = None,
) -> Completion:
    """`complete` of a `SheetWrite` built (and checked) by the caller; `guard`: a shared map's
    unit completion, its settlement last inside the transaction (`UnitGuard`). Through a remote
    port the action layer sends `sheets.complete` instead (`_send_complete`)."""
    return await _complete_here(port, write, outcomes, started=time.perf_counter(),
                                on_diagnostics=on_diagnostics, force_failed=False, guard=guard)


async def _complete_here(
    port: Port, write: SheetWrite, outcomes: Sequence[RowOutcome], *, started: float,
    on_diagnostics: DiagnosticsSink | None, force_failed: bool,
    guard: UnitGuard | None = None,
) -> Completion:
    """Completion on this port: the per-call arguments checked, the outcomes prepared."""
    within, concurrent = (guard.within, guard.concurrent) if guard else (None, False)
    write.check_port(port)
    if not isinstance(force_failed, bool):
        raise InvalidInputError(f"force_failed must be True or False, got {force_failed!r}")
    run, contract = write.run, write.contract
    namespace = write.table_namespace
    prepared, input_rows = prepare_outcomes(outcomes)
    _check_no_input_fields(prepared, outcomes, contract.inputs)
    inputs = set(contract.inputs)
    data_fields = _names(prepared, _data_keys)
    base_fields = sorted(set(contract.outputs) | (data_fields - inputs))
    layout = layout_for(port, run.scope.play_scope, namespace)
    clock = PhaseClock()
    writer = _Writer(port, layout, write, base_fields, clock, force_failed,
                     units=write.attempt is None and unit_fence.reads_unit_leases(port))
    failed = [o for o in prepared if o.failed]
    completed = [o for o in prepared if not o.failed] if failed else prepared
    all_keys = list(map(_key, prepared))

    async def op(conn: Connection, sheet: SheetTxn) -> _Tally:
        writer.sheet = sheet
        tally = _Tally()
        misses: list[PreparedOutcome] = []
        for chunk in _chunks(completed):
            misses += await writer.exact(conn, chunk, list(map(_key, chunk)), False, "update",
                                         tally)
        for chunk in _chunks(failed):
            misses += await writer.exact(
                conn, chunk, [o.key for o in chunk], True, "failed_update", tally
            )
        if misses:
            await writer.repair(conn, misses, all_keys, tally)
        if within is not None:
            await within(conn, frozenset(tally.committed), dict(tally.fenced))
        return tally

    tally = _Tally()
    outcome = "failed"
    try:
        if prepared or within is not None:
            fields = list(dict.fromkeys([*contract.fields, *sorted(data_fields)]))
            group = group_for(port, layout.counter_args, write,
                              guarded=guard is not None or force_failed)
            tally = await run_sheet_transaction(
                port, layout, fields, op, timeout_ms=COMPLETE_STATEMENT_TIMEOUT_MS, clock=clock,
                concurrent=concurrent, group=group, keys=all_keys,
            )
        outcome = "succeeded"
    finally:
        diagnostics = _diagnostics(
            clock, outcome, input_rows, prepared, tally, time.perf_counter() - started
        )
        if on_diagnostics is None:
            log_diagnostics(diagnostics)
        else:
            queue = port.settings.diagnostics
            if isinstance(queue, DiagnosticsQueue) and queue.running:
                queue.put(on_diagnostics, diagnostics)
            else:
                await deliver_diagnostics(on_diagnostics, diagnostics)
    committed = tally.committed  # distinct keys of `all_keys`: all of them when as many
    return Completion(
        updated=tally.updated,
        committed_keys=tuple(all_keys) if len(committed) == len(all_keys)
        else tuple(k for k in all_keys if k in committed),
        fenced=tuple(tally.fenced[k] for k in all_keys if k in tally.fenced)
        if tally.fenced else (),
        diagnostics=diagnostics,
    )


def _diagnostics(clock: PhaseClock, outcome: str, input_rows: int,
                 prepared: list[PreparedOutcome], tally: _Tally,
                 total_s: float) -> CompletionDiagnostics:
    ms, failures = clock.ms, clock.failures
    values: dict[str, float] = {}
    for phase in ("permit_wait", "connect", "begin", "update", "insert_missing",
                  "failed_update", "commit"):
        values[f"{phase}_ms"] = round(ms.get(phase, 0.0), 3)
        values[f"{phase}_failures"] = failures.get(phase, 0)
    return CompletionDiagnostics(
        outcome=outcome,
        input_rows=input_rows,
        unique_rows=len(prepared),
        completed_rows=sum(1 for o in prepared if not o.failed),
        failed_rows=sum(1 for o in prepared if o.failed),
        chunks=tally.chunks,
        updated_rows=tally.updated,
        fenced_rows=len(tally.fenced),
        column_retries=clock.column_retries,
        total_ms=round(total_s * 1000.0, 3),
        **values,
    )


async def deliver_diagnostics(sink: DiagnosticsSink,
                              diagnostics: CompletionDiagnostics) -> None:
    """Hand diagnostics to the sink now; its failures are logged, never raised."""
    await call_sink(sink, diagnostics)
