"""How many database sessions an org may hold, which public keys a session URL may be
encrypted to (both checked before a session role exists: `engine.sessions.mint` / `create`),
and the limits of one session's work.

- An org holds at most `sessions_per_org()` live sessions (`RUNPLANE_SESSIONS_PER_ORG`, default
  4): a session role counts until its `VALID UNTIL` passes. Past it, `TooManySessionsError`
  (HTTP 429) with the seconds until the org's oldest session expires.
- The server holds at most `sessions_per_server()` live sessions of every org and schema
  (`RUNPLANE_SESSIONS_PER_SERVER`, default 16; each logs in at most `SESSION_CONNECTION_LIMIT`
  times): past it, the same 429. `ConnectionPlan` says what a server's `max_connections` must
  cover so that sessions at that budget never take the connections of runplane's own
  processes (gateways, runners, workers, the console) or of owner logins; the embedded server
  is sized by it (`engine.embedded`). Mints of one schema are exact; mints of different
  schemas at the same instant may each pass the server-wide count once (they share no lock).
- `SessionLimits(max_rows, max_bytes, max_requests)`: how much work one session may carry
  (rows written or read, bytes of row data, operations), each optional; `max_rows` is at least
  `ROW_LIMIT_FLOOR` (10,000). A session's limits are recorded with it, as its role's comment
  (`limits_comment`, read back by `recorded_limits`: no table holds them, and dropping the
  role drops them), and answered with it. The runner's router enforces them
  (`SessionUsage`): past a limit, that work goes over HTTP.
- `SessionTimeouts`: the statement, lock-wait and idle-in-transaction limits every session
  role starts with (`ROLE_TIMEOUTS`, set on the role) and that the sweep enforces from outside
  (`engine.sessions.sweep.end_overdue`): a session may `SET` its own settings, so the role's
  settings pace a cooperating runner and the sweep is what holds a hostile one to them; a
  transaction may live at most `transaction_s` (statement plus idle limit), so a session that
  keeps one open with a statement now and then cannot pin the vacuum horizon either.
- A runner's public key is refused (`InvalidInputError`, HTTP 400) when it is over
  `MAX_JWK_BITS` or cannot encrypt, so a refused key never leaves a minted role behind.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import attrs

from ..canonical import JsonObject
from ..limits.bounds import is_int
from . import jwe
from .. import pg
from ..errors import InvalidInputError, TooManySessionsError
from .isolation import GROUP, SCOPES_TABLE
from ..sql import qualified

DEFAULT_SESSIONS_PER_ORG = 4
SESSIONS_PER_ORG_ENV = "RUNPLANE_SESSIONS_PER_ORG"
DEFAULT_SESSIONS_PER_SERVER = 16
SESSIONS_PER_SERVER_ENV = "RUNPLANE_SESSIONS_PER_SERVER"
SESSION_CONNECTION_LIMIT = 8  # a session role's CONNECTION LIMIT
MAX_JWK_BITS = 8192

# Mints of one schema take turns (a mint is a few milliseconds), so the live sessions an org
# holds are counted exactly; sessions themselves cannot take this lock mode on the table.
_LIVE_SESSIONS = """
SELECT count(*) AS live,
       extract(epoch FROM min(r.rolvaliduntil) - clock_timestamp())::float8 AS first_expiry_s
  FROM {m} AS m
  JOIN pg_catalog.pg_roles AS r ON r.rolname = m.role_name
 WHERE m.org_id = $1 AND r.rolvaliduntil > clock_timestamp()
"""


@attrs.frozen
class SessionTimeouts:
    """The limits a session's backends are held to, in seconds (module docstring)."""

    statement_s: float = 60.0
    lock_s: float = 10.0
    idle_s: float = 60.0

    @property
    def transaction_s(self) -> float:
        return self.statement_s + self.idle_s

    def role_settings(self) -> tuple[tuple[str, str], ...]:
        """The `ALTER ROLE ... SET` pairs a session role starts with."""
        return (("statement_timeout", f"{self.statement_s:g}s"),
                ("lock_timeout", f"{self.lock_s:g}s"),
                ("idle_in_transaction_session_timeout", f"{self.idle_s:g}s"))


ROLE_TIMEOUTS = SessionTimeouts()


# Live session roles of the whole server (roles are cluster-wide).
_LIVE_ON_SERVER = """
SELECT count(*) AS live,
       extract(epoch FROM min(r.rolvaliduntil) - clock_timestamp())::float8 AS first_expiry_s
  FROM pg_catalog.pg_auth_members AS am
  JOIN pg_catalog.pg_roles AS g ON g.oid = am.roleid AND g.rolname = $1
  JOIN pg_catalog.pg_roles AS r ON r.oid = am.member
 WHERE r.rolvaliduntil > clock_timestamp()
"""


def _count_setting(env: str, default: int) -> int:
    raw = os.environ.get(env, "")
    if not raw:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= 10_000:
        raise InvalidInputError(f"{env} must be an integer from 1 to 10000")
    return int(raw)


def sessions_per_org() -> int:
    """The most live sessions one org may hold: `RUNPLANE_SESSIONS_PER_ORG`, else 4."""
    return _count_setting(SESSIONS_PER_ORG_ENV, DEFAULT_SESSIONS_PER_ORG)


def sessions_per_server() -> int:
    """The most live sessions of every org on one server: `RUNPLANE_SESSIONS_PER_SERVER`, else
    16."""
    return _count_setting(SESSIONS_PER_SERVER_ENV, DEFAULT_SESSIONS_PER_SERVER)


@attrs.frozen
class ConnectionPlan:
    """How one server's connections are shared (module docstring): `reserve` for owner logins
    (the server keeps them: `superuser_reserved_connections`, or `reserved_connections` with
    `pg_use_reserved_connections` on PostgreSQL 16+), `sessions` × `per_session` for database
    sessions at the server-wide budget, and `hosting` for runplane's own processes."""

    sessions: int
    per_session: int = SESSION_CONNECTION_LIMIT
    hosting: int = 100
    reserve: int = 10

    @classmethod
    def from_environment(cls) -> "ConnectionPlan":
        return cls(sessions=sessions_per_server())

    @property
    def max_connections(self) -> int:
        return self.reserve + self.sessions * self.per_session + self.hosting


async def check_room(conn: pg.Connection, schema: str, org_id: str, max_sessions: int,
                     max_on_server: int | None = None) -> None:
    """Refuse with `TooManySessionsError` when the org holds `max_sessions` live sessions, or
    the server `max_on_server` (default `sessions_per_server()`)."""
    m = qualified(schema, SCOPES_TABLE)
    await conn.execute(f"LOCK TABLE {m} IN SHARE ROW EXCLUSIVE MODE")
    row = await conn.fetchrow(_LIVE_SESSIONS.format(m=m), org_id)
    if row["live"] >= max_sessions:
        wait = max(1.0, float(row["first_expiry_s"] or 1.0))
        raise TooManySessionsError(
            f"org {org_id!r} already holds {row['live']} live database sessions (at most "
            f"{max_sessions}); the next one can be minted in {wait:.0f} s",
            retry_after_s=wait)
    limit = sessions_per_server() if max_on_server is None else max_on_server
    row = await conn.fetchrow(_LIVE_ON_SERVER, GROUP)
    if row["live"] >= limit:
        wait = max(1.0, float(row["first_expiry_s"] or 1.0))
        raise TooManySessionsError(
            f"the server already holds {row['live']} live database sessions (at most {limit}, "
            f"{SESSIONS_PER_SERVER_ENV}); the next one can be minted in {wait:.0f} s",
            retry_after_s=wait)


def check_public_key(public_key: JsonObject) -> None:
    """Refuse a key the answer could not be encrypted to, before any role exists."""
    jwe.load_public_jwk(public_key)  # names the member that is wrong
    bits = int.from_bytes(jwe.b64url_decode(public_key["n"], "public_key.n"), "big").bit_length()
    if bits > MAX_JWK_BITS:
        raise InvalidInputError(f"public_key.n must be an RSA modulus of at most {MAX_JWK_BITS} bits")
    try:
        jwe.encrypt(b"probe", public_key)
    except InvalidInputError:
        raise
    except Exception as exc:  # whatever the cryptography refuses, the runner's key is at fault
        raise InvalidInputError(f"public_key cannot encrypt: {exc}") from None


# -- the limits of one session ------------------------------------------------------------------
ROW_LIMIT_FLOOR = 10_000
LIMIT_NAMES = ("max_rows", "max_bytes", "max_requests")
_MAX_LIMIT = 2**63 - 1
_COMMENT_KEY = "runplane_session_limits"


def _limit(floor: int):
    def check(_instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value is None:
            return
        if not is_int(value, floor, _MAX_LIMIT):
            raise InvalidInputError(
                f"limits.{attribute.name} must be an integer from {floor} to {_MAX_LIMIT} or "
                f"absent, got {value!r}")

    return check


@attrs.frozen
class SessionLimits:
    """How much work one database session may carry (None: no limit): rows written or read,
    bytes of row data (JSON), operations run."""

    max_rows: int | None = attrs.field(default=None, validator=_limit(ROW_LIMIT_FLOOR))
    max_bytes: int | None = attrs.field(default=None, validator=_limit(1))
    max_requests: int | None = attrs.field(default=None, validator=_limit(1))

    @classmethod
    def of(cls, value: object) -> "SessionLimits | None":
        """`value` (None, a `SessionLimits` or a mapping of `LIMIT_NAMES`) as limits, checked;
        None when it sets none. `InvalidInputError` names the bad member."""
        if value is None or isinstance(value, SessionLimits):
            return value if value is None or value.as_dict() else None
        if not isinstance(value, Mapping):
            raise InvalidInputError(f"limits must be an object with {list(LIMIT_NAMES)}, got "
                                    f"{type(value).__name__}")
        unknown = sorted(str(name) for name in value if name not in LIMIT_NAMES)
        if unknown:
            raise InvalidInputError(f"limits: unknown {unknown}; allowed are {list(LIMIT_NAMES)}")
        limits = cls(**{name: value[name] for name in LIMIT_NAMES if name in value})
        return limits if limits.as_dict() else None

    def as_dict(self) -> dict[str, int]:
        """The limits set, by name (what the answer and the role's comment carry)."""
        return {name: getattr(self, name) for name in LIMIT_NAMES if getattr(self, name) is not None}


def limits_comment(limits: SessionLimits) -> str:
    """The `COMMENT ON ROLE` literal that records a session's limits (integers only)."""
    text = json.dumps({_COMMENT_KEY: limits.as_dict()}, sort_keys=True)
    return "'" + text.replace("'", "''") + "'"


_RECORDED = """
SELECT pg_catalog.shobj_description(r.oid, 'pg_authid') FROM pg_catalog.pg_roles AS r
 WHERE r.rolname = $1
"""


async def recorded_limits(conn: pg.Connection, role: str) -> SessionLimits | None:
    """The limits recorded with session role `role` (None: none, or no such role)."""
    text = await conn.fetchval(_RECORDED, role)
    try:
        recorded = json.loads(text)[_COMMENT_KEY] if text else None
    except (ValueError, TypeError, KeyError):
        return None
    return SessionLimits.of(recorded)


@attrs.define(eq=False)
class SessionUsage:
    """What the runner's router has run over one session, against its limits."""

    limits: SessionLimits | None
    rows: int = 0
    bytes: int = 0
    requests: int = 0

    @property
    def counts_bytes(self) -> bool:
        return self.limits is not None and self.limits.max_bytes is not None

    def exceeded_by(self, rows: int = 0, size: int = 0) -> str | None:
        """The limit one more operation moving `rows` rows and `size` bytes would pass (each
        limit is checked as "already reached" when the operation's share is not known yet, as
        for a read), or None."""
        limits = self.limits
        if limits is None:
            return None
        for name, used, more in (("max_requests", self.requests, 1), ("max_rows", self.rows, rows),
                                 ("max_bytes", self.bytes, size)):
            limit = getattr(limits, name)
            if limit is not None and (used + more > limit or used >= limit):
                return f"{name}={limit}"
        return None

    def charge(self, rows: int = 0, size: int = 0, requests: int = 0) -> None:
        self.rows += rows
        self.bytes += size
        self.requests += requests
