"""A sheet write: the one value that says which sheet rows go to, under which run, and how.

How it works
- `SheetWrite` holds the run (its epoch is the write version), the table namespace
  (normalized), the contract, the attempt (rows are leased to it), the cell policies (when a
  completed cell is stale), `give_up_after` (failed runs that block a row), the cache-hit mode
  of admission (`rows` lists hits with their outputs, `count` only counts them) and `force`
  (older runs' enriched rows run again), and whether admission hands re-admitted rows their
  previous cells (`previous_cells`, within `previous_cells_budget_bytes` per call:
  `previous_cells`). It is validated where it is built — an invalid one
  cannot exist, and `InvalidInputError` names the field before any query — and passed whole
  from `run.map` (`actors.map_state.MapPlan.write`) through admission, the probe and
  completion (`admit_write`, `probe_keyed`, `complete_write`): no layer checks it again.
- Whether the run belongs to the port's org is a question about the pair, asked once where a
  port meets the value (`check_port`).
- The actions `sheets.admit`, `sheets.probe` and `sheets.complete` keep their flat JSON bodies:
  `arguments` gives the value's part of a body, and the action functions build the value from
  the decoded body.
This module does no I/O.
"""

from __future__ import annotations

from typing import Literal, Mapping

import attrs

from ..errors import InvalidInputError
from ..limits.bounds import is_int
from ..ports import Port
from ..values.scopes import RunRef, check_scope, normalize_namespace

from .model import Attempt, CellPolicy, RowStatus, SheetContract, check_give_up_after
from .field_names import clean_field

CacheHits = Literal["rows", "count"]
PREVIOUS_CELLS_BUDGET_BYTES = 1 << 20  # of cell text per admission call (`previous_cells`)
MAX_PREVIOUS_CELLS_BUDGET_BYTES = 1 << 30


def check_budget(value: object) -> int:
    """`previous_cells_budget_bytes`, checked: an integer from 0 to 1 GiB."""
    if not is_int(value, 0, MAX_PREVIOUS_CELLS_BUDGET_BYTES):
        raise InvalidInputError(
            "previous_cells_budget_bytes must be an integer from 0 to "
            f"{MAX_PREVIOUS_CELLS_BUDGET_BYTES}, got {value!r}")
    return value  # type: ignore[return-value]
CACHE_HITS_MODES = ("rows", "count")


def _run(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, RunRef):
        raise InvalidInputError(f"run must be a RunRef, got {type(value).__name__}")


def _namespace(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidInputError("table_namespace must be a string")
    return normalize_namespace(value)


def _contract(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, SheetContract):
        raise InvalidInputError("contract must be a SheetContract")


def _attempt(_instance: object, _attribute: object, value: object) -> None:
    if value is not None and not isinstance(value, Attempt):
        raise InvalidInputError("attempt must be an Attempt or None")


def _policies(value: object) -> Mapping[str, CellPolicy]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidInputError("cell_policies must map field names to CellPolicy")
    out = {}
    for name, policy in value.items():
        field = clean_field(name, "cell_policies")
        if not isinstance(policy, CellPolicy):
            raise InvalidInputError(f"cell_policies[{name!r}] must be a CellPolicy")
        out[field] = policy
    return out


def _give_up_after(_instance: object, _attribute: object, value: object) -> None:
    check_give_up_after(value)


def _cache_hits(_instance: object, _attribute: object, value: object) -> None:
    if value not in CACHE_HITS_MODES:
        raise InvalidInputError(f"cache_hits must be one of {CACHE_HITS_MODES}, got {value!r}")


def check_flag(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    """An attrs validator: the field is True or False (not 1, not "yes")."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{attribute.name} must be True or False, got {value!r}")


@attrs.frozen
class SheetWrite:
    """Where and how rows are written into a sheet (see the module docstring)."""

    run: RunRef = attrs.field(validator=_run)
    table_namespace: str = attrs.field(converter=_namespace)
    contract: SheetContract = attrs.field(validator=_contract)
    attempt: Attempt | None = attrs.field(default=None, validator=_attempt)
    cell_policies: Mapping[str, CellPolicy] = attrs.field(
        default=None, converter=_policies, hash=False)
    give_up_after: int | None = attrs.field(default=None, validator=_give_up_after)
    cache_hits: CacheHits = attrs.field(default="rows", validator=_cache_hits)
    force: bool = attrs.field(default=False, validator=check_flag)
    previous_cells: bool = attrs.field(default=False, validator=check_flag)
    previous_cells_budget_bytes: int = attrs.field(default=PREVIOUS_CELLS_BUDGET_BYTES,
                                                   converter=check_budget)

    @property
    def plain(self) -> bool:
        """A write with neither an attempt's lease nor `force`: one that may join its map's
        write group (`write_group`)."""
        return self.attempt is None and not self.force

    def check_port(self, port: Port) -> None:
        """`ScopeError` unless the run belongs to the org `port` serves."""
        check_scope(port, self.run)

    @property
    def lease_status(self) -> str:
        """The status admitted rows take: running under the attempt's lease, else pending."""
        return (RowStatus.RUNNING if self.attempt is not None else RowStatus.PENDING).value

    def arguments(self, *names: str) -> dict[str, object]:
        """The value's part of an action's keyword arguments (`names`: the action's)."""
        every = {
            "run": self.run, "table_namespace": self.table_namespace, "contract": self.contract,
            "attempt": self.attempt, "cell_policies": dict(self.cell_policies) or None,
            "give_up_after": self.give_up_after, "cache_hits": self.cache_hits,
            "force": self.force, "previous_cells": self.previous_cells,
            "previous_cells_budget_bytes": self.previous_cells_budget_bytes,
        }
        return {name: every[name] for name in names}


def check_write(port: Port, run: object, contract: object, attempt: object) -> None:
    """The checks of a write's run, contract and attempt for a caller that sends them as they
    are (the gateway client), with the validators `SheetWrite` uses."""
    check_scope(port, run)
    _contract(None, None, contract)
    _attempt(None, None, attempt)


ADMIT_ARGUMENTS = ("run", "table_namespace", "contract", "attempt", "cell_policies",
                   "give_up_after", "cache_hits", "force")
# sent only when asked for, so an admission without them reads as before on any server
PREVIOUS_ARGUMENTS = ("previous_cells", "previous_cells_budget_bytes")
PROBE_ARGUMENTS = ("run", "table_namespace", "contract", "attempt", "cell_policies",
                   "give_up_after", "force")
COMPLETE_ARGUMENTS = ("run", "table_namespace", "contract", "attempt")
