"""What a caller asks of one map: `MapOptions`, `run.map`'s keywords as one frozen value.

How it works
- Every field is a keyword of `run.map`, with the same default; an unknown keyword is refused
  with `TypeError` (`MapOptions.from_call`), as for any function. The run builds the map's plan
  from it (`Run._plan`, `actors.map_state.MapPlan`): the options are checked there, as the plan
  is built, so an invalid map cannot start.
- The pipeline's tuning defaults live here too (`PAGE_ROWS`, `BATCH_ROWS`, …), read by the plan
  and by the actors that size their work by them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import attrs

from runplane.engine.errors import InvalidInputError
from runplane.engine.shared import maps as sm
from runplane.engine.sheets import CellPolicy
from runplane.engine.sheets.sheet_write import PREVIOUS_CELLS_BUDGET_BYTES

from .backoff import MAX_WAITING_ROWS
from .policies import RateLimit, RowRetry
from .progress import MapProgress

if TYPE_CHECKING:
    from .executors import Executor

PAGE_ROWS = 5000           # rows admitted per transaction for a streamed source, at most ...
FIRST_PAGE_ROWS = 100      # ... starting from this and doubling, so the first rows run soon
BATCH_ROWS = 5000          # completion batch: rows ...
BATCH_BYTES = 1 << 20      # ... or bytes of output JSON ...
LINGER_S = 0.05            # ... or this long after the first outcome arrived
TAIL_HOLD_S = 0.5          # a map's last rows, fitting one batch, wait this long for the rest
TAIL_ROWS = 1000           # ... when at most this many (PERF: larger chunks buy the server nothing)
FLUSH_DEADLINE_S = 15.0    # the shielded flush on cancellation gives up after this

SHARED_ONLY = frozenset({"lease_s", "unit_rows"})  # `run.map` keywords of a shared map only


@attrs.frozen(kw_only=True)
class MapOptions:
    """How `run.map` runs one map; every field is also a keyword of `run.map` (see `Run.map`),
    with the same default."""

    concurrency: int = 16
    cell_policies: Mapping[str, CellPolicy] | None = None
    retry: RowRetry | None = None
    row_timeout_s: float | None = None
    rate_limit: RateLimit | None = None
    give_up_after: int | None = None
    on_progress: Callable[[MapProgress], object] | None = None
    map_invocation_id: str | None = None
    force: bool | None = None  # None: the run's (`open_run(..., force=...)`)
    previous_cells: bool = False  # re-admitted rows get row["_previous"] (`sheets.admit`)
    previous_cells_budget_bytes: int = PREVIOUS_CELLS_BUDGET_BYTES
    fail_fast: bool | int = True
    workers: int | None = None
    shared: bool = False
    executor: Executor | str | None = None
    # the pipeline's tuning (`MapPlan`)
    page_rows: int = PAGE_ROWS
    linger_s: float = LINGER_S
    tail_hold_s: float = TAIL_HOLD_S
    batch_rows: int = BATCH_ROWS
    batch_bytes: int = BATCH_BYTES
    flush_deadline_s: float = FLUSH_DEADLINE_S
    fast_admission: bool = True
    max_waiting_rows: int = MAX_WAITING_ROWS
    # a shared map's (`actors.shared.coordinator`)
    lease_s: float = sm.LEASE_S
    unit_rows: int = sm.UNIT_ROWS

    @classmethod
    def from_call(cls, options: MapOptions | None,
                  keywords: Mapping[str, object]) -> MapOptions:
        """`options` (or the defaults) with `run.map`'s keywords over it; an unknown keyword
        raises `TypeError`, as for any function."""
        if options is not None and not isinstance(options, MapOptions):
            raise InvalidInputError(f"options must be a MapOptions, got {options!r}")
        known = attrs.fields_dict(cls)
        for name in keywords:
            if name not in known:
                raise TypeError(f"Run.map() got an unexpected keyword argument {name!r}")
        return attrs.evolve(options if options is not None else cls(), **keywords)
