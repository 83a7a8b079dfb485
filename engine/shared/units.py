"""A shared map's claimed units, admitted and completed under their leases: a worker's writes.

How it works
- `admit_units` admits the rows still to run of one claim's units (all of them, or what an
  earlier holder left unsettled) in one transaction, under the claim's own `Attempt` (the
  holder id; a row lease of 0 s, since the units' leases keep other workers off their rows),
  with the lease check in the same transaction (`leases.lease_check`): a holder whose
  unit was taken over cannot take its rows back (`LeaseLostError`, nothing admitted).
- `complete_units` writes a batch of one claim's outcomes and records, in the same
  transaction, each unit's progress (`leases.settle`: its settled mask, the counters
  its holder tallied plus what this very completion applied — completed, failed — and fenced,
  and the done mark once every row of the unit is settled). A worker completes in small
  batches, so what it computed is durable soon; a holder that lost a lease gets
  `LeaseLostError` and nothing of the batch lands; a replayed batch changes nothing.
- `concurrent=True` (a map published with rows of distinct keys, `shared_maps`): both run as
  concurrent sheet transactions (`engine.sheets.sheet_txn`), so the map's workers write at
  once; the lease check and the settle refuse it (`LeaseLostError`) for a map not published so.
- Both are actions, so a worker behind a gateway (no database credentials) runs units exactly
  as one with a DSN: the lease check cannot be split from the write it guards, so it runs
  where the write runs.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..actions import action
from ..values.codecs import BOOL, INT, RUN_REF, TEXT, USER_JSON, list_of, optional
from ..errors import InvalidInputError
from ..pg import Connection
from ..ports import Port
from ..values.scopes import RunRef, check_scope
from .leases import (
    SETTLEMENT, UNIT_LEASE, Settlement, UnitLease, check_settlements, lease_check, mask_of, settle,
    settlement_entries, unit_finder,
)
from ..sheets import Admission, Attempt, CellPolicy, Completion, RowOutcome, SheetContract
from ..sheets.admission import AdmitBatch, admit_write
from ..sheets.completion import complete_write
from ..sheets.model import ADMISSION, FencedRow, CELL_POLICIES, COMPLETION, CONTRACT, ROW_OUTCOME
from ..sheets.sheet_txn import UnitGuard
from ..sheets.sheet_write import SheetWrite


def claim_attempt(leases: Sequence[UnitLease]) -> Attempt:
    """The attempt a claim's rows run under: its holder id."""
    return Attempt(leases[0].holder, max(lease.claims for lease in leases), 0.0)


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")


def _check_leases(leases: Sequence[UnitLease]) -> None:
    if not leases:
        raise InvalidInputError("leases must not be empty")
    if len({lease.holder for lease in leases}) != 1:
        raise InvalidInputError("leases must all be of one claim (one holder)")


@action("shared_maps.admit_units", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "leases": list_of(UNIT_LEASE),
    "table_namespace": TEXT, "contract": CONTRACT, "rows": list_of(USER_JSON),
    "input_indexes": list_of(INT), "cell_policies": optional(CELL_POLICIES),
    "give_up_after": optional(INT), "concurrent": BOOL, "keys": optional(list_of(TEXT)),
    "force": BOOL,
}, result=ADMISSION)
async def admit_units(port: Port, ref: RunRef, map_invocation_id: str,
                      leases: Sequence[UnitLease], table_namespace: str,
                      contract: SheetContract, rows: Sequence[dict],
                      input_indexes: Sequence[int], *,
                      cell_policies: Mapping[str, CellPolicy] | None = None,
                      give_up_after: int | None = None,
                      concurrent: bool = False, keys: Sequence[str] | None = None,
                      force: bool = False) -> Admission:
    """Admit `rows` (at `input_indexes`, each a row of one of `leases` not settled) under the
    claim's attempt, the leases checked in the same transaction; `keys` are the rows' own (a
    retry's stored keys), `force` re-admits rows an earlier run finished."""
    check_scope(port, ref)
    _check_bool(concurrent, "concurrent")
    _check_bool(force, "force")
    _check_leases(leases)
    if len(rows) != len(input_indexes) or not rows:
        raise InvalidInputError("rows and input_indexes must be as many, at least one")
    find = unit_finder(leases)
    for i, index in enumerate(input_indexes):
        lease = find(index)
        if lease is None or mask_of(lease.settled) >> (index - lease.low) & 1:
            raise InvalidInputError(f"input_indexes[{i}]: {index} is not an unsettled row "
                                    "of the leases")
    write = SheetWrite(ref, table_namespace, contract, attempt=claim_attempt(leases),
                       cell_policies=cell_policies, give_up_after=give_up_after,
                       cache_hits="count", force=force)
    guard = UnitGuard(lease_check(port, ref, map_invocation_id, leases, concurrent), concurrent)
    batch = AdmitBatch(rows, input_indexes=input_indexes,
                       keys=None if keys is None else list(keys))
    return await admit_write(port, write, batch, guard=guard)


@action("shared_maps.complete_units", params={
    "ref": RUN_REF, "map_invocation_id": TEXT, "worker_id": TEXT,
    "settlements": list_of(SETTLEMENT), "table_namespace": TEXT, "contract": CONTRACT,
    "outcomes": list_of(ROW_OUTCOME), "concurrent": BOOL,
}, result=COMPLETION, deadline_s=75.0)
async def complete_units(port: Port, ref: RunRef, map_invocation_id: str, worker_id: str,
                         settlements: Sequence[Settlement], table_namespace: str,
                         contract: SheetContract, outcomes: Sequence[RowOutcome],
                         concurrent: bool = False) -> Completion:
    """Write a batch of one claim's outcomes and record its units' progress, in one
    transaction (see above)."""
    check_scope(port, ref)
    _check_bool(concurrent, "concurrent")
    check_settlements(settlements)
    leases = [s.lease for s in settlements]
    find = unit_finder(leases)
    for i, outcome in enumerate(outcomes):
        if not isinstance(outcome, RowOutcome) or find(outcome.input_index) is None:
            raise InvalidInputError(f"outcomes[{i}] is not a row of the settled units")

    async def within(conn: Connection, committed: frozenset[str],
                     fenced: dict[str, FencedRow]) -> None:
        await settle(conn, port, ref, map_invocation_id, worker_id,
                     settlement_entries(settlements, outcomes, committed, fenced), concurrent)

    write = SheetWrite(ref, table_namespace, contract, attempt=claim_attempt(leases))
    return await complete_write(port, write, outcomes, guard=UnitGuard(within, concurrent))
