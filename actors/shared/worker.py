"""A shared-map worker: joins a play's open shared maps and serves them one after the other.

How it works
- `serve_play` joins the play's maps (`engine.shared.maps.join`, a heartbeat), then loops:
  read the play's waiting or open maps; for each, check the play file against what the map
  was published with (`actors.shared.config.check_published`: a different digest or a
  missing function refuses, `ConflictError`), then serve it while it has claimable units
  (`actors.shared.service.MapWorker`: claims, admissions, runners, batches of completions,
  renewals). Its `WorkerOptions`: with `exit_when_idle` it waits up to `idle_wait_s` for a
  map to appear and returns once no waiting or open map of the play has a unit not done;
  otherwise it runs until cancelled. `notify` receives one line as it joins each map and one
  as it leaves it.
- Store calls ride out an outage for the port's outage budget (`actors.retry`), then the
  worker ends with `StoreOutageError`; its leases expire and other workers take them.
"""

from __future__ import annotations

import os
from typing import Callable

import attrs
import trio

from runplane.engine.shared import maps as sm
from runplane.engine.ports import Port
from runplane.engine.opening import outage_budget

from ..map_state import MapPlan
from ..retry import OutageWatch, install_watch, reset_watch, retry_transient
from ..row_functions import RowFunction, as_row_caller
from .config import PlayFile, check_published, decode_config
from .service import MapWorker

__all__ = ["MapWorker", "WorkerOptions", "serve_play", "worker_plan"]

POLL_S = 0.1  # how often an idle worker looks for an open map of its play
IDLE_WAIT_S = 60.0


def _quiet(_line: str) -> None:
    pass


@attrs.frozen(kw_only=True)
class WorkerOptions:
    """How a worker serves its play: its `concurrency` (None: each map's own), whether it exits
    once idle (waiting up to `idle_wait_s` for a first map), how often it looks for maps and
    renews its leases (None: a third of each map's lease), and where its lines go."""

    concurrency: int | None = None
    exit_when_idle: bool = False
    idle_wait_s: float = IDLE_WAIT_S
    poll_s: float = POLL_S
    renew_s: float | None = None
    notify: Callable[[str], object] = _quiet


def worker_plan(port: Port, shared: sm.SharedMap, fn: RowFunction,
                concurrency: int | None, play: PlayFile | None = None) -> MapPlan:
    config = decode_config(shared.config, play)
    if config.executor is not None:  # a process pool of the worker's own
        from ..executors import ProcessExecutor

        fn = ProcessExecutor(config.executor.get("max_workers")).bind(fn)
    concurrency = concurrency or config.concurrency
    return MapPlan(port, shared.ref, None, shared.table_namespace, config.contract,
                   as_row_caller(fn, concurrency), concurrency, config.cell_policies, retry=config.retry,
                   row_timeout_s=config.row_timeout_s, rate_limit=config.rate_limit,
                   give_up_after=config.give_up_after, force=config.force)


async def serve_play(port: Port, play: str, play_file: str,
                     options: WorkerOptions = WorkerOptions(), *,
                     task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Serve the play's shared maps (see the module docstring); the units this worker ran."""
    concurrency, notify, renew_s = options.concurrency, options.notify, options.renew_s
    loaded = PlayFile.load(play_file)
    worker_id = sm.new_worker_id()
    token = install_watch(OutageWatch(outage_budget(port.settings.outage_budget_s)))
    try:
        await retry_transient(lambda: sm.join(port, play, worker_id))
        task_status.started(worker_id)
        limiter = trio.CapacityLimiter(concurrency or 16)
        started = trio.current_time()
        units = 0
        seen = False  # a map of the play was seen: once none is left, an idle worker exits
        while True:
            maps = await retry_transient(lambda: sm.live_maps(port, play))
            for shared in maps:
                name = f"{shared.ref.run_id}/{shared.map_invocation_id}"
                fn = check_published(loaded, name, shared.function, shared.play_digest)
                if shared.state != sm.OPEN:
                    continue
                plan = worker_plan(port, shared, fn, concurrency, loaded)
                worker = MapWorker(port, worker_id, shared, plan, limiter,
                                   renew_s if renew_s is not None else shared.lease_s / 3)
                where = (f"shared map {name} (table {shared.table_namespace!r}) of org "
                         f"{port.org_id!r}, play {play!r}")
                notify(f"worker {os.getpid()}: joined {where}")
                served = await worker.serve()
                units += served
                notify(f"worker {os.getpid()}: left {where} after {served} units")
            if options.exit_when_idle:
                seen = seen or bool(maps)
                if not maps and (seen or trio.current_time() - started > options.idle_wait_s):
                    return units
                if maps and await retry_transient(lambda: sm.units_remaining(port, play)) == 0:
                    return units
            await trio.sleep(options.poll_s)
            await retry_transient(lambda: sm.join(port, play, worker_id))
    finally:
        reset_watch(token)
