"""Executors: where a map's synchronous function runs — a local process pool or a Dask cluster.

How it works
- `run.map(..., executor="processes")` (or `executor=ProcessExecutor(max_workers=N)`) runs a
  synchronous `fn(row)` in a pool of processes through `trio-parallel` (one process per core
  by default). `runplane.actors.DaskExecutor(client)` sends each call to a running Dask cluster
  through a `distributed.Client`. Either way only the call travels: admission, completion and
  fencing stay in the map's own process, under its run's write version.
- The function travels by name, not by value: a pool process (or a Dask worker) loads the play
  file that defines it (`actors.shared.config.PlayFile`, once per process) and finds it by its
  qualified name, so a function of a play loaded by `runplane run` works as well as one of an
  importable module. A function that cannot be found by name is refused before the map starts
  (`InvalidInputError`).
- `bind(fn)` returns the async function of one row the map calls. A row whose call raises
  fails alone, with the exception's message. A pool process that dies (killed, `os._exit`, a
  crash) fails only the row it was running: `WorkerDiedError`, whose message carries the exit
  reason. A row timeout cancels the call, and a cancelled call kills its pool process
  (`kill_on_cancel`), so a runaway call never keeps running. For Dask, a cancelled call is
  cancelled on the cluster (best effort: Dask cannot stop a task already running). The client
  is used from worker threads in an empty context (`outside_event_loop`), so `distributed`
  never mistakes the asyncio loop the database driver runs on for its own.
"""

from __future__ import annotations

import contextvars
import inspect
import os
from typing import TYPE_CHECKING, Callable, Protocol, TypeVar

import attrs
import trio

from runplane.engine.canonical import JsonObject
from runplane.engine.limits.bounds import is_int
from runplane.engine.errors import EngineError, InvalidInputError

from .row_functions import RowCaller, RowFunction
from .shared.config import PlayFile, function_identity

if TYPE_CHECKING:
    from distributed import Client, Future

T = TypeVar("T")


class WorkerDiedError(EngineError):
    """The process running a row's call died before answering; only that row fails."""


class Executor(Protocol):
    """Where a map's synchronous function runs: `bind` makes the async function of one row
    the map calls."""

    def bind(self, fn: RowFunction) -> RowCaller: ...


def call_play_function(path: str, qualname: str, row: JsonObject) -> object:
    """Run in a pool process or a Dask worker: the play file's function on one row."""
    fn = PlayFile.load(path).find(qualname)
    if fn is None:
        raise InvalidInputError(f"play file {path} has no function {qualname!r}")
    return fn(row)


def _sync_function(fn: object) -> None:
    if not callable(fn) or inspect.iscoroutinefunction(inspect.unwrap(fn)):
        raise InvalidInputError("an executor runs a synchronous function of one row "
                                "(`def fn(row)`), not an async one")


def _positive_or_none(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not is_int(value, 1):
        raise InvalidInputError(f"{attribute.name} must be a positive integer or None, "
                                f"got {value!r}")


@attrs.frozen
class ProcessExecutor:
    """A local process pool (`trio-parallel`): `max_workers` processes at most (default: one
    per core)."""

    max_workers: int | None = attrs.field(default=None, validator=_positive_or_none)

    def bind(self, fn: RowFunction) -> RowCaller:
        import trio_parallel

        _sync_function(fn)
        identity = function_identity(fn)
        limiter = trio.CapacityLimiter(self.max_workers or os.cpu_count() or 1)

        async def call(row: JsonObject) -> object:
            try:
                return await trio_parallel.run_sync(
                    call_play_function, identity.path, identity.qualname, row,
                    kill_on_cancel=True, limiter=limiter)
            except trio_parallel.BrokenWorkerError as exc:
                raise WorkerDiedError(f"the pool process running the row died: "
                                      f"{_exit_reason(exc)}") from exc

        call.__runplane_function__ = fn  # type: ignore[attr-defined]  (see function_identity)
        return call


def _exit_reason(exc: BaseException) -> str:
    """What a `BrokenWorkerError` says about how the process ended (its exit code or signal)."""
    for arg in exc.args:
        code = getattr(arg, "exitcode", None)
        if code is not None:
            return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return str(exc) or type(exc).__name__


@attrs.frozen
class DaskExecutor:
    """Calls sent to a running Dask cluster through `client` (a `distributed.Client`)."""

    client: Client

    def bind(self, fn: RowFunction) -> RowCaller:
        _sync_function(fn)
        identity = function_identity(fn)
        client = self.client

        async def call(row: JsonObject) -> object:
            submitted: list[Future] = []

            def remote() -> object:  # in a thread, outside the run's asyncio loop (see below)
                future = client.submit(call_play_function, identity.path, identity.qualname,
                                       row, pure=False)
                submitted.append(future)
                return future.result()

            try:
                return await trio.to_thread.run_sync(
                    outside_event_loop, remote, abandon_on_cancel=True)
            finally:
                for future in submitted:
                    if not future.done():
                        future.cancel()

        call.__runplane_function__ = fn  # type: ignore[attr-defined]
        return call


def outside_event_loop(fn: Callable[[], T]) -> T:
    """Run `fn` in an empty context: a worker thread inherits the run's context variables,
    among them the asyncio loop `engine.pg` runs on trio, which `distributed` would otherwise
    take for its own."""
    return contextvars.Context().run(fn)


def executor_for(executor: object) -> Executor:
    """The executor `run.map(executor=...)` names: "processes", or an executor object."""
    if executor == "processes":
        return ProcessExecutor()
    if isinstance(executor, (ProcessExecutor, DaskExecutor)):
        return executor
    raise InvalidInputError(f"executor must be 'processes', a ProcessExecutor or a "
                            f"DaskExecutor, got {executor!r}")


def executor_config(executor: object) -> JsonObject | None:
    """A shared map's executor as JSON (a process pool is each worker's own); a Dask client
    cannot travel."""
    if executor is None:
        return None
    chosen = executor_for(executor)
    if isinstance(chosen, ProcessExecutor):
        return {"kind": "processes", "max_workers": chosen.max_workers}
    raise InvalidInputError("a shared map's workers cannot share a DaskExecutor: "
                            "use executor='processes' or no executor")

