"""What one map reads and what it changes: a frozen `MapPlan` and an owned `MapState`.

How it works
- `MapOptions` (`actors.map_options`) is what a caller asks of one map: `run.map`'s keywords,
  with their defaults, as one frozen value. The run builds the map's plan from it
  (`Run._plan`); the options are checked there, as the plan is built.
- `MapPlan` is everything the actors of one map read: where outcomes go (port, run ref,
  attempt, sheet), what runs (`fn`, `concurrency`), the row policies (`retry`,
  `row_timeout_s`, `rate_limit`, `give_up_after`; see `actors.policies`), `force` (recompute
  rows older runs enriched, see `engine.sheets.admit`), `previous_cells` (re-admitted rows
  carry their completed cells as `row["_previous"]`, `engine.sheets.previous_cells`) and the
  pipeline's
  tuning (`fast_admission=False` admits every page without probing it first, cache hits
  listed and rows sent: the reference the fast path is tested against; `max_waiting_rows`
  bounds the delay queue, see `actors.backoff`). It is a frozen
  value, validated when it is built (an invalid map cannot start: `InvalidInputError` naming
  the argument, before any query). Where and how it writes is its `write`, one
  `engine.sheets.sheet_write.SheetWrite` built (and so checked) with the plan and passed whole
  to the store calls the actors make — `admit`, `probe`, `complete` — which are retried
  through transient faults (`actors.retry`), each in a batch span when tracing is on
  (`engine.observability.tracing`: `runplane.admission`, `runplane.completion`).
- `MapState` is everything the map changes while it runs, owned by `map_rows` and changed only
  by its actors (all in one trio thread, so plain updates are atomic between checkpoints). Its
  methods are named after the actor that calls them:
  - admission: `note_reuse` — the keys of units with cache hits, which the map records as
    the rows its run reused (one statement at its end, `engine.sheets.record_reuse`);
    `take_admission` — counts the page and returns the rows to run, dropping later
    duplicates of rows still in flight (`inflight`: keys admitted and not yet written, bounded
    by the pipeline's channels);
  - workers: `open_batch` / `record` — each computed outcome enters the ledger as soon as it
    exists; `pacer` (the rate limit's bucket) and `retries` (the delay queue of rows in
    backoff, `actors.backoff`) are the map's own, changed only by its workers and releaser;
  - writer: `settle` — a written batch leaves the ledger and the in-flight set, and is counted;
    a batch fenced as `stale_write_version` means a newer run took the map's rows: the state
    is `superseded` from then on, and every actor stops handing rows to the function;
  - the map's `finally`: `take_unsettled` / `count_flushed` — what the ledger still holds was
    computed but never confirmed written; it is flushed, shielded, with a deadline.
This module does no I/O of its own; `MapPlan.admit`/`complete` call `engine.sheets`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Mapping, Sequence

import attrs
import trio

from runplane.engine.canonical import JsonObject
from runplane.engine.limits.bounds import is_int, is_number
from runplane.engine.observability import tracing
from runplane.engine.errors import InvalidInputError
from runplane.engine.ports import Port
from runplane.engine.values.scopes import RunRef
from runplane.engine.sheets import (
    Admission, AdmittedRow, Attempt, CellPolicy, Completion, OutcomeStatus, RowOutcome,
    SheetContract, SheetWrite, StagedPage,
)
from runplane.engine.sheets.admission import AdmitBatch, admit_write
from runplane.engine.sheets.completion import complete_write, input_fields_problem
from runplane.engine.sheets.inputs import PreparedRows, prepare_rows
from runplane.engine.sheets.outcome_inputs import outcome_fields_problem
from runplane.engine.sheets.model import MAX_SHEET_FIELDS
from runplane.engine.sheets.probing import probe_keyed
from runplane.engine.sheets.sheet_write import PREVIOUS_CELLS_BUDGET_BYTES, check_flag

from .backoff import MAX_WAITING_ROWS, RetryQueue
from .map_options import (
    BATCH_BYTES, BATCH_ROWS, FLUSH_DEADLINE_S, LINGER_S, PAGE_ROWS, TAIL_HOLD_S, TAIL_ROWS,
)
from .list_proof import ListProof
from .pacing import Pacer, open_pacer
from .policies import RateLimit, RowRetry
from .progress import CallGauge, MapProgress, MapResult, MapTally
from .retry import retry_transient
from .row_functions import FailFast, RowCaller, failure_cause


def _positive_int(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not is_int(value, 1):
        raise InvalidInputError(f"{attribute.name} must be a positive integer, got {value!r}")


def _seconds(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not is_number(value, 0):
        raise InvalidInputError(f"{attribute.name} must be a number of seconds >= 0, got {value!r}")


def _callable(_instance: object, _attribute: object, value: object) -> None:
    if not callable(value):
        raise InvalidInputError("fn must be an async function of one row")


def _optional(kind: type, name: str):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise InvalidInputError(f"{name} must be a {kind.__name__} or None, got {value!r}")

    return check


def _timeout(_instance: object, _attribute: object, value: object) -> None:
    if value is not None and not is_number(value, above=0, finite=True):
        raise InvalidInputError(f"row_timeout_s must be a number of seconds > 0, got {value!r}")


@attrs.frozen
class MapPlan:
    """How one map runs; read by every actor, never changed."""

    port: Port
    ref: RunRef
    attempt: Attempt | None
    table_namespace: str
    contract: SheetContract
    fn: RowCaller = attrs.field(validator=_callable)
    concurrency: int = attrs.field(default=16, validator=_positive_int)
    cell_policies: Mapping[str, CellPolicy] | None = None
    page_rows: int = attrs.field(default=PAGE_ROWS, validator=_positive_int)
    linger_s: float = attrs.field(default=LINGER_S, validator=_seconds)
    tail_hold_s: float = attrs.field(default=TAIL_HOLD_S, validator=_seconds)
    batch_rows: int = attrs.field(default=BATCH_ROWS, validator=_positive_int)
    batch_bytes: int = attrs.field(default=BATCH_BYTES, validator=_positive_int)
    flush_deadline_s: float = attrs.field(default=FLUSH_DEADLINE_S, validator=_seconds)
    retry: RowRetry | None = attrs.field(default=None, validator=_optional(RowRetry, "retry"))
    row_timeout_s: float | None = attrs.field(default=None, validator=_timeout)
    rate_limit: RateLimit | None = attrs.field(
        default=None, validator=_optional(RateLimit, "rate_limit"))
    give_up_after: int | None = None
    fast_admission: bool = attrs.field(default=True, validator=check_flag)
    max_waiting_rows: int = attrs.field(default=MAX_WAITING_ROWS, validator=_positive_int)
    force: bool = attrs.field(default=False, validator=check_flag)
    fail_fast_rows: int | None = attrs.field(default=None, validator=_optional(int, "fail_fast"))
    previous_cells: bool = attrs.field(default=False, validator=check_flag)
    previous_cells_budget_bytes: int = PREVIOUS_CELLS_BUDGET_BYTES
    # Rows inside a call of `fn` in this process now (the one mutable part: a counter).
    calls: CallGauge = attrs.field(factory=CallGauge, eq=False, repr=False)
    # Where and how the map writes: built (and so checked) once, with the plan.
    write: SheetWrite = attrs.field(init=False)

    @write.default
    def _write(self) -> SheetWrite:
        return SheetWrite(self.ref, self.table_namespace, self.contract, attempt=self.attempt,
                          cell_policies=self.cell_policies, give_up_after=self.give_up_after,
                          cache_hits="count", force=self.force,
                          previous_cells=self.previous_cells,
                          previous_cells_budget_bytes=self.previous_cells_budget_bytes)

    async def admit(self, rows: list[JsonObject], input_offset: int, *,
                    keys: list[str] | None = None, staged_page: StagedPage | None = None,
                    cache_hits: str = "count", texts: list[str] | None = None,
                    expect_new: bool = False) -> Admission:
        """Admit one page under the run's write version, cache hits counted (from its staged
        page fact when given; with the rows' canonical texts when a list source has them;
        `expect_new`: its rows are likely all new, see `engine.sheets.admit_prepared`;
        retried through transient faults)."""
        write = self.write if cache_hits == "count" else attrs.evolve(self.write,
                                                                       cache_hits=cache_hits)
        batch = AdmitBatch(rows, input_offset, keys, staged_page=staged_page, texts=texts,
                           expect_new=expect_new)
        return await self._admit(write, batch, len(rows))

    async def _admit(self, write: SheetWrite, batch: AdmitBatch, rows: int) -> Admission:
        """One admission call of `rows` rows (its span), retried through transient faults."""
        with tracing.batch(tracing.SpanName.ADMISSION, rows):
            return await retry_transient(lambda: admit_write(self.port, write, batch))

    def prepare_page(self, rows: list[JsonObject], input_offset: int) -> PreparedRows:
        """A streamed page validated, keyed, deduplicated and encoded ahead of its admission
        (`admit_prepared`): its keys are known before it is sent. Raises `InvalidInputError`
        for a bad row, as admission would, before anything of the page is written."""
        return prepare_rows(rows, self.write.table_namespace, input_offset=input_offset,
                            keys=None, need_texts=True, keep_rows=True)

    async def admit_prepared(self, prepared: PreparedRows, input_offset: int, *,
                             expect_new: bool = False) -> Admission:
        """`admit` of a page `prepare_page` made: the same admission (its rows at their input
        indexes, with their keys and texts), its duplicates counted as skipped as `admit`
        counts them."""
        batch = AdmitBatch(prepared.rows, input_offset, prepared.keys,
                           input_indexes=prepared.indexes, texts=prepared.texts,
                           expect_new=expect_new,
                           prepared=attrs.evolve(prepared, skipped=0))  # counted below
        admission = await self._admit(self.write, batch, len(prepared.rows) + prepared.skipped)
        return attrs.evolve(admission, skipped=admission.skipped + prepared.skipped)

    async def probe(self, rows: list[JsonObject], input_offset: int, *,
                    keys: list[str] | None = None) -> Admission | None:
        """The admission of a page whose every row is settled (a fresh cache hit or blocked),
        from its keys in one read-only statement; None when some row needs admitting."""
        settled, _keys = await self.probe_keyed(rows, input_offset, keys=keys)
        return settled

    async def probe_keyed(self, rows: list[JsonObject], input_offset: int, *,
                          keys: list[str] | None = None) -> tuple[Admission | None, list[str]]:
        """`probe`, and the keys of the probed rows (for the reuse the map records)."""
        with tracing.span(tracing.SpanName.ADMISSION, rows=len(rows), probe=True):
            return await retry_transient(lambda: probe_keyed(
                self.port, self.write, rows, input_offset=input_offset, keys=keys))

    def row_keys(self, rows: list[JsonObject]) -> list[str]:
        """The keys admission gives `rows` (a streamed page's, whose keys were not computed)."""
        return prepare_rows(rows, self.write.table_namespace, input_offset=0,
                            keys=None, need_texts=False, keep_rows=False).keys

    async def complete(self, outcomes: list[RowOutcome]) -> Completion:
        """Write outcomes, fenced by the run's write version (retried through transient faults)."""
        with tracing.batch(tracing.SpanName.COMPLETION, len(outcomes)):
            return await retry_transient(lambda: complete_write(self.port, self.write, outcomes))


@attrs.define(eq=False)
class MapState:
    """What one map changes while it runs; see the module docstring for who calls what."""

    tally: MapTally
    pacer: Pacer | None = None
    retries: RetryQueue | None = None
    superseded_by_epoch: int | None = None
    fail_fast: FailFast | None = None
    _inflight: set[str] = attrs.field(init=False, factory=set)
    # The rows admission will have gone through when it is over: a list source's length from
    # the start (admission is over once that many went through it, before its actor gets round
    # to ending); a stream's count once its admission ended (None until then).
    source_rows: int | None = attrs.field(init=False, default=None)
    _ledger: dict[int, list[RowOutcome]] = attrs.field(init=False, factory=dict)
    _next_ticket: int = attrs.field(init=False, default=0)
    _added_fields: set[str] = attrs.field(init=False, factory=set)  # outputs beyond the contract
    _storable_names: set[tuple[str, ...]] = attrs.field(init=False, factory=set)
    reused_keys: list[str] = attrs.field(init=False, factory=list)  # see `note_reuse`
    # The keys of every row admitted to run, kept for a list the map may record
    # (`actors.list_replay`); None: not kept.
    admitted_keys: list[str] | None = attrs.field(init=False, default=None)
    # For such a list, its proof that every row ends a cache hit (`actors.list_proof`).
    list_proof: ListProof | None = attrs.field(init=False, default=None)

    @classmethod
    def observed_by(cls, on_progress: Callable[[MapProgress], object] | None) -> MapState:
        return cls(MapTally(on_progress))

    @classmethod
    def for_plan(cls, plan: MapPlan,
                 on_progress: Callable[[MapProgress], object] | None) -> MapState:
        retries = RetryQueue(plan.max_waiting_rows) if plan.retry is not None else None
        watch = FailFast(plan.fail_fast_rows) if plan.fail_fast_rows is not None else None
        return cls(MapTally(on_progress, retries=retries, gauge=plan.calls),
                   pacer=open_pacer(plan.port, plan.rate_limit), retries=retries,
                   fail_fast=watch)

    @property
    def superseded(self) -> bool:
        return self.superseded_by_epoch is not None

    @property
    def stopping(self) -> bool:
        """No more rows go to the function: a newer run took them, or the map stopped early."""
        return self.superseded_by_epoch is not None or self.tally.stopped_early

    def storable(self, contract: SheetContract, outcome: RowOutcome) -> RowOutcome:
        """`outcome`, or a failed one saying why its outputs cannot be stored (bad output names,
        an output named like a contract input, which would write over the input cell, or more
        fields than a sheet holds once this map's additions are counted):
        such a row fails alone and the rest of its batch is written. Most rows share one set of
        output names: a set already accepted costs one lookup."""
        if not outcome.data:  # a failed one may carry outputs too (`actors.RowError`)
            return outcome
        names = tuple(outcome.data)
        if names in self._storable_names:
            return outcome
        problem = outcome_fields_problem(names) or input_fields_problem(names, contract.inputs)
        if problem is None:
            known = set(contract.fields) | self._added_fields
            new = [n for n in names if n not in known]
            total = len(known) + len(new)
            if total > MAX_SHEET_FIELDS:
                problem = (f"{len(new)} new output fields would make {total}; a sheet holds "
                           f"at most {MAX_SHEET_FIELDS}")
            else:
                self._added_fields.update(new)
                self._storable_names.add(names)
                return outcome
        error = f"outputs cannot be stored: {problem}"
        if outcome.status == OutcomeStatus.FAILED:
            error = f"{outcome.error} ({error})"
        return RowOutcome(outcome.key, OutcomeStatus.FAILED, input_index=outcome.input_index,
                          error=error, attempts=outcome.attempts)

    def writing(self) -> ContextManager[object]:
        """Around the map's own sheet writes (its sheet ensured, pages admitted, outcomes
        completed): noted in its list proof, when it keeps one (`actors.list_proof`)."""
        return contextlib.nullcontext() if self.list_proof is None else self.list_proof.writing()

    # -- admission ---------------------------------------------------------------------------
    def note_reuse(self, keys: list[str]) -> None:
        """Admission: the keys of a unit in which cache hits were found (a superset of the rows
        reused; `engine.sheets.reuse` says why that is exact), recorded once the map ends."""
        self.reused_keys.extend(keys)

    def take_admission(self, rows_in_page: int, admission: Admission) -> list[AdmittedRow]:
        """Count one admitted page; return its pending rows that are not already in flight.

        A later duplicate of a row still in flight in this map is dropped (counted as skipped):
        the first occurrence's outcome completes the row.
        """
        pending = [row for row in admission.pending if row.key not in self._inflight]
        if self.fail_fast is not None and (admission.cached or admission.completed):
            self.fail_fast.disarm()  # the function worked on this sheet: failures may be the data's
        self._inflight.update(row.key for row in pending)
        if self.admitted_keys is not None:
            self.admitted_keys.extend(row.key for row in admission.pending)
        self.tally.on_admission(rows_in_page, admission,
                                dropped=len(admission.pending) - len(pending))
        return pending

    async def hand_out(self, rows: int) -> None:
        """Admission is about to send `rows` rows to the workers (waits while too many rows
        wait out a backoff)."""
        if self.retries is not None:
            await self.retries.wait_for_room()
            self.retries.hand_out(rows)

    def end_admission(self) -> None:
        self.source_rows = self.tally.source_rows
        if self.retries is not None:
            self.retries.end_admission()

    def tail_fits(self, rows: int) -> bool:
        """Admission is over (every row of the source went through it: `source_rows`) and at
        most `rows` rows of the map are still to be settled (being computed, waiting for a
        retry, or written but not yet confirmed): what is left of the map fits one completion
        of that size (`actors.completer.batch_outcomes`)."""
        return self.source_rows is not None and self.tally.source_rows >= self.source_rows \
            and len(self._inflight) <= rows

    # -- workers -----------------------------------------------------------------------------
    def open_batch(self) -> tuple[int, list[RowOutcome]]:
        """A ticket and the ledger's list for one worker batch's outcomes."""
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        outcomes: list[RowOutcome] = []
        self._ledger[ticket] = outcomes
        return ticket, outcomes

    def record(self, outcomes: list[RowOutcome], outcome: RowOutcome) -> None:
        """One row was executed: its outcome is in the ledger from now on."""
        outcomes.append(outcome)
        self.tally.executed += 1

    def close_empty_batch(self, ticket: int) -> None:
        """A worker batch that produced no outcome (its rows were deferred or left)."""
        self._ledger.pop(ticket, None)

    def calls_so_far(self, key: str) -> int:
        """Calls the row already had in this map (it is back from a backoff), else 0."""
        return self.retries.calls_so_far(key) if self.retries is not None else 0

    def count_call(self, calls: int) -> None:
        self.tally.calls += 1
        if calls > 1:
            self.tally.retried += 1

    def defer(self, row: AdmittedRow, calls: int, delay_s: float) -> None:
        """The row's call failed and will be retried after `delay_s`, by whichever worker is
        free then."""
        assert self.retries is not None
        self.retries.defer(row, calls, trio.current_time() + delay_s)

    def observe(self, outcome: RowOutcome, error: BaseException | None) -> None:
        """A row's final outcome, for the fail-fast watch: the map stops early when its first
        rows all failed for one cause from the function."""
        if self.fail_fast is None or not self.fail_fast.armed or self.stopping:
            return  # disarmed after the first row that completed: the common case, per row
        cause = failure_cause(outcome.status, error, outcome.error)
        if self.fail_fast.observe(cause, outcome.error):
            self.stop_early(self.fail_fast.reason())

    def stop_early(self, reason: str) -> None:
        """The map stopped before its rows were done (its run was cancelled)."""
        self.tally.stopped_early = True
        self.tally.stop_reason = reason
        if self.retries is not None:
            self.retries.stop()
        self.tally.report()

    def resolve(self) -> None:
        """A worker is done with a row (outcome recorded, deferred, or left)."""
        if self.retries is not None:
            self.retries.resolve()

    # -- the writer --------------------------------------------------------------------------
    def settle(self, tickets: Sequence[int], outcomes: list[RowOutcome],
               completion: Completion) -> None:
        """A completion that contains these tickets' outcomes returned."""
        self.tally.on_completion(outcomes, completion)
        if self.list_proof is not None:
            self.list_proof.check(outcomes)
        for ticket in tickets:
            self._ledger.pop(ticket, None)
        self._inflight.difference_update(outcome.key for outcome in outcomes)
        if not self.superseded:
            newer = [row.row_write_version for row in completion.fenced
                     if row.reason == "stale_write_version" and row.row_write_version is not None]
            if newer:
                self.supersede(max(newer))

    def supersede(self, newer_epoch: int) -> None:
        """A newer run took this map's rows: stop handing rows to the function."""
        self.superseded_by_epoch = newer_epoch
        self.tally.superseded = True
        if self.retries is not None:
            self.retries.stop()
        self.tally.report()

    # -- the flush on the way out --------------------------------------------------------------
    def take_unsettled(self) -> list[RowOutcome]:
        """Every outcome computed but not confirmed written; the ledger is empty afterwards."""
        outcomes = [outcome for batch in self._ledger.values() for outcome in batch]
        self._ledger.clear()
        return outcomes

    def count_flushed(self, outcomes: list[RowOutcome], completion: Completion) -> None:
        self.tally.on_completion(outcomes, completion)
        if self.list_proof is not None:
            self.list_proof.check(outcomes)

    # -- the result --------------------------------------------------------------------------
    def report(self) -> None:
        self.tally.report()

    def result(self, map_invocation_id: str | None, superseded_by: str | None = None) -> MapResult:
        return self.tally.result(map_invocation_id, superseded_by)
