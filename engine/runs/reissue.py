"""Re-issuing a statement until the row it decides on is visible (a bounded number of times).

How it works
- Under READ COMMITTED a statement reads the snapshot taken when it starts. A statement that
  inserts a row if absent (`INSERT … ON CONFLICT …`) and otherwise reads the stored row can find
  neither when a peer inserted that row and committed after our snapshot was taken: the insert
  meets the conflict and does nothing, and the read, using the older snapshot, sees nothing.
  Issuing the statement again takes a fresh snapshot that sees the peer's row.
- `fetchrow_until_visible(conn, sql, args, decide)` issues `sql` and hands the row (None when it
  returned none) to `decide`, which returns the outcome or raises `NotVisible` when the row it
  needs is not visible yet; without `decide`, a missing row is that case. It issues the statement
  at most `MAX_VISIBILITY_ATTEMPTS` times, then raises `RowNotVisibleError`: a row that a peer
  keeps inserting and deleting between our statements must not keep us looping forever.
- Every statement of this kind goes through here: `engine.receipts`, `engine.runs` and the
  array-input facts (`engine.array_input`).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from ..errors import RowNotVisibleError
from ..pg import Connection, Record

T = TypeVar("T")

MAX_VISIBILITY_ATTEMPTS = 16


class NotVisible(Exception):
    """Raised by a `decide` callback: a peer committed the row after our snapshot; issue again."""


def _present(row: Record | None) -> Record:
    if row is None:
        raise NotVisible
    return row


async def fetchrow_until_visible(
    conn: Connection,
    sql: str,
    args: tuple[object, ...],
    decide: Callable[[Record | None], T] = _present,
    *,
    what: str,
) -> T:
    """`decide(await conn.fetchrow(sql, *args))`, re-issued while `decide` raises `NotVisible`.

    `what` names the row in the `RowNotVisibleError` raised after `MAX_VISIBILITY_ATTEMPTS`.
    """
    for _ in range(MAX_VISIBILITY_ATTEMPTS):
        row = await conn.fetchrow(sql, *args)
        try:
            return decide(row)
        except NotVisible:
            continue
    raise RowNotVisibleError(
        f"{what} kept changing under a concurrent writer "
        f"({MAX_VISIBILITY_ATTEMPTS} attempts); retry"
    )
