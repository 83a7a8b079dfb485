"""The engine's error hierarchy.

One root, `EngineError`. Subclasses split by blame (caller input, durable state, the store) and
by whether a retry can help. Driver errors never escape `engine.pg`: they are translated into
`DatabaseError` subclasses that keep the server's SQLSTATE.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class EngineError(Exception):
    """Root of every error runplane raises on purpose."""


class ScopeError(EngineError):
    """A scope part is empty, or a scope names another org than the port serves.

    Raised before any query; a retry with the same arguments fails the same way.
    """


class InvalidInputError(EngineError):
    """Caller input is malformed: the message names the offending field or path.

    Raised before any query, so nothing was written.
    """


class RetiredError(EngineError):
    """The run's array inputs were retired: the run guard refuses every later write and read."""


class ConflictError(EngineError):
    """Durable state disagrees with the request (a source changed after staging began, a
    different page at an ordinal already written). Retrying the same request cannot help."""


class RowNotVisibleError(ConflictError):
    """A statement that inserts a row if absent and else reads it found neither, every time it
    was issued (`engine.runs.reissue.MAX_VISIBILITY_ATTEMPTS`): a concurrent writer kept
    inserting and removing the row between our snapshots. Every such statement is idempotent, so unlike other
    conflicts the same request issued again later can succeed."""


class LeaseLostError(ConflictError):
    """A shared map's unit is no longer held by the caller (its lease expired and another
    worker took it over, or the map was cancelled or closed): the caller's completion of that
    unit was rolled back, and the unit's rows are the new holder's."""


class CorruptFactError(EngineError):
    """A stored fact is missing, malformed, or fails its digest check."""


class DatabaseError(EngineError):
    """The server rejected a statement. `sqlstate` holds the five-character SQLSTATE (or None)."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class MissingRelationError(DatabaseError):
    """A relation or column is missing (SQLSTATE 42P01 / 42703): the schema may need repair."""


class InsufficientPrivilegeError(DatabaseError):
    """The login may not run a statement (SQLSTATE 42501): typically a scoped database session
    reaching for DDL or for data outside its grants. Retrying cannot help."""


class StatementTimeoutError(DatabaseError):
    """A statement ran past its statement timeout (SQLSTATE 57014) and was cancelled."""


class StoreUnavailableError(DatabaseError):
    """The connection to the store failed or was lost mid-operation (a transient fault).

    The operation did not complete; retrying on a fresh connection may succeed.
    """


class LockTimeoutError(StoreUnavailableError):
    """A statement waited for a lock past its bound (SQLSTATE 55P03) and gave up: nothing it
    would have done was applied, and a retry later may succeed."""


class GatewayUnavailableError(StoreUnavailableError):
    """A gateway could not be reached, or kept answering with a retryable failure, until one of
    the client's retry budgets ran out (the message says which, and the gateway's URL; never
    the token). The operation may or may not have been applied; every action is idempotent."""


class TenantUnavailableError(EngineError):
    """The tenant database could not be reached when opening the tenant or connecting.

    The message names the host, never the password.
    """


class TenantUnreachableError(TenantUnavailableError, StoreUnavailableError):
    """A connect failed transiently (refused, reset, timed out, the server shutting down or
    starting up) on every attempt of the connect ladder.

    Both a `TenantUnavailableError` (one connect failed) and a `StoreUnavailableError` (the
    store is out of reach, a retry later may succeed): layers that ride out outages retry it."""


class StoreOutageError(StoreUnavailableError):
    """The store stayed out of reach for longer than the outage budget
    (`open_tenant(..., outage_budget_s=...)`, `RUNPLANE_OUTAGE_BUDGET_S`): the operation was
    retried meanwhile and never succeeded. `waited_s` is how long it was retried, `budget_s` the
    budget. Not retried again by outer layers; a run that ends with it keeps its staged input,
    and a wake finishes it."""

    def __init__(self, message: str, *, waited_s: float = 0.0, budget_s: float = 0.0,
                 sqlstate: str | None = None) -> None:
        super().__init__(message, sqlstate=sqlstate)
        self.waited_s = waited_s
        self.budget_s = budget_s


class SchemaNotFoundError(EngineError):
    """A tenant opened without bootstrap (`open_tenant(..., bootstrap=False)`, as read-only
    commands open it) met a schema without runplane's tables. Nothing was created."""


class TransactionStateUnknownError(EngineError):
    """An operation failed inside a transaction and its ROLLBACK failed or timed out.

    The connection was closed rather than pooled. `error` is the operation's failure and
    `rollback_error` the rollback's. Never retried automatically: the caller decides.
    """

    def __init__(self, message: str, *, error: BaseException, rollback_error: BaseException) -> None:
        super().__init__(message)
        self.error = error
        self.rollback_error = rollback_error


class RollbackFailedError(TransactionStateUnknownError):
    """The state is unknown because the ROLLBACK after a failed operation failed or timed out
    on a live connection (not because a COMMIT's reply was lost; a connection lost during the
    ROLLBACK is `StoreUnavailableError`, the server having rolled back). Never retried: what the failed operation left is
    not known, so the caller decides (the actors raise it at once)."""


class AuthError(EngineError):
    """A gateway refused the token: missing, malformed, badly signed or expired (HTTP 401)."""


class TooManySessionsError(EngineError):
    """The org already holds as many live database sessions as the server allows (HTTP 429).
    `retry_after_s` is how long until the oldest of them expires."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ArrayInputUnavailableError(EngineError):
    """The gateway has no array-input actions (started with `--no-array-actions`, or older).

    `run.map` over a list then admits the list directly instead of staging it."""


PUBLIC_NAMES = frozenset({
    "EngineError", "ScopeError", "InvalidInputError", "RetiredError", "ConflictError",
    "CorruptFactError", "StoreUnavailableError", "TenantUnavailableError",
    "TransactionStateUnknownError", "RollbackFailedError", "AuthError", "GatewayUnavailableError",
    "ArrayInputUnavailableError", "TooManySessionsError",
})


def public_name(exc: BaseException) -> str:
    """The name of the nearest public class of an engine error, for messages: a
    `TenantUnreachableError` reads as `TenantUnavailableError`, a `StoreOutageError` as
    `StoreUnavailableError`; other exceptions keep their own name."""
    for cls in type(exc).__mro__:
        if cls.__name__ in PUBLIC_NAMES and cls.__module__ == __name__:
            return cls.__name__
    return type(exc).__name__


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, depth first, in the groups' order; an
    exception that is not a group is its own only leaf.

    Nurseries and `trio_asyncio.open_loop` wrap what escapes them in groups; callers unwrap a
    lone leaf at their public boundary so their callers catch one typed error.
    """
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    return [leaf for inner in exc.exceptions for leaf in leaf_errors(inner)]


@contextlib.contextmanager
def unwrap_single_error(kind: type[BaseException] = BaseException) -> Iterator[None]:
    """Let a lone error of `kind` out of the block's (nested) exception groups as itself, so
    callers can catch one typed error (its own cause kept); a group of several errors, or of
    one error of another kind, passes unchanged."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = leaf_errors(group)
        if len(leaves) == 1 and isinstance(leaves[0], kind):
            raise leaves[0] from leaves[0].__cause__
        raise
