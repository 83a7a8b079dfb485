"""Driver errors into ours: which failures are outages, which the statement's own.

How it works
- `translate` maps an asyncpg or transport error to an `engine.errors` type, keeping the
  server's SQLSTATE; the caller chains the driver error with `from`. Nothing above `engine.pg`
  sees an asyncpg type.
- A connect refused for too many clients (53300) is retried like a refused one
  (`is_transient_connect_error`), then raised as an outage (`TenantUnreachableError`).
- Outages vs errors (`is_outage`): lost connections, shutdown/startup (57P0x) and a server gone
  read-only under a failover (25006) are outages, which runs retry within their budget; a
  statement timeout is one only when its connection dropped with it (or the server changed).
- `server_answered` and `unsent_state_error` tell the connection whether it is still idle and
  usable after a failed statement, and whether the driver refused a statement without sending
  it (see `engine.pg.connection`).

Pure decisions on exception values: no I/O.
"""

from __future__ import annotations

import asyncio

import asyncpg

from .pooler import pooler_hint
from ..errors import (
    DatabaseError,
    EngineError,
    InsufficientPrivilegeError,
    LockTimeoutError,
    MissingRelationError,
    StatementTimeoutError,
    StoreUnavailableError,
)

# SQLSTATEs that mean "the connection, not the statement, failed": retry on a fresh one.
TRANSIENT_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "08000", "08003", "08006", "08001", "08004"})
MISSING_RELATION_SQLSTATES = frozenset({"42P01", "42703"})
# A connect the server refused for want of room: too many clients (the server's or a role's
# connection limit, 53300), or out of resources (53000). Connections come back, so a connect is
# retried and, past its ladder, the failure is an outage ridden within the outage budget.
CROWDED_SQLSTATES = frozenset({"53300", "53000"})


# A promotion or failover in progress: the server went read-only under us (a demoted primary,
# or a standby reached before its promotion) — the writable server is coming, wait for it.
FAILOVER_SQLSTATES = frozenset({"25006"})
STATEMENT_TIMEOUT = "57014"


def is_outage(sqlstate: str | None, *, connection_lost: bool, server_changed: bool = False
              ) -> bool:
    """Whether a failed statement means the database is away (an outage: retried within the
    run's outage budget) rather than an error of the statement.

    Outages: the connection was lost or could not be made (08xxx, resets: `connection_lost`),
    the server is shutting down, crashing or starting (57P01/57P02/57P03), or it is read-only
    because a failover is under way (25006). A statement timeout (57014) is an outage only when
    the connection dropped with it or the server changed (another system identifier or
    postmaster start time) — a promotion cuts statements short — and otherwise the timeout it
    says. Everything else is the statement's own error."""
    if connection_lost or server_changed:
        return True
    return sqlstate in TRANSIENT_SQLSTATES or sqlstate in FAILOVER_SQLSTATES


def translate(exc: BaseException, *, connection_lost: bool = False,
              server_changed: bool = False) -> EngineError:
    """Map a driver or transport error to ours (the caller chains it with `from`);
    `connection_lost`: the connection was closed by the time the error arrived;
    `server_changed`: the DSN reaches another server than before (see `is_outage`)."""
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = getattr(exc, "sqlstate", None)
        message = f"{exc} (SQLSTATE {sqlstate})"
        lost = connection_lost or isinstance(exc, asyncpg.PostgresConnectionError)
        if is_outage(sqlstate, connection_lost=lost, server_changed=server_changed):
            if sqlstate == STATEMENT_TIMEOUT:
                message = (f"{message}; the server changed (failover or restart)"
                           if server_changed else f"{message}; the connection dropped with it")
            return StoreUnavailableError(message, sqlstate=sqlstate)
        if sqlstate in MISSING_RELATION_SQLSTATES:
            return MissingRelationError(message, sqlstate=sqlstate)
        if sqlstate == STATEMENT_TIMEOUT:
            return StatementTimeoutError(message, sqlstate=sqlstate)
        if sqlstate == "55P03":  # a lock wait past its lock_timeout: retryable
            return LockTimeoutError(message, sqlstate=sqlstate)
        if sqlstate == "42501":
            return InsufficientPrivilegeError(message, sqlstate=sqlstate)
        if sqlstate == "26000":  # a prepared statement the server connection lacks: a pooler
            return DatabaseError(pooler_hint(message) or message, sqlstate=sqlstate)
        return DatabaseError(message, sqlstate=sqlstate)
    if isinstance(exc, asyncpg.exceptions.DataError):
        return DatabaseError(f"cannot encode a query argument: {exc}")
    if isinstance(exc, (OSError, asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError,
                        asyncio.TimeoutError, ConnectionError)):
        return StoreUnavailableError(f"connection failed: {exc}")
    raise TypeError(f"not a driver error: {exc!r}")



def is_driver_error(exc: BaseException) -> bool:
    return isinstance(
        exc,
        (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError,
         OSError, asyncio.TimeoutError),
    )


def unsent_state_error(exc: BaseException, *, before_first_wait: bool) -> bool:
    """The driver refused a statement because of the connection's state, without executing it:
    a protocol-state error (raised when the driver tries to switch its protocol state, before it
    writes the statement; a parse/describe round trip may have preceded, which has no effect),
    or a closed-connection error raised before the statement's first wait."""
    if isinstance(exc, asyncpg.exceptions.InternalClientError):
        return str(exc).startswith("cannot switch to state")
    return before_first_wait and isinstance(exc, asyncpg.InterfaceError) and \
        not isinstance(exc, asyncpg.exceptions.DataError)


def server_answered(exc: BaseException) -> bool:
    """A statement error the server reported, after which the connection is idle again."""
    if isinstance(exc, asyncpg.exceptions.DataError):
        return True  # an argument failed to encode before anything was sent
    return (isinstance(exc, asyncpg.PostgresError)
            and not isinstance(exc, asyncpg.PostgresConnectionError)
            and getattr(exc, "sqlstate", None) not in TRANSIENT_SQLSTATES
            and getattr(exc, "sqlstate", None) not in FAILOVER_SQLSTATES)



def is_transient_connect_error(exc: BaseException) -> bool:
    """Connect failures worth another attempt: refused, reset, timed out, terminated, starting,
    too many clients (`CROWDED_SQLSTATES`)."""
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = getattr(exc, "sqlstate", None)
        return sqlstate in TRANSIENT_SQLSTATES or sqlstate in CROWDED_SQLSTATES
    if isinstance(exc, asyncpg.exceptions.TargetServerAttributeNotMatched):
        return True  # no host is writable yet: a failover is under way
    return isinstance(exc, (OSError, asyncio.TimeoutError, ConnectionError, asyncpg.InterfaceError))
