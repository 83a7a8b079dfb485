"""An unchanged rerun of a list, answered whole from a recorded list (`engine.sheets.lists`).

How it works
- `ListReplay.for_map` digests a list the map may replay (`lists.recordable`, and not with
  `fast_admission=False`; in a worker thread for a long list); None when it may not, or the
  list has no digest.
- `answer` asks the store in one statement whether the list is recorded, the sheet unchanged
  since and nothing of the map staged; if so the statement has recorded the run's membership of
  its rows, and the map counts every row cached (`MapTally.on_replayed`) and ends without
  keying, probing or staging a row. A map whose list input was already staged (a wake of an
  incarnation that began staging) gets no answer: its staging is resumed and sealed by the
  ordinary path.
- Otherwise the map runs as usual, keeping the keys of the rows it admits
  (`MapState.admitted_keys`), and `record` records the list once the map has ended with every
  row a cache hit for it (the rows it completed and the ones it found cached; nothing failed,
  blocked, fenced, repeated or left over). The run records it in its nursery once the map has
  returned, and ends only after. A replay or record that fails is logged (a record is tried
  once) and changes nothing the map reports: the record is only a shortcut for later runs.
- Recording checks no key when the map proves every row a hit itself: its sheet write
  transactions, kept in a `WriteLedger` (`engine.sheets.write_ledger`; the first is the
  map's `ensure_sheet`, before any row is probed or admitted), show that nobody else wrote
  the sheet meanwhile, and every outcome it completed gave every contract output a value a
  cache hit needs (not null, not ""; `actors.list_proof`). The statement then only
  checks that the sheet's `writes` has not moved since. Otherwise it checks every key
  (~2.5 µs of server work a row).
"""

from __future__ import annotations

import logging
from typing import Sequence

import attrs
import trio

from runplane.engine.canonical import JsonObject
from runplane.engine.errors import EngineError
from runplane.engine.values.scopes import MapScope
from runplane.engine.sheets import lists
from runplane.engine.sheets.layout import layout_for
from runplane.engine.sheets.write_ledger import WriteLedger

from .list_proof import ListProof
from .map_state import MapPlan, MapState
from .retry import retry_transient

log = logging.getLogger("runplane.actors")

DIGEST_INLINE_ROWS = 20_000  # longer lists are digested in a worker thread (~1 ms per 7,000 rows)


@attrs.define(eq=False)
class ListReplay:
    plan: MapPlan
    rows: int
    digest: bytes

    @classmethod
    async def for_map(cls, plan: MapPlan, rows: Sequence[JsonObject]) -> ListReplay | None:
        if not plan.fast_admission or not lists.recordable(plan.port, plan.write, len(rows)):
            return None
        if len(rows) <= DIGEST_INLINE_ROWS:
            digest = lists.list_digest(plan.write, rows)
        else:
            digest = await trio.to_thread.run_sync(lists.list_digest, plan.write, rows)
        return None if digest is None else cls(plan, len(rows), digest)

    async def answer(self, state: MapState, scope: MapScope) -> bool:
        """Whether the recorded list answered the whole map (its rows then counted cached)."""
        plan = self.plan
        replayed: int | None = None
        try:
            replayed = await retry_transient(
                lambda: lists.replay_list(plan.port, plan.write, self.digest, scope))
        except EngineError as exc:
            log.info("map %s: its recorded list could not be read (%s); mapping it row by "
                     "row", plan.table_namespace, exc)
        if replayed != self.rows:
            state.admitted_keys = []
            sheet = layout_for(plan.port, plan.ref.scope.play_scope, plan.table_namespace)
            state.list_proof = ListProof(WriteLedger(sheet.counter_args),
                                         tuple(plan.contract.outputs))
            return False
        state.tally.on_replayed(self.rows)
        return True

    async def record(self, state: MapState) -> None:
        """Record the list if the map ended with every row of it a cache hit."""
        tally = state.tally
        if state.admitted_keys is None or state.stopping \
                or (tally.failed, tally.blocked, tally.fenced, tally.skipped) != (0, 0, 0, 0) \
                or tally.source_rows != self.rows or tally.completed + tally.cached != self.rows:
            return
        keys = list(dict.fromkeys(state.reused_keys + state.admitted_keys))
        state.admitted_keys = None
        if len(keys) != self.rows:
            return
        plan = self.plan
        proof = state.list_proof
        try:  # one attempt: a later run that finds no record takes the ordinary path
            if proof is not None and proof.ledger.group_deltas:
                with proof.writing():  # the map's write group left deltas: fold them first
                    await lists.fold_deltas(plan.port, plan.write)
            proven = proof.proven_writes() if proof is not None else None
            await lists.record_list(plan.port, plan.write, self.digest, keys, proven)
        except EngineError as exc:
            log.info("map %s: its list could not be recorded for reruns (%s)",
                     plan.table_namespace, exc)
        except Exception:  # a bug here must not fail the run whose map already returned
            log.exception("map %s: recording its list for reruns failed", plan.table_namespace)
