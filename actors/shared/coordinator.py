"""The coordinator of a shared map: `run.map(..., workers=N)` and `run.map(..., shared=True)`.

How it works
- The source must be a list (an array input): it is encoded and staged like any list source
  (`actors.sealer.stage_encoded`; a wake finds it staged and checks it is the same list), the
  sheet is ensured, and the map is published (`engine.shared.maps.publish`) with its units —
  slices of at most `UNIT_ROWS` rows of each staged page — its configuration, the function's
  qualified name and the play file's digest (`actors.shared.config`).
- With `workers=N` the coordinator starts N local `runplane worker` processes first (their
  start-up overlaps staging the list; a failed publication stops them), which inherit
  its connection (DSN, schema, org, through the environment) and the play file; it waits until
  N workers joined (or `JOIN_WAIT_S`) and then opens the map, so the first claims split the
  units fairly. It runs no rows itself. With `shared=True` it opens the map at once and starts
  no worker: workers anywhere join it.
- A list whose rows are all distinct is published `concurrent` (checked while it is staged):
  the workers' unit writes then do not wait for each other's (`engine.sheets.sheet_txn`); a
  list with a repeated row is written by one worker at a time, as any sheet.
- While it waits, a map that has had no live worker of its play (one seen within the map's
  lease) for `NO_WORKER_WARN_S` gets a warning line naming the org and play workers must
  serve, then one every `NO_WORKER_REPEAT_S` (`_WorkerWatch`): a worker started for another
  play or org would otherwise leave the run waiting in silence.
- While it waits it hands `on_progress` a snapshot about every `PROGRESS_S` (`_progress`): the
  counters every worker recorded so far and the rows inside a call in every worker
  (`engine.runs.row_calls`), so `runplane run --workers N` shows the same bars and log lines as a
  map run in its own process.
- It then polls the map until every unit is done and closes it `done`; its `MapResult` is the
  sum of the counters the workers recorded with each unit's done mark (in the transaction of
  the unit's last completion), so it is exact whoever ran the rows. If every local worker
  exits while units remain (and the map is not shared), the map is cancelled and
  `SharedMapError` says how the workers ended. A local worker that exits before the map ends
  has its leases released at once (`engine.shared.leases.release_process`): the coordinator is its
  parent and saw it end, so the others take its units without waiting out the lease.
- When the coordinating run is cancelled or fails, the map is closed `cancelled` (shielded,
  with a deadline): every worker stops that map's rows at its next renewal (within a lease
  period) and its completions roll back, so nothing is half-written; local workers are then
  terminated.
- What it is given: the map's plan (`actors.map_state.MapPlan`, which holds the run's port and
  ref), where its rows run (`SharedOptions`) and the map id its caller decided, never the
  `Run`. `Run.map` calls `check_request` first, then takes the run's next map id for the
  namespace (unless it was given one), then `map_shared`; so `actors.run` imports this module
  and nothing here imports `actors.run`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Callable, Sequence

import attrs
import trio

from runplane.engine import array_input, sheets
from runplane.engine.canonical import JsonObject
from runplane.engine.observability import metrics
from runplane.engine.runs import row_calls
from runplane.engine.shared import leases as shared_leases
from runplane.engine.shared import maps as sm
from runplane.engine.limits.bounds import is_int
from runplane.engine.errors import EngineError, InvalidInputError, unwrap_single_error
from runplane.engine.ports import Port

from ..cancellation import RunStop
from ..executors import executor_config
from ..map_state import MapPlan
from ..mapper import MapSource
from ..progress import MapProgress, MapResult
from ..retry import retry_transient
from ..sealer import EncodedList, stage_encoded
from .config import encode_config, function_identity

if TYPE_CHECKING:
    from ..executors import Executor

log = logging.getLogger("runplane.actors")

JOIN_WAIT_S = 10.0
NO_WORKER_WARN_S = 30.0
NO_WORKER_REPEAT_S = 60.0
WORKER_CHECK_S = 1.0  # how often the coordinator looks for live workers
PROGRESS_S = 1.0  # how often the coordinator reports the map's progress (when asked to)
POLL_S = 0.05  # how often the coordinator reads its map's progress (one short read)
CLOSE_DEADLINE_S = 5.0
STOP_WORKERS_S = 5.0


# `runplane run PLAY.py --workers N`: list-source maps of the play run with N local workers.
default_workers: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "runplane_default_workers", default=None)


class SharedMapError(EngineError):
    """A shared map could not finish: every local worker exited while units remained."""


@attrs.frozen
class SharedOptions:
    """Where a shared map's rows run: `workers` local worker processes, or (`shared`) workers
    started anywhere; the `executor` they call the function in; its units' lease and size."""

    workers: int | None = None
    shared: bool = False
    executor: Executor | str | None = None
    lease_s: float = sm.LEASE_S
    unit_rows: int = sm.UNIT_ROWS


def worker_command(play_file: str, play: str, concurrency: int) -> list[str]:
    return [sys.executable, "-m", "runplane.cli", "worker", play_file, "--play", play,
            "--concurrency", str(concurrency), "--exit-when-idle"]


def worker_environment(port: Port) -> dict[str, str]:
    """The connection a local worker inherits: the coordinator's DSN, schema and org, and the
    tenants file placing the org when there is one (`RUNPLANE_TENANTS`: the worker then follows
    the org's moves as the coordinator does)."""
    dsn = port.settings.dsn
    if dsn is None:
        raise InvalidInputError("workers=N needs a direct database connection (a tenant); "
                                "through a gateway, publish with shared=True and start "
                                "`runplane worker` yourself")
    env = dict(os.environ)
    env.update(RUNPLANE_DSN=dsn, RUNPLANE_SCHEMA=port.schema, RUNPLANE_ORG=port.org_id)
    if port.settings.tenants_file is not None:
        env["RUNPLANE_TENANTS"] = port.settings.tenants_file
    return env


async def publish_map(source: Sequence[JsonObject], plan: MapPlan, map_invocation_id: str,
                      lease_s: float, executor: Executor | str | None = None,
                      unit_rows: int = sm.UNIT_ROWS) -> int:
    """Stage the list, ensure the sheet and publish the map `map_invocation_id` of the plan's
    run; its number of units."""
    identity = function_identity(plan.fn)
    port, ref = plan.port, plan.ref
    scope = ref.scope.map(plan.table_namespace, map_invocation_id)
    items = source if isinstance(source, array_input.PagedRows) else list(source)
    encoded = await trio.to_thread.run_sync(array_input.encode_source, items)
    distinct = False

    async def check_distinct() -> None:
        nonlocal distinct
        distinct = await trio.to_thread.run_sync(rows_distinct, encoded)

    async with trio.open_nursery() as nursery:  # the check overlaps staging
        nursery.start_soon(check_distinct)
        await retry_transient(lambda: sheets.ensure_sheet(
            port, ref.scope.play_scope, plan.table_namespace, plan.contract))
        await stage_encoded(port, scope, encoded)
    units = sm.plan_units(encoded.cuts, unit_rows)
    config = encode_config(plan, run_id=ref.run_id, map_invocation_id=map_invocation_id,
                           play_file=identity.path, executor=executor_config(executor),
                           concurrent=distinct, keyed=identity.keyed)
    await retry_transient(lambda: sm.publish(
        port, ref, map_invocation_id, plan.table_namespace, config=config,
        function=identity.qualname, play_digest=identity.digest, units=units, lease_s=lease_s))
    return len(units)


def rows_distinct(encoded: EncodedList) -> bool:
    """Whether no two rows of a staged list have the same canonical text (so no two rows share
    a key, which is derived from it): its workers may then write at once. Compared by Python
    hash, so a collision answers no, the safe side; a paged source answers no."""
    if not isinstance(encoded, array_input.EncodedSource):
        return False
    seen: set[int] = set()
    for page in encoded.page_texts:
        for text in page.split("\n"):
            digest = hash(text)
            if digest in seen:
                return False
            seen.add(digest)
    return True


async def wait_for_workers(plan: MapPlan, map_invocation_id: str, workers: int) -> None:
    with trio.move_on_after(JOIN_WAIT_S):
        while await retry_transient(lambda: sm.workers_joined(
                plan.port, plan.ref, map_invocation_id)) < workers:
            await trio.sleep(POLL_S)


def check_request(source: MapSource, plan: MapPlan, options: SharedOptions) -> None:
    """Refuse what a shared map cannot run (`InvalidInputError`), before its caller takes a
    map id and before anything is written: a source that is not a list, a bad `workers`,
    neither `workers` nor `shared`, `workers=N` without a DSN local workers can inherit, a
    function workers cannot find by name, an unknown executor."""
    if not isinstance(source, (list, tuple, array_input.PagedRows)):
        raise InvalidInputError("a shared map's source must be a list of rows, got "
                                f"{type(source).__name__}")
    workers = options.workers
    if workers is not None and not is_int(workers, 1):
        raise InvalidInputError(f"workers must be a positive integer, got {workers!r}")
    if workers is None and not options.shared:
        raise InvalidInputError("a shared map needs workers=N or shared=True")
    if workers:
        worker_environment(plan.port)
    function_identity(plan.fn)
    executor_config(options.executor)


async def map_shared(source: Sequence[JsonObject], plan: MapPlan, map_invocation_id: str,
                     options: SharedOptions, *,
                     on_progress: Callable[[MapProgress], object] | None = None,
                     stop: RunStop | None = None) -> MapResult:
    """Run `plan` over the list `source` as the shared map `map_invocation_id` of the plan's
    run (see the module docstring). The caller decides the id (a run's next one for the
    namespace, or the one it was given) after `check_request` passed, so a refused request
    takes no id. A cancellation of the run (`stop`) cancels the map: its workers stop, and the
    result counts what was written, stopped early."""
    workers, unit_rows = options.workers, options.unit_rows
    env = worker_environment(plan.port) if workers else None
    map_invocation_id = sm.map_id_for(map_invocation_id, plan.table_namespace)
    if len(source) == 0:
        return MapResult(0, 0, 0, 0, 0, 0, map_invocation_id=map_invocation_id)
    if not is_int(unit_rows, 1, sm.UNIT_ROWS):
        raise InvalidInputError(f"unit_rows must be an integer from 1 to {sm.UNIT_ROWS}, "
                                f"got {unit_rows!r}")
    published = finished = False
    stopping = stop.scope() if stop is not None else contextlib.nullcontext()
    try:
        with stopping, unwrap_single_error(Exception):  # a refused list raises as itself
            async with trio.open_nursery() as nursery:
                processes: list[trio.Process] = []
                if workers:  # started first: their start-up overlaps staging the list
                    identity = function_identity(plan.fn)
                    command = worker_command(identity.path, plan.ref.scope.play,
                                             plan.concurrency)
                    for _ in range(workers):
                        processes.append(await nursery.start(_keep_worker, command, env))
                await publish_map(source, plan, map_invocation_id, options.lease_s,
                                  options.executor, unit_rows)
                published = True
                if workers:
                    await wait_for_workers(plan, map_invocation_id, workers)
                await retry_transient(lambda: sm.set_state(
                    plan.port, plan.ref, map_invocation_id, sm.OPEN, (sm.WAITING,)))
                progress = _Progress(plan, map_invocation_id, len(source), on_progress)
                status = await _wait_done(plan, map_invocation_id,
                                          processes if not options.shared else [],
                                          options.lease_s, progress)
                finished = True
                await retry_transient(lambda: sm.set_state(
                    plan.port, plan.ref, map_invocation_id, sm.DONE, sm.LIVE))
                # Idle local workers exit on their own once the map is closed; any still running
                # after a grace period are terminated.
                nursery.cancel_scope.deadline = trio.current_time() + STOP_WORKERS_S
    finally:
        if published and not finished:
            await _cancel_map(plan, map_invocation_id)
    cancelled = stop is not None and stop.cancelled and not finished
    if cancelled:
        if not published:
            return MapResult(0, 0, 0, 0, 0, 0, map_invocation_id=map_invocation_id,
                             stopped_early=True, stop_reason=stop.reason)
        status = await retry_transient(lambda: sm.map_status(
            plan.port, plan.ref, map_invocation_id, counters=True))
    counters = status.counters
    return MapResult(
        admitted=counters["rows"] - counters["skipped"], cached=counters["cached"],
        completed=counters["completed"], failed=counters["failed"], blocked=counters["blocked"],
        fenced=counters["fenced"], skipped=counters["skipped"], executed=counters["executed"],
        map_invocation_id=map_invocation_id, retried=counters["retried"],
        timed_out=counters["timed_out"], stopped_early=cancelled,
        stop_reason=stop.reason if cancelled else None)


async def _keep_worker(command: list[str], env: dict[str, str],
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run one local worker; terminate it (then kill it) when the map's scope is cancelled."""
    process = await trio.lowlevel.open_process(command, env=env, stdin=subprocess.DEVNULL)
    task_status.started(process)
    try:
        await process.wait()
    finally:
        if process.returncode is None:
            with trio.CancelScope(shield=True):
                process.terminate()
                with trio.move_on_after(STOP_WORKERS_S):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


@attrs.define(eq=False)
class _WorkerWatch:
    """Says when a shared map has had no live worker for a while (module docstring)."""

    port: Port
    play: str
    map_name: str
    lease_s: float
    last_live: float = attrs.field(factory=trio.current_time)
    next_check: float = 0.0
    next_warning: float = attrs.field(init=False)
    waiting: bool = False  # no live worker past NO_WORKER_WARN_S (what status shows)

    def __attrs_post_init__(self) -> None:
        self.next_warning = self.last_live + NO_WORKER_WARN_S

    async def check(self) -> None:
        now = trio.current_time()
        if now < self.next_check:
            return
        self.next_check = now + WORKER_CHECK_S
        seen = await retry_transient(lambda: sm.workers(self.port, self.play))
        if any(w.seen_s_ago <= max(self.lease_s, 2 * WORKER_CHECK_S) for w in seen):
            self.last_live, self.waiting = now, False
            self.next_warning = now + NO_WORKER_WARN_S
            return
        if now >= self.next_warning:
            self.waiting = True
            self.next_warning = now + NO_WORKER_REPEAT_S
            log.warning(
                "shared map %s has had no live worker for %.0f s: start `runplane worker "
                "PLAY.py` for org %r, play %r (its PLAY, or --play %s)", self.map_name,
                now - self.last_live, self.port.org_id, self.play, self.play)


@attrs.define(eq=False)
class _Progress:
    """The coordinator's view of a shared map's progress (module docstring)."""

    plan: MapPlan
    map_invocation_id: str
    source_rows: int
    on_progress: Callable[[MapProgress], object] | None
    next_at: float = 0.0

    async def report(self, final: bool = False) -> None:
        now = trio.current_time()
        if self.on_progress is None or (now < self.next_at and not final):
            return
        self.next_at = now + PROGRESS_S
        port, ref = self.plan.port, self.plan.ref
        status = await retry_transient(lambda: sm.map_status(
            port, ref, self.map_invocation_id, counters=True))
        in_call = 0
        if not final:
            calling = await retry_transient(lambda: row_calls.running(
                port, ref.scope.play_scope, only_runs=[ref.run_id]))
            in_call = sum(r.in_call for r in calling
                          if r.table_namespace == self.plan.table_namespace)
        metrics.shared_units(self.map_invocation_id, status.units, status.done, final)
        c = status.counters
        admitted = c["rows"] - c["skipped"]
        snapshot = MapProgress(
            source_rows=self.source_rows, admitted=admitted,
            pending=admitted - c["cached"] - c["blocked"], cached=c["cached"],
            blocked=c["blocked"], skipped=c["skipped"], executed=c["executed"],
            completed=c["completed"], failed=c["failed"], fenced=c["fenced"], calls=c["calls"],
            retried=c["retried"], timed_out=c["timed_out"], in_call=in_call)
        try:
            self.on_progress(snapshot)
        except Exception:  # observational only
            log.exception("map progress callback failed")


async def _wait_done(plan: MapPlan, map_invocation_id: str, processes: list[trio.Process],
                     lease_s: float, progress: _Progress) -> sm.MapStatus:
    port, ref = plan.port, plan.ref
    watch = _WorkerWatch(port, ref.scope.play, f"{ref.run_id}/{map_invocation_id}", lease_s)
    released: set[int] = set()
    while True:
        status = await retry_transient(lambda: sm.map_status(port, ref, map_invocation_id))
        if status.done >= status.units:
            await progress.report(final=True)
            return await retry_transient(lambda: sm.map_status(
                port, ref, map_invocation_id, counters=True))
        if status.state not in (sm.WAITING, sm.OPEN):
            raise SharedMapError(f"shared map {map_invocation_id!r} was {status.state} with "
                                 f"{status.units - status.done} units not done")
        for process in processes:
            if process.returncode is not None and process.pid not in released:
                released.add(process.pid)
                await _release_exited(plan, map_invocation_id, process)
        if processes and all(p.returncode is not None for p in processes):
            codes = sorted({p.returncode for p in processes})
            raise SharedMapError(
                f"every local worker of shared map {map_invocation_id!r} exited (status "
                f"{', '.join(map(str, codes))}) with {status.units - status.done} units not done")
        await watch.check()
        await progress.report()
        await trio.sleep(POLL_S)


async def _release_exited(plan: MapPlan, map_invocation_id: str,
                          process: trio.Process) -> None:
    units = await retry_transient(lambda: shared_leases.release_process(
        plan.port, plan.ref, map_invocation_id, socket.gethostname(), process.pid))
    log.warning("shared map %s/%s: local worker pid %d exited (status %s) before the map "
                "ended; its %d leased unit(s) were released", plan.ref.run_id, map_invocation_id,
                process.pid, process.returncode, units)


async def _cancel_map(plan: MapPlan, map_invocation_id: str) -> None:
    with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_DEADLINE_S):
        try:
            await sm.set_state(plan.port, plan.ref, map_invocation_id, sm.CANCELLED, sm.LIVE)
        except EngineError as exc:
            log.warning("shared map %s: could not be marked cancelled (its leases will "
                        "expire): %s", map_invocation_id, exc)
