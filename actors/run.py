"""The run: a registered epoch, a nursery of actors, and the retirement guard at its end.

How it works
- `open_run(tenant, play, run_id=None)` registers the run (`engine.runs.register`: a new run gets
  a fresh, larger epoch; reopening an existing run id — a wake — gets the same epoch back),
  records its terminal-outbox entry as `open`, and hosts the caller's body inside a nursery.
  Everything the run starts (map pipelines, sealers, `run.start` tasks) lives in that nursery or
  in nurseries nested in it, so nothing outlives the `async with` block. The body's own
  exception comes out unchanged (see `actors.hosting`).
- Receipts (`run.claim`, `run.complete`, `run.fail`, `run.skip`) and sheet writes made through
  the run are bound to its `RunRef`, so every write is fenced by the run's epoch.
- A list map's record for reruns (`actors.list_replay`) goes into a second, closing nursery
  around the run's: it goes on while the run retires, and the exit waits for both.
- The retirement guard runs after the run's nursery closed. When the body ended terminally
  (returned, or raised an ordinary exception) and `retire_on_exit` is set, it flips the
  outbox entry to `pending` under its own lease (one shielded statement), retires the run's
  array inputs batch by batch on the `retirement` lane, and marks the entry `done`. If the guard is cancelled or the store fails
  meanwhile, the entry stays `pending` for a supervisor (a cancelled guard gives its lease up,
  shielded, first). A cancelled or crashed run never reaches the guard: its entry stays `open`,
  because a wake must replay its staged input (see `engine.runs.outbox` for the state machine).
  Retirement failures are logged, never raised: they must not turn a finished body into a failed
  one, and the outbox keeps the work. With `retire_on_exit=False` the entry stays `open` too:
  the caller keeps the staged input (for a later incarnation that ends terminally, or for a
  supervisor configured with `abandon_after_s`).
- Outages: the run's store calls ride out a store outage for the tenant's `outage_budget_s`
  (`actors.retry`; the run's `OutageWatch` is `run.outage`). A run that ends because the store
  stayed away longer (`StoreOutageError`) ends like a crash, not terminally: its entry stays
  `open` and its staged input kept, so a wake finishes it (the guard could not run anyway).
- Bad arguments (an empty play or run id, an attempt that is not an `engine.sheets.Attempt`)
  raise before any query.
- Cancellation (`actors.cancellation`): a system task polls the run's cancellation stamp; a
  cancelled run's maps stop early (`stop_reason` "cancelled") and return, and the body goes on
  to its end — a run cancelled this way ends terminally and is retired (`Run.cancelled` says
  so). "A cancelled run" above means cancelled as a task (Ctrl-C), which is not terminal.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import AsyncIterator, Awaitable, Callable, Sequence

import attrs
import trio

from runplane.engine import array_input, receipts, runs
from runplane.engine.array_input import Occurrence
from runplane.engine.canonical import JsonObject, JsonValue
from runplane.engine.errors import (InvalidInputError, StoreOutageError, StoreUnavailableError,
                                     leaf_errors)
from runplane.engine.observability import context as where, tracing
from runplane.engine.opening import outage_budget
from runplane.engine.ports import Port
from runplane.engine.receipts import Claim, Receipt
from runplane.engine.values.scopes import RunRef, RunScope, normalize_namespace
from runplane.engine.sheets import Attempt, SheetContract

from runplane.engine.runs.history import MapRunState

from . import retirement
from .cancellation import RunStop, watching_for_cancel
from .hosting import is_terminal, open_hosting_nursery
from .map_options import SHARED_ONLY, MapOptions
from .map_state import MapPlan
from .mapper import MapSource, map_rows
from .history import MapRecorder, now as history_now
from .progress import CallGauge, MapProgress, MapResult
from .row_functions import RowFunction, as_row_caller, fail_fast_rows
from .retry import OutageWatch, install_watch, reset_watch, retry_transient
from .row_calls import report_calls
from .shared.config import map_spec
from .sealer import StagedArray, stage_array

log = logging.getLogger("runplane.actors")



@attrs.define(eq=False)
class Run:
    """One execution of a play. Build it with `open_run`; valid inside that block only."""

    port: Port
    ref: RunRef
    attempt: Attempt | None = None
    outage: OutageWatch = attrs.field(factory=lambda: OutageWatch(outage_budget()))
    force: bool = False  # the default of `map(force=...)`: set by `open_run(force=True)`
    _nursery: trio.Nursery | None = attrs.field(default=None, repr=False)
    # work the run's exit waits for alongside its retirement (a list recorded for reruns)
    _closing: trio.Nursery | None = attrs.field(default=None, repr=False)
    _map_ordinals: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)
    # (table namespace, result) of each map that stopped early, for the command line
    stopped_early_maps: list[tuple[str, MapResult]] = attrs.field(init=False, factory=list,
                                                                   repr=False)
    _stream_ordinals: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)
    _observer: Callable[[str, MapProgress], object] | None = attrs.field(default=None, repr=False)
    # the run's cancellation (`actors.cancellation`): its maps stop when it is cancelled
    stop: RunStop = attrs.field(init=False, factory=RunStop, repr=False)

    @property
    def scope(self) -> RunScope:
        return self.ref.scope

    @property
    def cancelled(self) -> bool:
        """The run was cancelled (`runplane cancel`, the console, `runs.cancel`): its maps
        stopped early with `stop_reason` "cancelled" and the run ends retired."""
        return self.stop.cancelled

    @property
    def epoch(self) -> int:
        return self.ref.epoch

    @property
    def run_id(self) -> str:
        return self.ref.run_id

    @property
    def play(self) -> str:
        return self.ref.scope.play

    # -- tasks ---------------------------------------------------------------------------------
    async def start(self, fn: Callable[..., Awaitable[object]], *args: object,
                    name: str | None = None) -> object:
        """Start an actor in the run's nursery (`fn(*args, task_status=...)`)."""
        return await self._live_nursery().start(fn, *args, name=name)

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object,
                   name: str | None = None) -> None:
        """Start a background task in the run's nursery; the run waits for it before ending."""
        self._live_nursery().start_soon(fn, *args, name=name)

    def _live_nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("the run is closed")
        return self._nursery

    def _closing_nursery(self) -> trio.Nursery:
        if self._closing is None:
            raise RuntimeError("the run is closed")
        return self._closing

    def observe_progress(self, observer: Callable[[str, MapProgress], object] | None) -> None:
        """Also hand every map's progress snapshots to `observer(table_namespace, snapshot)`
        (the command line's progress display); None stops it."""
        self._observer = observer

    def _recorder(self, plan: MapPlan, listed: bool, map_invocation_id: str | None) -> MapRecorder:
        """The map's run-history entry, keyed by its table and its map invocation id (or
        `stream-N`: ids count per table, so the table keeps two tables' first maps apart), with
        what a retry of its table runs (`actors.shared.config.map_spec`)."""
        namespace = normalize_namespace(plan.table_namespace)
        if map_invocation_id is None:
            ordinal = self._stream_ordinals.get(namespace, 0)
            self._stream_ordinals[namespace] = ordinal + 1
            map_invocation_id = f"stream-{ordinal}"
        return MapRecorder(self.port, self.scope, f"{namespace}/{map_invocation_id}", namespace,
                           spec=map_spec(plan, map_invocation_id), stop=self.stop)

    # -- work receipts -------------------------------------------------------------------------
    async def claim(self, key: str, *, reclaim_running: bool = False,
                    lease_s: float = receipts.DEFAULT_LEASE_S) -> Claim:
        return await receipts.claim(self.port, self.ref, key, reclaim_running=reclaim_running,
                                    lease_s=lease_s)

    async def complete(self, key: str, output: JsonValue) -> Receipt:
        return await receipts.complete(self.port, self.ref, key, output)

    async def fail(self, key: str, error: str) -> Receipt:
        return await receipts.fail(self.port, self.ref, key, error)

    async def skip(self, key: str, output: JsonValue = None) -> Receipt:
        return await receipts.skip(self.port, self.ref, key, output)

    # -- maps and array inputs -----------------------------------------------------------------
    def next_map_invocation_id(self, table_namespace: str) -> str:
        """A deterministic id for the next list-source map of a namespace in this run.

        Counted per normalized namespace: two spellings that normalize alike are one sheet, so
        their maps must get distinct ids. A wake that repeats the body's maps in the same order
        gets the same ids, so it finds the array inputs the crashed incarnation staged.
        """
        namespace = normalize_namespace(table_namespace)
        ordinal = self._map_ordinals.get(namespace, 0)
        self._map_ordinals[namespace] = ordinal + 1
        return f"map-{ordinal}"

    async def map(self, table_namespace: str, source: MapSource, fn: RowFunction, *,
                  contract: SheetContract, options: MapOptions | None = None,
                  **options_kw: object) -> MapResult:
        """Map `fn` over `source` into the sheet `table_namespace`; see `actors.mapper`.

        How it runs is a `MapOptions` (`options`), each of whose fields may also be given as a
        keyword (a keyword wins over the same field of `options`; an unknown one raises
        `TypeError`). Row policies (`actors.policies`): `retry` retries a failed call in place
        after a backoff; `row_timeout_s` cancels a call running longer (a failed attempt);
        `rate_limit` bounds how fast calls start; `give_up_after=N` leaves out rows that
        failed in N runs (blocked, reason `gave_up`). `force=True` recomputes the rows earlier
        runs enriched (the rows this run enriched already stay, so a wake resumes); None takes
        the run's default (`open_run(..., force=...)`).
        `fn` may be a plain function: each call then runs in a worker thread, at most
        `concurrency` at once (`actors.row_functions`). `fail_fast` (default on, the first 20
        rows; a number sets how many) stops the map early when those rows all failed for one
        cause from the function: `MapResult.stopped_early`, the run's `stopped_early_maps`.
        `page_rows`, `linger_s`, `tail_hold_s`, `batch_rows`, `batch_bytes`,
        `flush_deadline_s`, `fast_admission` and `max_waiting_rows` tune the pipeline
        (`actors.map_state.MapPlan`).
        `workers=N` spreads the map over N local worker processes, `shared=True` publishes
        it for workers started elsewhere (`runplane worker`; `lease_s` and `unit_rows` tune
        it); see `actors.shared.coordinator`.
        `executor="processes"` (or an `actors.executors` executor) runs a synchronous `fn`
        in a process pool or on a Dask cluster.
        `previous_cells=True` hands each re-admitted row the output cells it completed before,
        as `row["_previous"]` (`{}` for a new row; `{"_truncated": True}` past
        `previous_cells_budget_bytes` of cell text per admission, default 1 MiB); a function
        raising `actors.RowError(message, outputs={...})` stores those outputs and fails the
        rest. It runs the map in this process (not with workers=N or shared=True).
        """
        options = MapOptions.from_call(options, options_kw)
        workers = options.workers
        if options.previous_cells and (workers is not None or options.shared):
            raise InvalidInputError("previous_cells is not available for a map spread over "
                                    "workers (workers=N or shared=True) yet")
        if workers is None and not options.shared and not options.previous_cells and isinstance(
                source, (list, array_input.PagedRows)):
            from .shared.coordinator import default_workers

            workers = default_workers.get()
        spread = workers is not None or options.shared
        if options.executor is not None:
            from .executors import executor_for

            fn = executor_for(options.executor).bind(fn)
        if not spread and (given := sorted(SHARED_ONLY & options_kw.keys())):
            raise TypeError(f"Run.map() got an unexpected keyword argument {given[0]!r} (a "
                            "shared map's: it needs workers=N or shared=True)")
        plan = self._plan(table_namespace, contract, fn, options)
        with where.bound(map=normalize_namespace(table_namespace)), tracing.mapped(table_namespace):
            if spread:
                result = await self._map_shared(source, plan, options, workers)
            else:
                result = await self._map_here(source, plan, table_namespace, options.on_progress,
                                              options.map_invocation_id)
            log.info("map ended: %d completed, %d failed, %d cached", result.completed,
                     result.failed, result.cached)
            return result

    def _plan(self, table_namespace: str, contract: SheetContract, fn: RowFunction,
              options: MapOptions) -> MapPlan:
        """The plan of one map of this run (validated as it is built: `InvalidInputError`)."""
        o = options
        return MapPlan(
            self.port, self.ref, self.attempt, table_namespace, contract,
            as_row_caller(fn, o.concurrency), o.concurrency, o.cell_policies,
            page_rows=o.page_rows, linger_s=o.linger_s, tail_hold_s=o.tail_hold_s,
            batch_rows=o.batch_rows, batch_bytes=o.batch_bytes,
            flush_deadline_s=o.flush_deadline_s, retry=o.retry,
            row_timeout_s=o.row_timeout_s, rate_limit=o.rate_limit,
            give_up_after=o.give_up_after, fast_admission=o.fast_admission,
            max_waiting_rows=o.max_waiting_rows, force=self.force if o.force is None else o.force,
            fail_fast_rows=fail_fast_rows(o.fail_fast), previous_cells=o.previous_cells,
            previous_cells_budget_bytes=o.previous_cells_budget_bytes)

    async def _map_shared(self, source: MapSource, plan: MapPlan, options: MapOptions,
                          workers: int | None) -> MapResult:
        """A map run by workers (`actors.shared.coordinator`): the request checked before the
        run's next map id is taken for it; recorded in the run history like a map run here
        (its workers report their own rows in a call)."""
        from .shared.coordinator import SharedOptions, check_request, map_shared

        shared = SharedOptions(workers, options.shared, options.executor,
                               lease_s=options.lease_s, unit_rows=options.unit_rows)
        check_request(source, plan, shared)
        map_invocation_id = options.map_invocation_id
        if map_invocation_id is None:  # taken once the request passed its checks
            map_invocation_id = self.next_map_invocation_id(plan.table_namespace)
        recorder = self._recorder(plan, True, map_invocation_id)
        return await self._recorded(recorder, options.on_progress, lambda observe: map_shared(
            source, plan, map_invocation_id, shared, stop=self.stop, on_progress=observe))

    async def _map_here(self, source: MapSource, plan: MapPlan, table_namespace: str,
                        on_progress: Callable[[MapProgress], object] | None,
                        map_invocation_id: str | None) -> MapResult:
        """A map in this process (`actors.mapper.map_rows`), its source checked before its
        history entry is written; its rows in a call are reported with the heartbeat."""
        listed = isinstance(source, (list, tuple, array_input.PagedRows))
        if not listed and not hasattr(source, "__aiter__"):  # refused before the history write
            raise InvalidInputError(
                f"source must be a list of rows or an async iterable, got {type(source).__name__}")
        if listed and map_invocation_id is None:
            map_invocation_id = self.next_map_invocation_id(table_namespace)
        recorder = self._recorder(plan, listed, map_invocation_id)
        return await self._recorded(
            recorder, on_progress, lambda observe: map_rows(
                source, plan, on_progress=observe, map_invocation_id=map_invocation_id,
                background=self._closing_nursery(), stop=self.stop),
            calls=plan.calls)

    async def _recorded(self, recorder: MapRecorder,
                        on_progress: Callable[[MapProgress], object] | None,
                        run_map: Callable[[Callable[[MapProgress], None]], Awaitable[MapResult]],
                        calls: CallGauge | None = None) -> MapResult:
        """`run_map(observe)` with its history entry heartbeated while it runs (and, given
        `calls`, its rows in a call reported) and finished as it ended: failed, interrupted,
        or with its result, that last one in the run's nursery after the map returned (a store
        outage leaves the entry running, like a crash, for the wake)."""
        observers = [recorder.observe,
                     *self._progress_observers(recorder.table_namespace, on_progress)]

        def observe(snapshot: MapProgress) -> None:
            for f in observers:
                f(snapshot)

        beat = trio.CancelScope()

        async def heartbeat() -> None:  # history, and the rows in a call ("running")
            with beat:
                async with trio.open_nursery() as beats:
                    beats.start_soon(recorder.heartbeat)
                    if calls is not None:
                        beats.start_soon(functools.partial(
                            report_calls, self.port, self.scope, recorder.map_key,
                            recorder.table_namespace, calls))

        self._live_nursery().start_soon(heartbeat)
        try:
            result = await run_map(observe)
        except Exception as exc:
            recorder.ending(beat)
            if not any(isinstance(leaf, StoreUnavailableError) for leaf in leaf_errors(exc)):
                await recorder.finish(None, MapRunState.FAILED)
            # else the store is away: the entry stays `running`, like a crash, for the wake (a
            # write now would wait for a database that is not there)
            raise
        except BaseException:  # cancelled (Ctrl-C, SIGTERM): its history is what it flushed
            recorder.ending(beat)
            await recorder.interrupted()
            raise
        finally:
            recorder.ending(beat)
        # The last entry is written in the run's nursery: the caller does not wait for a record
        # (the run's exit does; a late heartbeat never replaces it, `engine.runs.history`).
        self._live_nursery().start_soon(recorder.finish, result, None, history_now(),
                                        name="map_history")
        if result.stopped_early:
            self.stopped_early_maps.append((recorder.table_namespace, result))
        return result

    def _progress_observers(self, namespace: str,
                            on_progress: Callable[[MapProgress], object] | None,
                            ) -> list[Callable[[MapProgress], object]]:
        """Who sees a map's progress besides its history: the run's observer (the command
        line's bars) and the caller's `on_progress`."""
        observers: list[Callable[[MapProgress], object]] = []
        if self._observer is not None:
            observer = self._observer
            observers.append(lambda snapshot: observer(namespace, snapshot))
        if on_progress is not None:
            observers.append(on_progress)
        return observers

    async def stage_array(self, table_namespace: str, map_invocation_id: str,
                          occurrences: Sequence[Occurrence | JsonObject]) -> StagedArray:
        """Stage (or, on a wake, resume or replay) an array input; see `actors.sealer`."""
        return await stage_array(self.port, self.scope.map(table_namespace, map_invocation_id),
                                 occurrences)


@contextlib.asynccontextmanager
async def open_run(
    tenant: Port,
    play: str,
    run_id: str | None = None,
    *,
    attempt: Attempt | None = None,
    retire_on_exit: bool = True,
    lease_s: float = retirement.DEFAULT_LEASE_S,
    force: bool = False,
) -> AsyncIterator[Run]:
    """Register (or wake) a run and host the body in its nursery; retire it if it ends terminally.
    `force=True` makes every `run.map` of the body recompute rows earlier runs enriched."""
    if not isinstance(force, bool):
        raise InvalidInputError(f"force must be True or False, got {force!r}")
    if attempt is not None and not isinstance(attempt, Attempt):
        raise InvalidInputError(f"attempt must be an engine.sheets.Attempt, got {attempt!r}")
    scope = RunScope(tenant.org_id, play, runs.new_run_id() if run_id is None else run_id)
    watch = OutageWatch(outage_budget(tenant.settings.outage_budget_s))
    traced = tracing.enter_run(scope.org_id, scope.play, scope.run_id)  # the run's span
    token = install_watch(watch)  # the run's tasks inherit it, and its log fields
    fields = where.enter(org=scope.org_id, play=scope.play, run_id=scope.run_id)
    try:
        ref = await retry_transient(lambda: runs.register(tenant, scope))  # and its outbox entry
        error: BaseException | None = None
        run = Run(tenant, ref, attempt, outage=watch, force=force)
        # The closing nursery outlives the run's own: what the run leaves in it (a list's
        # record for reruns, started as its map returns) goes on during the retirement, and
        # the exit waits for both.
        async with open_hosting_nursery() as closing:
            try:
                with watching_for_cancel(tenant, scope, run.stop):
                    async with open_hosting_nursery() as nursery:
                        run._nursery, run._closing = nursery, closing
                        yield run
            except BaseException as exc:  # classified, then re-raised unchanged
                error = traced.error = exc
                raise
            finally:
                run._nursery = run._closing = None
                if retire_on_exit and is_terminal(error) and not ended_by_outage(error):
                    await retirement.guard_retirement(tenant, scope, lease_s=lease_s)
    finally:
        tracing.leave(traced)
        where.leave(fields)
        reset_watch(token)


def ended_by_outage(error: BaseException | None) -> bool:
    """The run ended because the store stayed away past the outage budget."""
    return error is not None and any(
        isinstance(leaf, StoreOutageError) for leaf in leaf_errors(error))
