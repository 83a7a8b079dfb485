"""A list map's proof that every row of its list ends a cache hit, so that recording the list
checks no key (`actors.list_replay`, `engine.sheets.lists`).

How it works
- `ListProof` belongs to one map of a list it may record. `writing()` is put around the map's
  own sheet writes (its sheet ensured, pages admitted, outcomes completed: `MapState.writing`),
  which note the `writes` value each left in the proof's `WriteLedger`
  (`engine.sheets.write_ledger`); a row function writing the sheet is not the map, and its
  writes leave a gap.
- `check(outcomes)` sees every outcome the map wrote: a completed one that leaves a contract
  output without a value a cache hit needs (`engine.sheets.dispositions.fresh_cell`: not null,
  not "") or that carries cell meta spoils the proof (`no_hit_seen`).
- `proven_writes()`: the sheet's `writes` after the map's last write when both hold; else None
  (the recording then checks every key).
Pure: no I/O.
"""

from __future__ import annotations

from operator import attrgetter, methodcaller
from typing import ContextManager, Sequence

import attrs

from runplane.engine.sheets import OutcomeStatus, RowOutcome
from runplane.engine.sheets.write_ledger import WriteLedger, keeping


@attrs.define(eq=False)
class ListProof:
    ledger: WriteLedger
    outputs: tuple[str, ...]  # the contract outputs a completed outcome must give values
    no_hit_seen: bool = False

    def writing(self) -> ContextManager[WriteLedger]:
        return keeping(self.ledger)

    def check(self, outcomes: Sequence[RowOutcome]) -> None:
        """Note a completed outcome that leaves its row no cache hit (module docstring). A
        batch of completed outcomes without cell meta (a map's own) is checked an output at a
        time, each check one pass in C; any other goes an outcome at a time."""
        if self.no_hit_seen:
            return
        if set(map(_STATUS, outcomes)) <= _ONLY_COMPLETED \
                and list(map(_META, outcomes)).count(None) == len(outcomes):
            datas = list(map(_DATA, outcomes))
            if self.outputs and None in datas:
                self.no_hit_seen = True
                return
            for name in self.outputs:
                values = list(map(methodcaller("get", name), datas))
                if None in values or "" in values:
                    self.no_hit_seen = True
                    return
            return
        for outcome in outcomes:
            if outcome.status != OutcomeStatus.COMPLETED:
                continue  # a failed row keeps the list from being recorded at all
            data = outcome.data or {}
            if outcome.cell_meta is not None or any(
                    data.get(name) is None or data.get(name) == "" for name in self.outputs):
                self.no_hit_seen = True
                return

    def proven_writes(self) -> int | None:
        return None if self.no_hit_seen else self.ledger.proven_writes()


_STATUS, _META, _DATA = attrgetter("status"), attrgetter("cell_meta"), attrgetter("data")
_ONLY_COMPLETED = frozenset({OutcomeStatus.COMPLETED.value})
