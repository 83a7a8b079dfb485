"""Tenants: a connection pool behind lanes of permits, over one tenant PostgreSQL schema.

How it works
- `tenant.connection(lane)` takes a permit on the lane, then one of the tenant's
  `max_connections` permits (both FIFO and cancellable), then an idle pooled connection or a new
  one. Holding a tenant permit guarantees a connection slot, so the pool is just a stack of idle
  connections. Lanes bound how much of the tenant one kind of work may hold: background
  retirement can never starve foreground sheet or receipt work.
- Physical connects take at most `CONNECT_TIMEOUT` each; transient failures are retried after
  250, 750 and 1500 ms, then raise `TenantUnreachableError` (a `TenantUnavailableError` that is
  also a `StoreUnavailableError`, so layers that ride out outages retry it); anything else fails
  at once with a plain `TenantUnavailableError`. Both name the host, never the password.
- `outage_budget_s` (default `RUNPLANE_OUTAGE_BUDGET_S`, else 60 s) is how long the actors keep
  retrying an operation through a store outage before the run ends with `StoreOutageError`
  (see `actors.retry`); the connect ladder above bounds one connect, the budget a whole
  operation.
- A connection whose first statement the driver refuses unsent (stale: its backend ended while
  it was idle) is replaced by a fresh one (`engine.pg`); a lost COMMIT reply is resolved with
  `commit_status` on a fresh connection.
- With an `execution_role`, or through a transaction-mode pooler (`engine.pg.pooler`), each
  checkout opens a transaction and runs `SET LOCAL ROLE` / `SET LOCAL search_path` before the
  caller sees the connection; the checkout commits on a clean exit and rolls back otherwise, so
  operations inside use savepoints (`outer_transaction` is true).
- A connection that `engine.pg` marked broken (cancelled query, lost connection, failed
  rollback) is closed at release, never pooled.
- Physical connections live in a `engine.pool.ConnectionPool`: a pooled connection idle
  `idle_close_s` (15 s; `RUNPLANE_IDLE_CLOSE_S`) is closed by a task the tenant owns, so an idle
  process holds none of the server's connections. With a `budget` (a process hosting many
  tenants: `engine.limits.connections`), every connection the tenant opens takes a slot of
  that server budget first, waiting in its fair line past it.
- With a `route` (its org placed by a tenants file: `engine.placement.following`), each checkout
  and connect first asks where the org lives now; after a move (`moved_to`) new connections go
  to the new server and the old server's close (idle ones at once, checked-out ones at release).
- `tenant.diagnostics` is the tenant's queue of completion diagnostics for sinks, drained by a
  task the tenant owns from open to close (`engine.diagnostics`): a sink never delays a write.
- A tenant is opened by `engine.opening` (`open_tenant`, `open_reader`).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, AsyncIterator, Mapping, Protocol

import attrs
import trio

from . import lock_keys, pg, schema as schema_ddl
from .diagnostics import DiagnosticsQueue
from .dsn_text import describe_dsn
from .limits.connections import ServerBudget
from .errors import (
    EngineError,
    InsufficientPrivilegeError,
    InvalidInputError,
    SchemaNotFoundError,
    StoreUnavailableError,
    TenantUnavailableError,
    TenantUnreachableError,
)
from .permits import PermitStats, Permits
from .pool import ConnectionPool
from .pg.pooler import PoolerMode, pooler_hint, pooler_mode
from .ports import CONSOLE_LANE, RECEIPTS_LANE, RETIREMENT_LANE, SHEET_LANE, PortSettings
from .sql import quote_ident

DEFAULT_LANES: Mapping[str, int] = {SHEET_LANE: 6, RECEIPTS_LANE: 6, RETIREMENT_LANE: 2,
                                     CONSOLE_LANE: 2}
CONNECT_RETRY_DELAYS = (0.25, 0.75, 1.5)
MAX_IDLE_CONNECTIONS_CLOSED_AT_EXIT_TIMEOUT = 2.0
DEFAULT_OUTAGE_BUDGET_S = 60.0
OUTAGE_BUDGET_ENV = "RUNPLANE_OUTAGE_BUDGET_S"
# A pooled connection idle this long is closed, so an idle process holds none of the server's
# connections (managed servers cap them); `RUNPLANE_IDLE_CLOSE_S` sets another.
IDLE_CLOSE_S = 15.0
IDLE_CLOSE_ENV = "RUNPLANE_IDLE_CLOSE_S"
READ_DSN_ENV = "RUNPLANE_READ_DSN"  # where `open_reader` reads (a replica)
_REPLAY_LAG = """
SELECT CASE WHEN NOT pg_catalog.pg_is_in_recovery() THEN NULL
            WHEN pg_catalog.pg_last_wal_receive_lsn() = pg_catalog.pg_last_wal_replay_lsn() THEN 0
            ELSE extract(epoch FROM now() - pg_catalog.pg_last_xact_replay_timestamp()) END
"""
COMMIT_STATUS_POLL_S = 0.05  # while a lost COMMIT's transaction is still "in progress"


class Route(Protocol):
    """Where a tenant's org lives now (`engine.placement.following`): asked before each checkout
    and connect, told of each new connection, asked whether one may be pooled again."""

    def follow(self, tenant: "Tenant") -> None: ...

    async def opened(self, tenant: "Tenant", raw: Any, dsn: str) -> None: ...

    def current(self, tenant: "Tenant", raw: Any) -> bool: ...

    @property
    def tenants_file(self) -> str | None: ...


@attrs.define(eq=False)
class Tenant:
    """One org's store. Implements `engine.Port`. Build it with `open_tenant`."""

    org_id: str
    schema: str
    dsn: str = attrs.field(repr=False)
    driver: pg.Driver = attrs.field(repr=False)
    execution_role: str | None = None
    max_connections: int = 8
    bootstrap: bool = True
    outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S
    lanes: Mapping[str, int] = attrs.field(factory=lambda: dict(DEFAULT_LANES))
    diagnostics: DiagnosticsQueue = attrs.field(factory=DiagnosticsQueue)
    _lane_permits: dict[str, Permits] = attrs.field(init=False)
    _connection_permits: Permits = attrs.field(init=False)
    idle_close_s: float = IDLE_CLOSE_S
    # Every transaction read-only (`open_reader`): a write fails at the server.
    read_only: bool = False
    # The server budget this tenant's connections take slots of (None: no budget).
    budget: ServerBudget | None = attrs.field(default=None, repr=False)
    _pool: ConnectionPool = attrs.field(init=False, repr=False)
    _closed: bool = attrs.field(init=False, default=False)
    # What sheet advisory-lock keys are derived from (`engine.schema.lock_material`).
    lock_secret: bytes | None = attrs.field(init=False, default=None, repr=False)
    sheet_lock_keys: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)
    _server: str | None = attrs.field(init=False, default=None)  # pg.SERVER_IDENTITY at open
    # The port's settings, rebuilt when `ensure_schema` reads the lock material.
    settings: PortSettings = attrs.field(init=False)
    # A transaction-mode pooler in front (`engine.pg.pooler`), and what each checkout's
    # transaction runs first (None: checkouts open no transaction of their own).
    pooler: PoolerMode = attrs.field(init=False)
    _checkout_setup: str | None = attrs.field(init=False, default=None, repr=False)
    # Where the org lives now, when a tenants file places it (None: `dsn`, always).
    route: Route | None = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._lane_permits = {name: Permits(name, limit) for name, limit in self.lanes.items()}
        self._connection_permits = Permits("connections", self.max_connections)
        self.pooler = pooler_mode(self.dsn)
        # Tenants whose connections are alike (DSN, startup settings, loop) may pass them on.
        key = (self.dsn, tuple(sorted(self._startup.items())), id(self.driver.loop))
        account = None if self.budget is None else self.budget.account(self.org_id, key)
        self._pool = ConnectionPool(self.driver, self._connect, self.idle_close_s, account)
        setup = []
        if self.pooler is PoolerMode.TRANSACTION:
            setup.append(f"SET LOCAL search_path TO {pg.PINNED_SEARCH_PATH}")
            if self.read_only:  # no startup parameters through the pooler
                setup.append("SET LOCAL transaction_read_only = on")
        if self.execution_role is not None:
            setup.append(f"SET LOCAL ROLE {quote_ident(self.execution_role)}")
        self._checkout_setup = "; ".join(setup) or None
        self.settings = self._settings()

    @property
    def _startup(self) -> dict[str, str]:
        settings = {"application_name": "runplane"}
        if self.read_only and self.pooler is PoolerMode.NONE:  # through a pooler: per checkout
            settings["default_transaction_read_only"] = "on"
        return settings

    async def replay_lag_s(self) -> float | None:
        """How far the server replays behind its primary, in seconds (0 when it has replayed
        all it received); None when it is no replica."""
        async with self._plain_connection() as conn:
            lag = await conn.fetchval(_REPLAY_LAG)
        return None if lag is None else max(float(lag), 0.0)

    def _settings(self) -> PortSettings:
        """This tenant's `PortSettings`: confined to no plays (a gateway token may be)."""
        return PortSettings(
            self.schema, outer_transaction=self.outer_transaction,
            outage_budget_s=self.outage_budget_s, lock_secret=self.lock_secret,
            sheet_lock_keys=types.MappingProxyType(dict(self.sheet_lock_keys)),
            diagnostics=self.diagnostics, dsn=self.dsn,
            tenants_file=None if self.route is None else self.route.tenants_file)

    @property
    def outer_transaction(self) -> bool:
        """Every checkout runs inside a transaction: under an execution role, or through a
        transaction-mode pooler."""
        return self._checkout_setup is not None

    @property
    def host(self) -> str:
        return describe_dsn(self.dsn)

    def permits(self) -> dict[str, PermitStats]:
        """Telemetry per lane, plus `connections` for the tenant-wide cap."""
        stats = {name: permits.stats() for name, permits in self._lane_permits.items()}
        stats["connections"] = self._connection_permits.stats()
        return stats

    # -- checkouts -------------------------------------------------------------------------
    def connection(self, lane: str) -> "Checkout":
        """An async context manager: lane permit, then tenant permit, then a connection."""
        try:
            lane_permits = self._lane_permits[lane]
        except KeyError:
            raise InvalidInputError(
                f"unknown lane {lane!r}; lanes are {sorted(self._lane_permits)}"
            ) from None
        return Checkout(self, lane_permits)

    @property
    def _idle(self) -> list[tuple[float, Any]]:
        """Pooled connections, by when they were returned (trio time), the newest last."""
        return self._pool.idle

    async def _checkout(self) -> pg.Connection:
        """An idle pooled connection or a new one (replaced on its first statement if stale)."""
        if self.route is not None:
            self.route.follow(self)
        raw = await self._pool.take()
        status = (self.commit_status if self.route is None
                  else functools.partial(self.commit_status, on=self.dsn))
        return pg.Connection(raw, self.driver, reconnect=self._connect, commit_status=status,
                             server_changed=self.server_changed)

    async def commit_status(self, xid: str, on: str | None = None) -> str | None:
        """The fate of transaction `xid` (`committed`, `aborted`, or None when the server no
        longer knows it), read on a fresh connection once it is no longer `in progress` (a
        backend whose client vanished finishes or aborts its transaction on its own). `on`:
        the DSN it ran on; once the org moved away from it (`route`), its fate is not read on
        another server (an error: the outcome stays unknown and the operation is retried)."""
        if on is not None and on != self.dsn:
            raise StoreUnavailableError("the org moved to another server during the COMMIT")
        raw = await self._pool.extra()
        try:
            conn = pg.Connection(raw, self.driver)
            while True:
                status = await conn.fetchval("SELECT txid_status($1::bigint)", int(xid))
                if status != "in progress":
                    return status
                await trio.sleep(COMMIT_STATUS_POLL_S)
        finally:
            await self._pool.close_extra(raw)

    async def note_server(self) -> None:
        """Remember which server the DSN reaches now (see `server_changed`): read at open, on a
        pooled connection (a slot of the budget like any other, not an extra one)."""
        async with self._plain_connection() as conn:
            self._server = await _identity(conn)

    def take_opening(self, lock_secret: bytes, server: str | None) -> None:
        """Open with what another tenant of this schema on this server read at its opening
        (`engine.opening.SharedOpening`): the lock secret of a current schema and the server's
        identity, as `ensure_schema` and `note_server` would have read them, with no statement."""
        self.lock_secret, self.sheet_lock_keys, self._server = lock_secret, {}, server
        self.settings = self._settings()

    @property
    def server_identity(self) -> str | None:
        """The server's identity as this tenant last read it (None: not read)."""
        return self._server

    async def server_changed(self) -> bool:
        """Whether the server the DSN reaches now is another one than when this tenant last
        looked (at open, or at the last call): another system identifier or postmaster start
        time, i.e. a failover or a restart. Read on a fresh connection; unknown before: False."""
        now = await self._server_identity()
        before, self._server = self._server, now
        return before is not None and now != before

    async def _server_identity(self) -> str:
        raw = await self._pool.extra()
        try:
            return await _identity(pg.Connection(raw, self.driver))
        finally:
            await self._pool.close_extra(raw)

    def moved_to(self, dsn: str) -> None:
        """The org moved to the server at `dsn` (`route`): new connections go there, idle
        pooled ones close now and checked-out ones at release; the server identity is unknown."""
        self.dsn, self._server = dsn, None
        self.settings = self._settings()
        while (raw := self._pool.take_idle()) is not None:
            self._pool.discard(raw)

    def _release(self, conn: pg.Connection) -> None:
        if conn.is_reusable() and not self._closed and (
                self.route is None or self.route.current(self, conn.raw)):
            self._pool.give(conn.raw, True)
        else:
            conn.close()
            self._pool.broken()

    def start_closing_idle(self) -> None:
        """Close pooled connections idle `idle_close_s` or longer, from now until `aclose`."""
        self._pool.start()

    async def _connect(self) -> Any:
        """A new connection to the org's server: `dsn`, or where `route` says it lives now."""
        if self.route is None:
            return await self._connect_to(self.dsn)
        self.route.follow(self)
        dsn = self.dsn
        raw = await self._connect_to(dsn)
        await self.route.opened(self, raw, dsn)
        return raw

    async def _connect_to(self, dsn: str) -> Any:
        last: BaseException | None = None
        for delay in (*CONNECT_RETRY_DELAYS, None):
            try:
                return await self.driver.connect(dsn, server_settings=self._startup)
            except BaseException as exc:
                if not (isinstance(exc, Exception) and pg.is_transient_connect_error(exc)):
                    if isinstance(exc, Exception):
                        raise self._unavailable(exc, TenantUnavailableError, dsn) from exc
                    raise
                last = exc
            if delay is not None:
                await trio.sleep(pg.ladder_delay(delay))  # cut to a run's outage budget
        assert last is not None
        raise self._unavailable(last, TenantUnreachableError, dsn) from last

    def _unavailable(self, exc: BaseException, kind: type[TenantUnavailableError], dsn: str
                     ) -> TenantUnavailableError:
        host = describe_dsn(dsn)
        reason = str(exc).replace(dsn, host) or type(exc).__name__
        return kind(f"cannot connect to {host}: {pooler_hint(reason) or reason}")

    # -- schema ----------------------------------------------------------------------------
    async def repair_schema(self) -> None:
        """Re-run the idempotent bootstrap (called once after a missing relation or column);
        a tenant opened with `bootstrap=False` creates nothing and raises instead."""
        if not self.bootstrap:
            raise SchemaNotFoundError(
                f"schema {self.schema!r} lacks runplane tables; nothing was created "
                "(a read-only command never creates a schema)"
            )
        async with self._plain_connection() as conn:
            await self._bootstrap(conn)

    async def ensure_schema(self) -> None:
        """Bootstrap unless the schema is current; a current schema costs two reads and no DDL
        (so a login without DDL rights, such as a database session, can open it)."""
        async with self._plain_connection() as conn:
            status, secret = await schema_ddl.status_and_secret(conn, self.schema)
            # Under an execution role the bootstrap also (re)grants the role its privileges.
            if status != schema_ddl.SCHEMA_VERSION or self.execution_role is not None:
                await self._bootstrap(conn, unless_current=True)
            elif secret is not None:  # read with the version: nothing more to read
                self.lock_secret, self.sheet_lock_keys = secret, {}
                self.settings = self._settings()
                return
            await self.read_lock_material(conn)

    async def read_lock_material(self, conn: pg.Connection) -> None:
        """Read what sheet lock keys are derived from on `conn`'s server (at open; again on
        the server an org moved to)."""
        self.lock_secret, self.sheet_lock_keys = await lock_keys.lock_material(conn, self.schema)
        self.settings = self._settings()

    async def _bootstrap(self, conn: pg.Connection, *, unless_current: bool = False) -> None:
        try:
            await schema_ddl.bootstrap(conn, self.schema, self.execution_role,
                                       unless_current=unless_current)
        except InsufficientPrivilegeError as exc:
            raise InsufficientPrivilegeError(
                f"schema {self.schema!r} needs DDL (a bootstrap, an upgrade or a missing relation) "
                "that this login may not run, as with a database session: open the tenant once "
                f"with the schema owner's credentials or through the gateway ({exc})",
                sqlstate=exc.sqlstate,
            ) from exc

    def login_connection(self) -> contextlib.AbstractAsyncContextManager[pg.Connection]:
        """A connection as the login user itself (no execution role, no lane; one tenant
        permit): for DDL and for managing database sessions (`engine.sessions`)."""
        return self._plain_connection()

    @contextlib.asynccontextmanager
    async def _plain_connection(self) -> AsyncIterator[pg.Connection]:
        """A connection as the login user (no role switch), for DDL; holds a tenant permit.
        Through a transaction-mode pooler it is one transaction that pins the search path."""
        async with self._connection_permits.hold():
            conn = await self._checkout()
            try:
                if self.pooler is PoolerMode.TRANSACTION:
                    async with conn.checkout_transaction():
                        await conn.execute(f"SET LOCAL search_path TO {pg.PINNED_SEARCH_PATH}")
                        yield conn
                else:
                    yield conn
            finally:
                self._release(conn)

    async def server_version(self) -> str:
        async with self._plain_connection() as conn:
            return await conn.fetchval("SHOW server_version")

    async def aclose(self) -> None:
        self._closed = True
        await self._pool.aclose()
        if self.budget is not None:
            self.budget.forget(self._pool.account)


async def _identity(conn: pg.Connection) -> str:
    """The server's identity (`pg.SERVER_IDENTITY`, else its start time without the right)."""
    try:
        return await conn.fetchval(pg.SERVER_IDENTITY)
    except InsufficientPrivilegeError:
        return await conn.fetchval(pg.SERVER_START)


class Checkout:
    """One checkout of a tenant connection (a hand-written context manager: this is the hot
    path of every operation). Permits are released and the connection returned to the pool, or
    closed when broken, however the block ends."""

    __slots__ = ("_tenant", "_lane", "_conn", "_role_tx")

    def __init__(self, tenant: Tenant, lane: Permits) -> None:
        self._tenant = tenant
        self._lane = lane
        self._conn: pg.Connection | None = None
        self._role_tx: Any = None

    async def __aenter__(self) -> pg.Connection:
        tenant = self._tenant
        await self._lane.acquire()
        try:
            await tenant._connection_permits.acquire()
            try:
                if tenant._closed:
                    raise StoreUnavailableError("tenant is closed")
                conn = self._conn = await tenant._checkout()
                conn.lane = self._lane.name  # `runplane_statement_seconds{lane}`
                if tenant._checkout_setup is not None:
                    self._role_tx = conn.checkout_transaction()
                    await self._role_tx.__aenter__()
                    try:
                        await conn.execute(tenant._checkout_setup)
                    except BaseException as exc:
                        await self._role_tx.__aexit__(type(exc), exc, exc.__traceback__)
                        raise
                return conn
            except BaseException:
                if self._conn is not None:
                    tenant._release(self._conn)
                tenant._connection_permits.release()
                raise
        except BaseException:
            self._lane.release()
            raise

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        try:
            if self._role_tx is not None:
                await self._role_tx.__aexit__(exc_type, exc, tb)
        finally:
            assert self._conn is not None
            self._tenant._release(self._conn)
            self._tenant._connection_permits.release()
            self._lane.release()
        return False


__all__ = ["Tenant", "describe_dsn", "DEFAULT_LANES", "EngineError"]
