"""Database sessions from the runner's side: mint them through the gateway, and run
engine operations directly against the database with them.

How it works
- `create_db_session(gateway, play, table_namespace, operations, ttl_s=600, limits=None)` sends
  the action
  `db_sessions.create` with the public half of an RSA key the gateway client made for this
  process (once: when `open_gateway(..., db_sessions=True)` opens, else on first use; the
  private half stays in memory), decrypts the JWE it gets back, checks that its
  authenticated header names the org, play and expiry the answer names, and returns a
  `DbSession`.
- `SessionRouter` is what `open_gateway(..., db_sessions=True)` installs. For every action a
  session operation covers (`engine.sessions.operation_actions()`) it picks a session by
  (play, table namespace, operations): a fresh one from its cache, the one being minted by a
  concurrent caller (one mint in flight per key, shared), or a new one. The operations asked
  for are every session operation the token's claims allow, so one session serves a whole map
  (sheet writes, array input, receipts). Actions that name no table namespace (receipts, run
  retirement) use any fresh session of their play that covers them, else one minted for the
  play alone (no sheet operations). A session is renewed when less than `RENEW_WITHIN_S`
  remain; the pool of the one it replaces is closed once its last operation returns.
- The operation then runs in-process on a pool opened with the session's URL (`Tenant` on the
  gateway's event loop), exactly as with a direct tenant. What a session does not cover goes
  over HTTP as usual: other actions (runs, outbox, `ensure_sheet`), and any single call the
  session may not run (`InsufficientPrivilegeError`, e.g. a completion that must add a column).
- Session limits (`open_gateway(..., session_limits={max_rows, max_bytes, max_requests})`) are
  asked for with every mint and recorded with the session; the router counts what it runs over
  each session (`SessionUsage`: one request per operation, the rows and row bytes it writes or
  reads) and sends an operation that would pass a limit over HTTP, as the rest of that
  session's work, until the session is renewed. An operation's input rows (`rows`,
  `outcomes`) count before it runs; what a read returns counts after (a read runs while the
  limit is not yet reached).
- When the database cannot be reached with a session's URL, or the gateway cannot mint, the
  router logs one warning and sends everything over HTTP for the rest of the gateway's life.
  When the gateway refuses a mint because the org holds as many live sessions as it allows
  (`TooManySessionsError`, HTTP 429), the work of that key goes over HTTP until the
  `retry_after_ms` the gateway named has passed; then the router tries to mint again.
"""

from __future__ import annotations

import datetime
import functools
import logging
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import attrs
import jwt
import trio

from ..sessions import jwe
from .. import pg, sessions
from ..actions import Action
from ..canonical import JsonObject
from ..errors import (
    AuthError, DatabaseError, EngineError, GatewayUnavailableError, InsufficientPrivilegeError,
    ScopeError, StoreUnavailableError, TenantUnavailableError, TooManySessionsError,
)
from ..values.scopes import MapScope, PlayScope, RunRef, RunScope, normalize_namespace
from ..sessions.limits import SessionLimits, SessionUsage
from ..tenant import DEFAULT_LANES, Tenant
from . import protocol
from ..tokens import allows

if TYPE_CHECKING:
    from .client import Gateway

# A session's login refused because its role was ended (`engine.placement.fence.end_sessions`).
ENDED_SQLSTATES = frozenset({"28P01", "28000"})
log = logging.getLogger("runplane.gateway")

RENEW_WITHIN_S = 60.0
PLAY_NAMESPACE = "play"  # the namespace of sessions minted for play-wide operations only
POOL_CONNECTIONS = sessions.DEFAULT_CONNECTION_LIMIT
PLAY_WIDE = frozenset({"receipts", "array_input"})


@attrs.frozen
class DbSession:
    """A minted session as the runner holds it (the URL decrypted)."""

    postgres_url: str = attrs.field(repr=False)
    expires_at: datetime.datetime
    org: str
    play: str
    table_namespace: str
    operations: tuple[str, ...]
    schema: str
    limits: SessionLimits | None = None

    def remaining_s(self) -> float:
        return (self.expires_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()


@attrs.define(eq=False)
class SessionKey:
    """The RSA key a gateway client made for this process; the private half never leaves it."""

    private: jwe.PrivateKey = attrs.field(repr=False)
    public_jwk: JsonObject


async def session_key(gateway: Gateway) -> SessionKey:
    """The gateway client's key pair, made on first use (in a worker thread: ~0.1 s)."""
    async with gateway.session_key_lock:
        if gateway.session_key is None:
            private, public = await trio.to_thread.run_sync(jwe.generate_key)
            gateway.session_key = SessionKey(private, public)
    return gateway.session_key


def open_answer(answer: JsonObject, key: SessionKey, org: str, play: str) -> DbSession:
    """The `DbSession` of a `db_sessions.create` answer, its URL decrypted and its header checked."""
    try:
        header, url = jwe.decrypt(answer["encrypted_postgres_url"], key.private)
        session = DbSession(
            url.decode("utf-8"), datetime.datetime.fromisoformat(answer["expires_at"]),
            answer["org"], answer["play"], answer["table_namespace"],
            tuple(answer["operations"]), answer["schema"], SessionLimits.of(answer.get("limits")))
    except (KeyError, TypeError, ValueError, EngineError) as exc:
        raise GatewayUnavailableError(f"the gateway's database session answer is malformed: {exc!r}") from None
    if (header.get("org"), header.get("play"), header.get("expires_at")) != \
            (session.org, session.play, answer["expires_at"]) or (session.org, session.play) != (org, play):
        raise AuthError("the database session's authenticated header does not match its answer")
    return session


async def create_db_session(gateway: Gateway, play: str, table_namespace: str,
                            operations: Iterable[str], *, ttl_s: float = sessions.DEFAULT_TTL_S,
                            limits: SessionLimits | Mapping[str, int] | None = None) -> DbSession:
    """Mint a database session through `gateway` (see the module docstring)."""
    limits = SessionLimits.of(limits)
    key = await session_key(gateway)
    # Limits travel only when set, so a gateway from before them still mints for this client.
    extra = {} if limits is None else {"limits": limits.as_dict()}
    answer = await sessions.create(gateway, play, table_namespace, list(operations),
                                   ttl_s=ttl_s, public_key=key.public_jwk, **extra)
    return open_answer(answer, key, gateway.org_id, PlayScope(gateway.org_id, play).play)


def token_operations(token: str) -> tuple[str, ...]:
    """The session operations a token's claims allow (read without verifying: the gateway
    checks again when minting)."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
        patterns = tuple(claims.get("actions") or ())
        if claims.get("runs") is not None:  # a token limited to some runs mints no session
            return ()
    except (jwt.InvalidTokenError, TypeError):
        return ()
    if not allows(patterns, sessions.CREATE_ACTION):
        return ()
    return tuple(op for op, names in sessions.operation_actions().items()
                 if all(allows(patterns, name) for name in names))


@functools.cache
def routed_actions() -> dict[str, str]:
    """`action -> the session operation that covers it`."""
    return {name: op for op, names in sessions.operation_actions().items() for name in names}


def target(arguments: dict) -> tuple[str | None, str | None]:
    """The play and (normalized) table namespace an action's arguments name."""
    play = namespace = None
    for value in arguments.values():
        if isinstance(value, RunRef):
            value = value.scope
        if isinstance(value, (PlayScope, RunScope, MapScope)):
            play = value.play
            if isinstance(value, MapScope):
                namespace = value.table_namespace
    if isinstance(arguments.get("table_namespace"), str):
        namespace = normalize_namespace(arguments["table_namespace"])
    return play, namespace


@attrs.define(eq=False)
class _Pool:
    """One session and the pool opened with its URL."""

    session: DbSession
    tenant: Tenant
    users: int = 0
    retired: bool = False
    usage: SessionUsage = attrs.field(init=False)
    spent: str | None = None  # the limit this session reached, once it did

    def __attrs_post_init__(self) -> None:
        self.usage = SessionUsage(self.session.limits)

    def fresh(self) -> bool:
        return not self.retired and self.session.remaining_s() > RENEW_WITHIN_S


NOT_ROUTED = object()
_ROW_ARGUMENTS = ("rows", "outcomes")


def input_rows(arguments: Mapping[str, object]) -> Sequence[object]:
    """The rows an operation writes (`rows`, or a completion's `outcomes`)."""
    for name in _ROW_ARGUMENTS:
        value = arguments.get(name)
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return value
    return ()


def input_bytes(rows: Sequence[object]) -> int:
    """The JSON size of the rows' data (an outcome's: its `data`)."""
    if not rows:
        return 0
    data = [getattr(row, "data", row) for row in rows]
    try:
        return len(protocol.dumps(data))
    except (TypeError, ValueError):
        return 0  # not JSON: the operation itself refuses it


def result_size(result: object, with_bytes: bool) -> tuple[int, int]:
    """The rows (and, `with_bytes`, their JSON bytes) a read returned: a list of rows or a
    page (`rows`, `text`); other answers (counters, kinds) carry no rows."""
    if isinstance(result, list):
        return len(result), (len(protocol.dumps(result)) if with_bytes and result else 0)
    rows, text = getattr(result, "rows", None), getattr(result, "text", None)
    if isinstance(rows, int) and isinstance(text, str):
        return rows, (len(text.encode("utf-8")) if with_bytes else 0)
    return 0, 0


@attrs.define(eq=False)
class SessionRouter:
    """Runs covered engine operations over database sessions (see the module docstring)."""

    gateway: Gateway
    driver: pg.Driver
    operations: tuple[str, ...]
    limits: SessionLimits | None = None
    ttl_s: float = sessions.DEFAULT_TTL_S
    mints: int = 0
    disabled: str | None = None
    _pools: dict[tuple, _Pool] = attrs.field(init=False, factory=dict)
    _minting: dict[tuple, trio.Event] = attrs.field(init=False, factory=dict)
    _refused_until: dict[tuple, float] = attrs.field(init=False, factory=dict)

    async def run(self, action: Action, args: tuple, kwargs: dict) -> object:
        """The action's result over a session, or `NOT_ROUTED` (send it over HTTP)."""
        op = routed_actions().get(action.name)
        if op is None or op not in self.operations or self.disabled is not None:
            return NOT_ROUTED
        arguments = action.bind(args, kwargs)
        play, namespace = target(arguments)
        if play is None:
            return NOT_ROUTED
        pool = await self._pool(play, namespace, op)
        if pool is None:
            return NOT_ROUTED
        usage = pool.usage
        rows = input_rows(arguments)
        size = input_bytes(rows) if usage.counts_bytes else 0
        passed = usage.exceeded_by(len(rows), size)
        if passed is not None:
            if pool.spent is None:
                pool.spent = passed
                log.info("database session: its limit %s is reached; its work goes over HTTP "
                         "until it is renewed", passed)
            return NOT_ROUTED
        usage.charge(len(rows), size, requests=1)
        pool.users += 1
        try:
            result = await action.function(pool.tenant, *args, **kwargs)
            if not action.writes:
                usage.charge(*result_size(result, usage.counts_bytes))
            return result
        except InsufficientPrivilegeError as exc:
            usage.charge(-len(rows), -size, requests=-1)  # it runs over HTTP instead
            log.info("database session: %s needs more than the session allows; sent over HTTP (%s)",
                     action.name, exc)
            return NOT_ROUTED
        except TenantUnavailableError as exc:
            if getattr(exc.__cause__, "sqlstate", None) in ENDED_SQLSTATES:
                pool.retired = True  # ended (its org moved servers): the retry mints another
                raise StoreUnavailableError(f"the database session was ended: {exc}") from exc
            self._disable(f"the database is not reachable with a session's URL ({exc})")
            return NOT_ROUTED
        finally:
            pool.users -= 1
            if pool.retired and pool.users == 0:
                await _close(pool)

    async def _pool(self, play: str, namespace: str | None, op: str) -> _Pool | None:
        if namespace is None:
            for (p, _, ops), pool in self._pools.items():
                if p == play and op in ops and pool.fresh():
                    return pool
            namespace, ops = PLAY_NAMESPACE, tuple(o for o in self.operations if o in PLAY_WIDE)
        else:
            ops = self.operations
        key = (play, namespace, ops)
        while self.disabled is None:
            pool = self._pools.get(key)
            if pool is not None and pool.fresh():
                return pool
            if self._refused_until.get(key, 0.0) > trio.current_time():
                return None
            minting = self._minting.get(key)
            if minting is not None:
                await minting.wait()
                continue
            done = self._minting[key] = trio.Event()
            try:
                return await self._mint(key)
            finally:
                del self._minting[key]
                done.set()
        return None

    async def _mint(self, key: tuple) -> _Pool | None:
        play, namespace, ops = key
        try:
            session = await create_db_session(self.gateway, play, namespace, ops, ttl_s=self.ttl_s,
                                              limits=self.limits)
        except (ScopeError, AuthError):
            return None  # over HTTP, this call meets the same refusal and raises it
        except TooManySessionsError as exc:
            log.info("database session refused (%s); this work goes over HTTP for now", exc)
            self._refused_until[key] = trio.current_time() + exc.retry_after_s
            return None
        except DatabaseError as exc:
            if exc.sqlstate != "42501":
                raise
            self._disable(f"the gateway cannot mint database sessions ({exc})")
            return None
        self.mints += 1
        tenant = Tenant(org_id=session.org, schema=session.schema, dsn=session.postgres_url,
                        driver=self.driver, max_connections=POOL_CONNECTIONS, lanes=dict(DEFAULT_LANES))
        try:
            await tenant.ensure_schema()  # connects; a current schema needs no DDL
        except EngineError as exc:
            with trio.CancelScope(shield=True):
                await tenant.aclose()
            if isinstance(exc, TenantUnavailableError):
                self._disable(f"the database is not reachable with a session's URL ({exc})")
                return None
            raise
        old = self._pools.get(key)
        pool = self._pools[key] = _Pool(session, tenant)
        if old is not None:
            old.retired = True
            if old.users == 0:
                await _close(old)
        return pool

    def _disable(self, reason: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            log.warning("database sessions off, everything goes over HTTP from now on: %s", reason)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await _close(pool)


async def _close(pool: _Pool) -> None:
    pool.retired = True
    with trio.CancelScope(shield=True):
        await pool.tenant.aclose()
