"""Our trio adapter over asyncpg: the only package that imports asyncpg or trio_asyncio.

How it works
- `bridge`: asyncpg runs on a trio-asyncio loop; `Driver` runs its coroutines from trio tasks,
  opens connections (`connects_until` keeps a run's outage budget) and closes them without
  ever raising.
- `connection`: a `Connection` is one checked-out driver connection, in a known state, with
  asyncpg's transaction model, a statement hook for tests and simulations, stale-connection
  replacement on a checkout's first statement and lost-COMMIT resolution.
- `translation`: every driver error is translated into `engine.errors` with its SQLSTATE kept,
  so nothing above this package sees an asyncpg type; `is_outage` says which failures are
  outages (retried within a run's outage budget) rather than the statement's own errors.

Import the names below from `engine.pg`; the submodules are its inside.
"""

from __future__ import annotations

from .bridge import (
    CONNECT_TIMEOUT,
    PINNED_SEARCH_PATH,
    Driver,
    LoopCancelledError,
    NotSent,
    close_gracefully,
    ConnectWatch,
    connect_timeout,
    connects_until,
    ladder_delay,
    reset_connect_watch,
    watch_connects,
    open_driver,
    reached_locally,
    terminate,
)
from .connection import (
    COMMIT_RESOLVE_TIMEOUT,
    COMMIT_TIMEOUT,
    ROLLBACK_TIMEOUT,
    SERVER_CHANGE_PROBE_TIMEOUT,
    SERVER_IDENTITY,
    SERVER_START,
    XID_PROBE,
    CommitStatus,
    Connection,
    ConnectionState,
    PhaseReport,
    RawConnection,
    Reconnect,
    Record,
    ServerChanged,
    StatementHook,
)
from .translation import (
    CROWDED_SQLSTATES,
    FAILOVER_SQLSTATES,
    MISSING_RELATION_SQLSTATES,
    STATEMENT_TIMEOUT,
    TRANSIENT_SQLSTATES,
    is_outage,
    is_transient_connect_error,
    translate,
)

__all__ = [
    "CONNECT_TIMEOUT", "PINNED_SEARCH_PATH", "Driver", "LoopCancelledError", "NotSent",
    "close_gracefully", "ConnectWatch", "connect_timeout", "connects_until", "watch_connects", "reset_connect_watch", "ladder_delay", "open_driver",
    "reached_locally", "terminate",
    "COMMIT_RESOLVE_TIMEOUT", "COMMIT_TIMEOUT", "ROLLBACK_TIMEOUT", "SERVER_CHANGE_PROBE_TIMEOUT",
    "SERVER_IDENTITY", "SERVER_START", "XID_PROBE", "CommitStatus", "Connection", "ConnectionState", "PhaseReport",
    "RawConnection", "Reconnect", "Record", "ServerChanged", "StatementHook",
    "CROWDED_SQLSTATES", "FAILOVER_SQLSTATES", "MISSING_RELATION_SQLSTATES", "STATEMENT_TIMEOUT", "TRANSIENT_SQLSTATES",
    "is_outage", "is_transient_connect_error", "translate",
]
