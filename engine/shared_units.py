"""A shared map's unit, admitted and completed under its lease: two actions a worker calls.

How it works
- `admit_unit` admits a unit's rows under the unit's own `Attempt` (the lease's holder id; a
  row lease of 0 s, since the unit's lease is what keeps other workers off its rows) in one
  transaction that also checks the lease (`shared_maps.unit_guard`): a holder whose unit was
  taken over cannot take its rows back (`LeaseLostError`, nothing admitted).
- `complete_unit` writes the unit's outcomes in one transaction that also marks the unit done
  with its counters: the worker's `tally` (rows, cache hits, calls...) plus what this very
  completion applied (completed, failed) and fenced. A holder that lost the lease gets
  `LeaseLostError` and nothing of it lands.
- Both are actions, so a worker behind a gateway (no database credentials) runs units exactly
  as one with a DSN: the lease check cannot be split from the write it guards, so it runs
  where the write runs.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from . import sheets
from .actions import action
from .codecs import INT, INT32, RUN_REF, TEXT, USER_JSON, dict_of, list_of, optional
from .errors import InvalidInputError
from .ports import Port
from .scopes import RunRef, check_scope
from .shared_maps import COUNTERS, UNIT_LEASE, UnitLease, unit_guard
from .sheets import Admission, Attempt, CellPolicy, Completion, RowOutcome, SheetContract
from .sheets.model import ADMISSION, CELL_POLICIES, COMPLETION, CONTRACT, ROW_OUTCOME

TALLIED = frozenset(COUNTERS) - {"completed", "failed", "fenced"}  # what a worker reports


def unit_attempt(lease: UnitLease) -> Attempt:
    return Attempt(lease.holder, lease.claims, 0.0)


@action("shared_maps.admit_unit", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "worker_id": TEXT, "lease": UNIT_LEASE,
    "table_namespace": TEXT, "contract": CONTRACT, "rows": list_of(USER_JSON),
    "cell_policies": optional(CELL_POLICIES), "give_up_after": optional(INT),
}, result=ADMISSION)
async def admit_unit(port: Port, ref: RunRef, map_invocation_id: str, worker_id: str,
                     lease: UnitLease, table_namespace: str, contract: SheetContract,
                     rows: Sequence[dict], *,
                     cell_policies: Mapping[str, CellPolicy] | None = None,
                     give_up_after: int | None = None) -> Admission:
    """Admit the unit's rows under its attempt, the lease checked in the same transaction."""
    check_scope(port, ref)
    if len(rows) != lease.row_count:
        raise InvalidInputError(f"unit {lease.unit} holds {lease.row_count} rows, "
                                f"got {len(rows)}")
    return await sheets.admit(
        port, ref, table_namespace, contract, rows, input_offset=lease.low,
        attempt=unit_attempt(lease), cell_policies=cell_policies, give_up_after=give_up_after,
        cache_hits="count",
        within=unit_guard(port, ref, map_invocation_id, worker_id, lease, None))


@action("shared_maps.complete_unit", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "worker_id": TEXT, "lease": UNIT_LEASE,
    "table_namespace": TEXT, "contract": CONTRACT, "outcomes": list_of(ROW_OUTCOME),
    "tally": dict_of(INT),
}, result=COMPLETION, deadline_s=75.0)
async def complete_unit(port: Port, ref: RunRef, map_invocation_id: str, worker_id: str,
                        lease: UnitLease, table_namespace: str, contract: SheetContract,
                        outcomes: Sequence[RowOutcome], tally: Mapping[str, int]) -> Completion:
    """Write the unit's outcomes and mark it done, in one transaction (see above)."""
    check_scope(port, ref)
    unknown = set(tally) - TALLIED
    if unknown:
        raise InvalidInputError(f"tally: unknown counters {sorted(unknown)}")
    statuses = {outcome.key: outcome.status for outcome in outcomes}  # the last one wins

    def counters(committed: frozenset[str], fenced: dict[str, Any]) -> dict[str, int]:
        applied = [statuses[key] for key in committed if key in statuses]
        return {**dict.fromkeys(TALLIED, 0), **tally,
                "completed": applied.count("completed"), "failed": applied.count("failed"),
                "fenced": len(fenced)}

    return await sheets.complete(
        port, ref, table_namespace, contract, outcomes, attempt=unit_attempt(lease),
        within=unit_guard(port, ref, map_invocation_id, worker_id, lease, counters))
