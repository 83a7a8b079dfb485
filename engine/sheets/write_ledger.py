"""The sheet writes one map made, kept to prove that nobody else wrote its sheet meanwhile.

How it works
- Every ordinary sheet write transaction adds one to its sheet's `sheet_summary.writes` under
  the sheet lock (`sheet_txn`) and learns the value it left. A `WriteLedger` of one sheet,
  set with `keeping` around a map's own write calls only (a context variable: what those
  calls start inherits it, a row function's writes are not noted), is told the value of each
  such write transaction on that sheet once it committed (`note_commit`), and whether the
  transaction found counter deltas of concurrent writers.
- `proven_writes()` answers the sheet's `writes` after the map's last transaction when the
  values it was told are distinct and contiguous and no transaction found deltas: then, from
  the map's first write transaction on, no other transaction wrote the sheet (each would have
  taken a value in between), and the rows the map wrote are as it left them. A value it was not told
  (a transaction of the map that committed but whose caller never learned it, or another
  writer) leaves a gap, and the proof fails: the caller then checks what it wanted to prove
  the long way. A failed proof costs time, never a wrong answer.
- Only ordinary writers count: the writers of a shared map add deltas instead of a value, so
  a transaction that found deltas spoils the proof (`engine.sheets.lists`, `counters`) —
  unless the map's own write group (`write_group`) committed transactions since its last
  ordinary one: those leave no value and add deltas, and they ran only while `writes` still
  held that value and no shared map of the sheet was live (anyone else writing meanwhile
  leaves a gap), so the deltas its next ordinary transaction finds are the group's own.
Who uses it: `engine.sheets.lists` (a list recorded without its per-key check) and the map
that records it (`actors.list_proof`, `actors.list_replay`). Pure: no I/O.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import attrs


@attrs.define(eq=False)
class WriteLedger:
    """The write values of one sheet's (`sheet`: its counter arguments) transactions of a map."""

    sheet: tuple[str, str, str]
    values: list[int] = attrs.field(factory=list)
    spoiled: bool = False  # a transaction found deltas, or left no value
    group_deltas: bool = False  # the map's write group committed since its last value
    group: object | None = None  # the map's write group on this sheet (`write_group.group_for`)

    def note(self, writes: int | None, found_deltas: bool, group: bool = False) -> None:
        if group:
            self.group_deltas = True
        elif writes is None or (found_deltas and not self.group_deltas):
            self.spoiled = True
        else:
            self.values.append(writes)
            self.group_deltas = False

    def proven_writes(self) -> int | None:
        """The sheet's `writes` after the last noted transaction when nobody else wrote the
        sheet from the first one on (module docstring); None when that is not proven."""
        values = sorted(set(self.values))
        if (self.spoiled or not values or len(values) != len(self.values)  # a value twice
                or values[-1] - values[0] + 1 != len(values)):
            return None
        return values[-1]


_KEPT: contextvars.ContextVar[WriteLedger | None] = contextvars.ContextVar(
    "runplane_write_ledger", default=None)


@contextlib.contextmanager
def keeping(ledger: WriteLedger) -> Iterator[WriteLedger]:
    """Note the committed write transactions of `ledger`'s sheet made in this context (and in
    the tasks it starts meanwhile) in `ledger`."""
    token = _KEPT.set(ledger)
    try:
        yield ledger
    finally:
        _KEPT.reset(token)


def kept_ledger(sheet: tuple[str, str, str]) -> WriteLedger | None:
    """The ledger kept in this context for `sheet`, if any."""
    ledger = _KEPT.get()
    return ledger if ledger is not None and ledger.sheet == sheet else None


def note_commit(sheet: tuple[str, str, str], writes: int | None, found_deltas: bool,
                group: bool = False) -> None:
    """A sheet write transaction of `sheet` committed, leaving `writes` (None: unknown), or
    one of a write group (`group`: it leaves no value)."""
    ledger = _KEPT.get()
    if ledger is not None and ledger.sheet == sheet:
        ledger.note(writes, found_deltas, group)
