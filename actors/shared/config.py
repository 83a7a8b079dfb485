"""What a shared map tells its workers: the map's configuration as JSON, and the function.

How it works
- `function_identity(fn)` names the map's function as a worker finds it: the play file that
  defines it (its source file), its qualified name in that file, and the file's digest
  (SHA-256 of its bytes). A function defined inside another function cannot be found by name:
  `InvalidInputError` before anything is written.
- `encode_config(plan)` is the map's contract and row policies as JSON (exception types of a
  retry policy by module and qualified name); `decode_config` rebuilds them in a worker (a type
  the play file defines is found in the worker's load of that file). An
  unkeyed `RateLimit` becomes one limit for the whole map across its workers (keyed by run and
  map).
- `load_function(path, qualname)` loads a play file as a module of its own (its folder first on
  `sys.path`, like `python PLAY.py`) and finds the function; `check_published` refuses, with
  one line naming both, a play file whose digest differs from the published one or that has
  no such function (`ConflictError`).
This module does no I/O but reading the play file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Mapping

import attrs

from runplane.engine.canonical import JsonObject, JsonValue
from runplane.engine.errors import ConflictError, InvalidInputError
from runplane.engine.sheets import CellPolicy, SheetContract

from ..policies import RateLimit, RowRetry

if TYPE_CHECKING:
    from ..map_state import MapPlan


@attrs.frozen
class FunctionIdentity:
    """Where workers find a map's function. `digest` "" accepts any version of the play file
    and `keyed` says each staged row carries its sheet key as `_key` (both: a retry)."""

    path: str
    qualname: str
    digest: str
    keyed: bool = False


@attrs.frozen
class PublishedFunction:
    """A function known by its identity only: what the coordinator of a retry maps with. It
    runs no rows (the play's workers do), so calling it is a bug."""

    identity: FunctionIdentity

    async def __call__(self, row: JsonObject) -> JsonObject:
        raise RuntimeError(f"{self.identity.qualname} runs in the play's workers, not here")


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def function_identity(fn: object) -> FunctionIdentity:
    """Where workers find `fn` (the user's function behind an executor's binding)."""
    target = inspect.unwrap(getattr(fn, "__runplane_function__", fn))
    if isinstance(target, PublishedFunction):
        return target.identity
    location = function_location(target)
    if location is None:
        raise InvalidInputError(
            "fn of a shared map must be a function defined at the top level of a play file, "
            f"so workers can find it by name; got {fn!r}")
    path, qualname = location
    return FunctionIdentity(path, qualname, file_digest(path))


def function_location(fn: object) -> tuple[str, str] | None:
    """The play file and qualified name a worker finds `fn` by; None for a function no worker
    can find by name (a lambda, one defined inside another, a builtin)."""
    target = inspect.unwrap(getattr(fn, "__runplane_function__", fn))
    if isinstance(target, PublishedFunction):
        return target.identity.path, target.identity.qualname
    qualname = getattr(target, "__qualname__", None)
    try:
        path = inspect.getsourcefile(target)
    except TypeError:
        path = None
    if not qualname or "<locals>" in qualname or "<lambda>" in qualname or path is None:
        return None
    return str(Path(path).resolve()), qualname


def map_spec(plan: MapPlan, map_key: str) -> JsonObject | None:
    """What a map records for a later retry of its table (`engine.runs.retry_spec`): its
    function's location and its configuration; None when no worker could find the function."""
    location = function_location(plan.fn)
    if location is None:
        return None
    path, qualname = location
    config = encode_config(plan, run_id=plan.ref.run_id, map_invocation_id=map_key,
                           play_file=path)
    return {"function": qualname, "play_file": path, "config": config}


def _type_name(kind: type) -> str:
    return f"{kind.__module__}:{kind.__qualname__}"


# The module names a play file is loaded under, by `runplane run` and by a worker: no import
# finds them, so a type named with one is looked up in the map's play file instead.
RUN_PLAY_MODULE = "runplane_play_"
WORKER_PLAY_MODULE = "runplane_worker_play_"


def _resolve_type(name: str, play: Callable[[], ModuleType]) -> type:
    """The exception type `module:qualname`: imported, or, when the play file defines it (a
    play module's name, not importable), found in `play()`, the worker's load of that file."""
    module_name, _, qualname = name.partition(":")
    if module_name.startswith((RUN_PLAY_MODULE, WORKER_PLAY_MODULE)) \
            and module_name not in sys.modules:
        target: object = play()
    else:
        target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def encode_config(plan: MapPlan, *, run_id: str, map_invocation_id: str, play_file: str,
                  executor: JsonObject | None = None, concurrent: bool = False,
                  keyed: bool = False) -> JsonObject:
    """The JSON configuration of a shared map from its `MapPlan`; `concurrent`: its workers may
    write at once (`actors.shared.coordinator.rows_distinct`); `keyed`: each staged row carries
    its key as `_key` (a retry)."""
    retry = plan.retry
    limit = plan.rate_limit
    return {
        "contract": {"inputs": list(plan.contract.inputs), "outputs": list(plan.contract.outputs)},
        "concurrency": plan.concurrency,
        "cell_policies": {field: policy.stale_after_s
                          for field, policy in (plan.cell_policies or {}).items()},
        "retry": None if retry is None else {
            "max_attempts": retry.max_attempts, "initial_s": retry.initial_s,
            "backoff": retry.backoff, "max_interval_s": retry.max_interval_s,
            "jitter": retry.jitter, "retry_on": [_type_name(t) for t in retry.retry_on],
            "give_up_on": [_type_name(t) for t in retry.give_up_on],
        },
        "row_timeout_s": plan.row_timeout_s,
        "rate_limit": None if limit is None else {
            "per_second": limit.per_second, "burst": limit.burst,
            "key": limit.key or f"shared-map:{run_id}:{map_invocation_id}",
        },
        "give_up_after": plan.give_up_after,
        "play_file": play_file,
        "executor": executor,
        "concurrent": concurrent,
        "force": plan.force,
        "keyed": keyed,
    }


@attrs.frozen
class MapConfig:
    contract: SheetContract
    concurrency: int
    cell_policies: Mapping[str, CellPolicy] | None
    retry: RowRetry | None
    row_timeout_s: float | None
    rate_limit: RateLimit | None
    give_up_after: int | None
    play_file: str
    executor: Mapping[str, JsonValue] | None = None
    force: bool = False
    keyed: bool = False


def decode_config(config: Mapping[str, JsonValue], play: PlayFile | None = None) -> MapConfig:
    """The map's configuration; exception types defined in its play file are found in `play`
    (a worker's loaded play file), else in the play file the map was published from."""
    retry = config.get("retry")
    limit = config.get("rate_limit")

    def play_module() -> ModuleType:
        return (play or PlayFile.load(str(config.get("play_file", "")))).module

    return MapConfig(
        contract=SheetContract(tuple(config["contract"]["inputs"]),
                               tuple(config["contract"]["outputs"])),
        concurrency=int(config.get("concurrency") or 16),
        cell_policies={field: CellPolicy(s) for field, s in config["cell_policies"].items()}
        or None,
        retry=None if retry is None else RowRetry(
            max_attempts=retry["max_attempts"], initial_s=retry["initial_s"],
            backoff=retry["backoff"], max_interval_s=retry["max_interval_s"],
            jitter=retry["jitter"],
            retry_on=tuple(_resolve_type(n, play_module) for n in retry["retry_on"]),
            give_up_on=tuple(_resolve_type(n, play_module) for n in retry["give_up_on"])),
        row_timeout_s=config.get("row_timeout_s"),
        rate_limit=None if limit is None else RateLimit(
            limit["per_second"], limit["burst"], limit["key"]),
        give_up_after=config.get("give_up_after"),
        play_file=config.get("play_file", ""),
        executor=config.get("executor"),
        force=config.get("force") is True,
        keyed=config.get("keyed") is True,
    )


@attrs.define(eq=False)
class PlayFile:
    """A play file loaded once by a worker: its digest and its module."""

    path: str
    digest: str
    module: ModuleType

    @classmethod
    def load(cls, path: str) -> PlayFile:
        file = Path(path).resolve()
        if not file.is_file():
            raise InvalidInputError(f"{path}: no such play file")
        digest = file_digest(file)
        name = f"{WORKER_PLAY_MODULE}{digest[:12]}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or spec.loader is None:
                raise InvalidInputError(f"{path}: not a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, str(file.parent))
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return cls(str(file), digest, module)

    def find(self, qualname: str) -> Callable[..., object] | None:
        target: object = self.module
        for part in qualname.split("."):
            target = getattr(target, part, None)
            if target is None:
                return None
        return target if callable(target) else None


def check_published(play: PlayFile, map_name: str, function: str, digest: str) -> Callable:
    """The published function from `play`, or `ConflictError` naming both sides (a retry's
    digest "" accepts any version of the file: it re-runs rows after the function changed)."""
    if digest and play.digest != digest:
        raise ConflictError(
            f"play file {play.path} (digest {play.digest[:12]}) differs from the one shared map "
            f"{map_name} was published with (digest {digest[:12]}); refusing to join")
    fn = play.find(function)
    if fn is None:
        raise ConflictError(f"play file {play.path} has no function {function!r}, which shared "
                            f"map {map_name} runs; refusing to join")
    return fn
