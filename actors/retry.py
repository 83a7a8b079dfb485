"""Retrying idempotent store calls through transient faults.

How it works
- A run that raises is terminal: its guard retires its staged input, and a wake can no longer
  replay it. So a dropped connection must not end a map. Every store call the actors make on a
  run's behalf is idempotent by construction — admitting a page again re-admits the same rows
  under the same write version, an identical completion is a no-op, pages and seals are
  write-once, reads are reads — so the actors retry them.
- Retried: `StoreUnavailableError` (the connection failed; the call may or may not have been
  applied) and `TransactionStateUnknownError` (the rollback failed; same). Everything else
  (bad input, conflicts, retirement, a missing relation after repair) is raised at once, and so
  is `GatewayUnavailableError`: a gateway client has already retried through its own budgets.
- `RETRY_DELAYS` are the waits before attempts 2, 3, …; each is jittered to [d/2, d] so peers
  that failed together do not retry together. The waits are cancellable.
"""

from __future__ import annotations

import random
from typing import Awaitable, Callable, TypeVar

import trio

from runplane.engine.errors import (
    GatewayUnavailableError, StoreUnavailableError, TransactionStateUnknownError,
)

T = TypeVar("T")

RETRY_DELAYS = (0.05, 0.25, 1.0, 2.0)
TRANSIENT = (StoreUnavailableError, TransactionStateUnknownError)


async def retry_transient(operation: Callable[[], Awaitable[T]], *,
                          delays: tuple[float, ...] = RETRY_DELAYS) -> T:
    """`await operation()`, again after each delay while it fails transiently."""
    for delay in delays:
        try:
            return await operation()
        except GatewayUnavailableError:
            raise
        except TRANSIENT:
            await trio.sleep(delay / 2 + random.random() * delay / 2)
    return await operation()
