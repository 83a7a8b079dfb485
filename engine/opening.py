"""Opening a tenant: `open_tenant` for a runner, `open_reader` for reads only.

- Both check their input before anything connects (org, schema and role names, lanes, the
  outage budget, `RUNPLANE_IDLE_CLOSE_S`, the DSN and its pooler setting), open a `Tenant` on
  its own driver loop, start its diagnostics queue and its closing of idle connections, and
  close everything when the block ends, however it ends.
- `open_tenant` bootstraps (or upgrades) the schema unless `bootstrap=False`.
- A tenant opened inside `engine.limits.connections.hosting(budget)` (a process hosting many
  tenants: the gateway) takes a slot of that server budget for each connection it opens,
  this opening's included.
- `open_reader` connects to `RUNPLANE_READ_DSN` (a replica) when it is set, runs no DDL, and
  opens every transaction read-only, so a write fails at the server wherever the DSN points.
- Tenants opened inside `sharing(opening)` (a gateway's orgs: one schema on one server) read
  the schema's state and the server's identity once: the first opening reads them into the
  `SharedOpening`, and the openings after it take them without a statement.
- A tenant opened without a DSN where a tenants file places orgs (`PLACER`, set by
  `engine.placement.following.placed`) connects to its org's server and follows it there.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import urllib.parse
from typing import AsyncIterator, Callable, Iterator, Mapping, TypeGuard

import attrs
import trio

from . import pg
from .embedded import resolve_dsn
from .errors import EngineError, InvalidInputError
from .limits.bounds import is_number
from .limits.connections import current_budget
from .limits.inputs import MAX_IDENTIFIER_BYTES, MAX_NAME_BYTES, identifier_problem
from .pg.pooler import pooler_mode
from .tenant import (DEFAULT_LANES, DEFAULT_OUTAGE_BUDGET_S, IDLE_CLOSE_ENV, IDLE_CLOSE_S,
                     OUTAGE_BUDGET_ENV, READ_DSN_ENV, Route, Tenant)

# Where a tenant opened without a DSN connects while a tenants file places its org
# (`engine.placement.following.placed`): given the org, the DSN now and the route it follows.
Placer = Callable[[str], tuple[str, Route]]
PLACER: contextvars.ContextVar[Placer | None] = contextvars.ContextVar("runplane_placer",
                                                                      default=None)


@attrs.define(eq=False)
class SharedOpening:
    """What the tenants a process hosts on one server and schema find alike as they open: the
    lock secret of the (current) schema and the server's identity, once the first of them read
    both. Kept for the host's life, as its open tenants keep theirs: a schema upgraded, or
    dropped and made again with a new secret, under a running host is not seen by those
    either (restart the host). Never shared: a tenant with an execution role
    (its opening grants the role its privileges), a reader, or a login that may not read the
    lock secret (a database session)."""

    lock_secret: bytes | None = None
    server: str | None = None


_SHARED: contextvars.ContextVar[SharedOpening | None] = contextvars.ContextVar(
    "runplane_shared_opening", default=None)


@contextlib.contextmanager
def sharing(opening: SharedOpening) -> Iterator[None]:
    """Open the tenants of this block with `opening` (see `SharedOpening`)."""
    token = _SHARED.set(opening)
    try:
        yield
    finally:
        _SHARED.reset(token)


def outage_budget(value: object = None) -> float:
    """The outage budget in seconds: `value`, else `RUNPLANE_OUTAGE_BUDGET_S`, else 60.
    `InvalidInputError` unless it is a number >= 0 (0 ends a run at the first failed retry)."""
    source = "outage_budget_s"
    if value is None:
        value = os.environ.get(OUTAGE_BUDGET_ENV) or None
        source = OUTAGE_BUDGET_ENV
        if value is None:
            return DEFAULT_OUTAGE_BUDGET_S
        try:
            value = float(value)
        except ValueError:
            raise InvalidInputError(f"{OUTAGE_BUDGET_ENV} must be a number of seconds, "
                                    f"got {value!r}") from None
    if not is_number(value, 0, below=float("inf")):
        raise InvalidInputError(f"{source} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def check_dsn(dsn: str) -> None:
    """Refuse a DSN that cannot be parsed, with a reason that never quotes it (it may hold a
    password); called before any connection attempt."""
    if not isinstance(dsn, str) or not dsn.strip():
        raise InvalidInputError("the DSN is empty")
    if "://" not in dsn:
        return  # key=value form: the driver reports what it cannot use
    try:
        url = urllib.parse.urlsplit(dsn)
        url.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        reason = str(exc).split(" as ", 1)[0]  # "Port could not be cast ... as '<text>'"
        raise InvalidInputError(f"malformed DSN: {reason}") from None


def idle_close_seconds() -> float:
    """`RUNPLANE_IDLE_CLOSE_S` (a positive number of seconds), else `IDLE_CLOSE_S`."""
    given = os.environ.get(IDLE_CLOSE_ENV)
    if not given:
        return IDLE_CLOSE_S
    try:
        value = float(given)
    except ValueError:
        value = -1.0
    if not (0 < value < float("inf")):
        raise InvalidInputError(f"{IDLE_CLOSE_ENV} must be a positive number of seconds, "
                                f"got {given!r}")
    return value


def check_tenant_names(org_id: object, schema: object, execution_role: object) -> None:
    """`InvalidInputError` unless the org is an identifier and the schema and role names are
    PostgreSQL names kept exactly (at most 63 UTF-8 bytes: longer ones are truncated by the
    server, so two schemas would merge); see `engine.limits.inputs`."""
    for name, value, max_bytes in (
        ("org_id", org_id, MAX_IDENTIFIER_BYTES), ("schema", schema, MAX_NAME_BYTES),
        ("execution_role", execution_role, MAX_NAME_BYTES),
    ):
        if value is None and name == "execution_role":
            continue
        if not isinstance(value, str):
            raise InvalidInputError(f"{name} must be a string, got {type(value).__name__}")
        text = value.strip() if name == "org_id" else value
        problem = identifier_problem(text, max_bytes) or (
            None if text.strip() else "must not be blank")
        if problem is not None:
            raise InvalidInputError(f"{name} {problem}")


@contextlib.asynccontextmanager
async def open_tenant(
    org_id: str,
    dsn: str | None = None,
    *,
    schema: str = "runplane",
    max_connections: int = 8,
    lanes: Mapping[str, int] | None = None,
    execution_role: str | None = None,
    bootstrap: bool = True,
    outage_budget_s: float | None = None,
) -> AsyncIterator[Tenant]:
    """Open a tenant: connect (fail fast), bootstrap the schema, yield the tenant, close the pool.

    `dsn=None` uses `RUNPLANE_DSN`, else the embedded server (started on first use).
    `bootstrap=False` (read-only callers) runs no DDL at all: the schema is neither created nor
    upgraded nor repaired (`repair_schema` raises `SchemaNotFoundError`); the caller checks
    `schema.schema_status` itself.
    `outage_budget_s` (default `RUNPLANE_OUTAGE_BUDGET_S`, else 60) bounds how long runs on this
    tenant ride out a store outage (see `actors.retry`); opening itself fails fast.
    """
    async with _open(_Opening(org_id, dsn, schema, max_connections, lanes, execution_role,
                              bootstrap, outage_budget_s)) as tenant:
        yield tenant


@contextlib.asynccontextmanager
async def open_reader(org_id: str, dsn: str | None = None, *, schema: str = "runplane",
                      max_connections: int = 8, lanes: Mapping[str, int] | None = None,
                      ) -> AsyncIterator[Tenant]:
    """A tenant for reads only: on `RUNPLANE_READ_DSN` (a replica) when it is set, else where
    `open_tenant` would connect. It runs no DDL (as `bootstrap=False`) and every transaction of
    its connections is read-only, so a write fails at the server (SQLSTATE 25006) wherever the
    DSN points. `replay_lag_s()` tells how far behind a replica is."""
    read_dsn = os.environ.get(READ_DSN_ENV) or dsn
    async with _open(_Opening(org_id, read_dsn, schema, max_connections, lanes, None, False,
                              None, read_only=True)) as tenant:
        yield tenant


def reads_replica(port: object) -> TypeGuard[Tenant]:
    """Whether `port` is a reader `open_reader` opened on `RUNPLANE_READ_DSN` (a replica, as
    far as the setting says: `replay_lag_s()` tells whether the server is one)."""
    return isinstance(port, Tenant) and port.read_only and bool(os.environ.get(READ_DSN_ENV))


@attrs.frozen
class _Opening:
    """What `open_tenant` and `open_reader` were asked for."""

    org_id: str
    dsn: str | None
    schema: str
    max_connections: int
    lanes: Mapping[str, int] | None
    execution_role: str | None
    bootstrap: bool
    outage_budget_s: float | None
    read_only: bool = False


@contextlib.asynccontextmanager
async def _open(how: _Opening) -> AsyncIterator[Tenant]:
    check_tenant_names(how.org_id, how.schema, how.execution_role)
    if how.max_connections < 1:
        raise InvalidInputError("max_connections must be at least 1")
    budget = outage_budget(how.outage_budget_s)
    lane_limits = dict(DEFAULT_LANES if how.lanes is None else how.lanes)
    for name, limit in lane_limits.items():
        if not isinstance(limit, int) or limit < 1:
            raise InvalidInputError(f"lane {name!r} needs a positive integer limit, got {limit!r}")
    idle_close_s = idle_close_seconds()
    placer = PLACER.get() if how.dsn is None else None
    placed = None if placer is None else placer(how.org_id.strip())
    resolved = (how.dsn or (placed[0] if placed else None) or os.environ.get("RUNPLANE_DSN")
                or await resolve_dsn())
    check_dsn(resolved)
    pooler_mode(resolved)  # a bad pooler setting is refused before anything connects
    async with pg.open_driver() as driver:
        tenant = Tenant(
            org_id=how.org_id.strip(),
            schema=how.schema,
            dsn=resolved,
            driver=driver,
            execution_role=how.execution_role,
            max_connections=how.max_connections,
            bootstrap=how.bootstrap,
            outage_budget_s=budget,
            lanes=lane_limits,
            idle_close_s=idle_close_s,
            read_only=how.read_only,
            budget=current_budget(),
        )
        tenant.route = None if placed is None else placed[1]
        tenant.diagnostics.open()
        tenant.start_closing_idle()
        try:
            shared = _SHARED.get() if how.bootstrap and how.execution_role is None else None
            if shared is not None and shared.lock_secret is not None:
                tenant.take_opening(shared.lock_secret, shared.server)
            else:
                if how.bootstrap:
                    await tenant.ensure_schema()
                with contextlib.suppress(EngineError):  # best effort: only statement timeouts use it
                    await tenant.note_server()
                if shared is not None and tenant.lock_secret is not None:
                    shared.lock_secret, shared.server = tenant.lock_secret, tenant.server_identity
            yield tenant
        finally:
            with trio.CancelScope(shield=True):
                await tenant.diagnostics.close()
                await tenant.aclose()


__all__ = ["open_tenant", "open_reader", "reads_replica", "outage_budget", "check_dsn",
           "SharedOpening", "sharing"]
