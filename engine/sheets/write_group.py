"""A map's own sheet writes overlapping: the write group of one plain writer.

Why: a map's admissions and completions are sheet write transactions, and an ordinary sheet
transaction holds its sheet's lock (the summary row) exclusively from its lock statement to
COMMIT, so one map's writes take turns even though they touch different rows: a streamed map
held the lock 90 % of its time with the two cores 65 % busy (docs/guide/benchmarks.md, the
twentieth pass). Letting the map's own transactions overlap, and nobody else's, keeps both
cores busy.

How it works
- A `WriteGroup` is the writes of one plain writer of one sheet in one process: one run
  incarnation (run id and epoch) writing one sheet through one port, without a unit guard, an
  attempt or `force` (`group_for`). It knows its transactions in flight (their row keys, and
  whether each is ordinary) and its token: the sheet's `writes` value its last ordinary
  transaction left (`sheet_txn`: every ordinary writer adds one to it under the lock).
- `enter` decides how a transaction goes (`Turn`): *in the group* — the summary row held
  `FOR SHARE`, its counters added as deltas (`counters`), exactly as a shared map's concurrent
  writers do — when the group has a token, another of its transactions is in flight (or its
  own ordinary one just finished: it waited for that one's token), no transaction of the group
  in flight shares a row key with it, and fewer than `ORDINARY_EVERY` group transactions ran
  since the last ordinary one; *ordinary* otherwise. It never decides while an ordinary
  transaction of the group is in flight: it waits for that one first (its token is the next).
- The lock statement of a transaction in the group (`sheet_txn`) claims the summary row only if
  `writes` still equals the token and no shared map of the sheet is waiting or open; otherwise
  the transaction goes the ordinary way (`leave` with `committed=False`, then `enter` again
  with `ordinary=True`). So the group's transactions overlap only one another:
  - any other ordinary writer adds one to `writes` (the group's token no longer holds), and
    waits for the group's holders of the row, since its lock conflicts with `FOR SHARE`;
  - another group of the same sheet has another token (each value of `writes` is left by one
    transaction, so by one group);
  - a shared map's writers, which hold the row `FOR SHARE` with no token, write only while
    their map is open, and opening or closing a shared map adds one to its sheet's `writes`
    under the row's lock (`engine.shared.maps.set_state`);
  - the group's own transactions in flight never share a row (keys checked here), so no two
    of its statements wait on one another's rows or change a row another reads.
- Every `ORDINARY_EVERY` group transactions one goes the ordinary way: overlapping holders
  would otherwise keep another writer's lock waiting for as long as they keep overlapping. An
  ordinary transaction folds the deltas it finds (`counters`); a list map folds its group's
  deltas before it records the list (`actors.list_replay`), whose statement wants none.
- Groups live in a per-port table of at most `MAX_GROUPS`, the least recently used dropped
  first (a gateway serves many clients' maps and is not told when one ends): a group dropped
  or new only starts with an ordinary transaction.
This module does no I/O (`sheet_txn` runs the transactions).
"""

from __future__ import annotations

import collections
import enum
import weakref
from typing import Iterable

import attrs
import trio

from ..ports import Port
from .sheet_write import SheetWrite
from .write_ledger import kept_ledger

ORDINARY_EVERY = 16  # group transactions between two ordinary ones, at most
MAX_GROUPS = 1024    # write groups kept a port


class Turn(enum.Enum):
    ORDINARY = "ordinary"
    GROUP = "group"


@attrs.define(eq=False)
class GroupTxn:
    """One transaction of a group, from `enter` to `leave`."""

    keys: frozenset[str]
    turn: Turn
    token: int | None  # the `writes` value a group transaction's lock statement expects
    done: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class WriteGroup:
    """The sheet writes of one plain writer in one process (module docstring)."""

    token: int | None = None
    in_flight: list[GroupTxn] = attrs.field(factory=list)
    since_ordinary: int = 0     # group transactions committed since the last ordinary one
    overlapped: int = 0         # transactions committed in the group (telemetry, tests)
    waiting: int = 0            # entrants waiting for the group's ordinary transaction

    @property
    def deltas(self) -> bool:
        """Whether the group left counter deltas its next ordinary transaction folds."""
        return self.since_ordinary > 0

    async def enter(self, keys: Iterable[str], *, ordinary: bool = False) -> GroupTxn:
        """Decide how the next transaction goes (module docstring)."""
        keys = frozenset(keys)
        waited = False
        while True:
            own = next((t for t in self.in_flight if t.turn is Turn.ORDINARY), None)
            if own is None:
                break
            self.waiting += 1
            try:
                await own.done.wait()
            finally:
                self.waiting -= 1
            waited = True
        in_group = (not ordinary and self.token is not None
                    and (waited or bool(self.in_flight))
                    and self.since_ordinary < ORDINARY_EVERY
                    and not any(keys & t.keys for t in self.in_flight))
        txn = GroupTxn(keys, Turn.GROUP if in_group else Turn.ORDINARY,
                       self.token if in_group else None)
        self.in_flight.append(txn)
        return txn

    def leave(self, txn: GroupTxn, *, committed: bool, writes: int | None = None) -> None:
        """`txn` ended: committed (an ordinary one leaving `writes`), or not."""
        self.in_flight.remove(txn)
        txn.done.set()
        if not committed:
            if txn.turn is Turn.ORDINARY:
                self.token = None  # what it left, if anything, is not known
            return
        if txn.turn is Turn.ORDINARY:
            self.token, self.since_ordinary = writes, 0
        else:
            self.since_ordinary += 1
            self.overlapped += 1


_GROUPS: weakref.WeakKeyDictionary[object, collections.OrderedDict] = \
    weakref.WeakKeyDictionary()


_REFUSED: weakref.WeakSet[object] = weakref.WeakSet()


def refuse_groups(port: object) -> None:
    """`port`'s login may not write as a group does (a database session minted before session
    roles held INSERT on the delta tables and SELECT on `shared_maps`): none of its writes
    joins a group from now on."""
    _REFUSED.add(port)


def group_of(port: object, identity: tuple) -> WriteGroup:
    """The write group of `identity` on `port` (made when missing; see `MAX_GROUPS`)."""
    groups = _GROUPS.get(port)
    if groups is None:
        groups = _GROUPS[port] = collections.OrderedDict()
    group = groups.get(identity)
    if group is None:
        group = groups[identity] = WriteGroup()
        while len(groups) > MAX_GROUPS:
            groups.popitem(last=False)
    else:
        groups.move_to_end(identity)
    return group


def group_for(port: Port, sheet: tuple[str, str, str], write: SheetWrite, *,
              guarded: bool) -> WriteGroup | None:
    """The write group of `write` to `sheet` (its counter arguments) through `port`: its run
    incarnation's. None when the write may not join one: `guarded` (a unit guard, a prelude,
    a forced failure), not `write.plain` (an attempt, `force`), or a port that may not add
    deltas (a database session minted before sessions could: `refuse_groups`). A map keeping
    a write ledger of the sheet (a list map) has a group of its own, kept on the ledger: the
    deltas the ledger excuses are then its own map's."""
    if guarded or not write.plain or port in _REFUSED:
        return None
    ledger = kept_ledger(sheet)
    if ledger is not None:
        if ledger.group is None:
            ledger.group = WriteGroup()
        return ledger.group  # type: ignore[return-value]
    return group_of(port, (sheet, write.run.run_id, write.run.epoch))
