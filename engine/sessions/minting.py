"""Scoped database sessions: short-lived PostgreSQL logins that can touch only one
org's play, table namespace and operations. What confines them is described in
`engine.sessions.isolation`; this module mints, describes and drops them.

How it works
- `mint(tenant, scope, table_namespace, operations, ttl_s=…, limits=…)` runs on the tenant's own login
  (never under an execution role) in one transaction: it creates a role `runplane_s_<random>`
  with LOGIN, a random password, `VALID UNTIL` now + ttl (the server's clock) and a small
  `CONNECTION LIMIT`, makes it a member of `runplane_sessions` (INHERIT TRUE, SET FALSE), grants
  exactly what the operations need, and records the scope in `session_scopes`. The password is
  sent as a SCRAM-SHA-256 verifier computed here, so the plain password never reaches the server
  or its logs. For `rows.*` the sheet table is created first (bare) when absent, so there is a
  table to grant on; new columns are DDL, which a session never runs. The role starts with
  `ROLE_SETTINGS` (statement, lock and idle-in-transaction timeouts) and, when it has a sheet,
  its scope row carries the sheet's advisory-lock key (the one key it may know). An org holds
  at most `sessions_per_org()` live sessions (`engine.sessions.limits`). Its `limits`
  (`SessionLimits`: rows, bytes, requests; at least 10,000 rows) are recorded as the role's
  comment; the runner's router enforces them (`engine.gateway.db_sessions`).
- Operations (`OPERATIONS`: `rows.read`, `rows.upsert`, `rows.append`, `rows.replace`,
  `receipts`, `array_input`) and what each grants: `engine.sessions.grants`.
- When the schema lacks an isolation policy mint relies on (a schema bootstrapped before the
  policy existed), mint re-runs the idempotent bootstrap once (`tenant.repair_schema`), which
  installs it, then mints.
- `drop_expired(tenant)` / `sweep_expired(tenant)` (`engine.sessions.sweep`) end the open
  connections of expired session roles and drop them; the gateway and `runplane supervise`
  sweep periodically.
- `session_url(dsn, role, password)` is the tenant's DSN with the session's credentials,
  keeping only where the server is and its TLS settings (`credentials.URL_PARAMETERS`).
- `create(port, play, table_namespace, operations, ttl_s, public_key, limits)` is the gateway action
  `db_sessions.create`: it mints on the port's org and answers with the session's URL, encrypted
  to the runner's key when one is sent (`engine.sessions.jwe`). Through a gateway (which hands it
  a `MintContext`: the verified token's claims and the DSN session URLs are built on) the token
  bounds it: every action an operation stands for (`operation_actions()`) must be allowed, and
  the session never outlives the token.
- `password_probe(tenant)` (for `runplane doctor`) creates a throwaway session role and tries to
  log in with it without a password; it reports whether the server let it in.
"""

from __future__ import annotations

import datetime
import functools
import logging
import secrets
import time
from typing import TYPE_CHECKING, Iterable, Mapping

import attrs
import trio

from . import jwe
from .. import pg
from ..pg.pooler import PoolerMode, pooler_mode
from ..actions import action, actions
from ..canonical import JsonObject
from ..limits.bounds import is_int, is_number
from ..observability import metrics
from ..values.codecs import FLOAT, INT, RAW, STR, dict_of, list_of, optional
from ..errors import (
    AuthError, InsufficientPrivilegeError, InvalidInputError, SchemaNotFoundError, ScopeError,
)
from ..values.keys import USER_RECEIPT_KIND, kind_range
from ..ports import Port
from ..values.scopes import PlayScope, check_scope, normalize_namespace
from .grants import COLUMNS, OPERATIONS, ROW_OPERATIONS, SHARED_TABLES, grants
from .limits import (
    ROLE_TIMEOUTS, SESSION_CONNECTION_LIMIT, SessionLimits, check_public_key, check_room,
    limits_comment, sessions_per_org,
)
from .credentials import scram_verifier, session_url
from .isolation import GROUP, SCOPES_TABLE, group_exists, missing_policies, policies
from ..sql import qualified, quote_ident
from ..tokens import TokenClaims

if TYPE_CHECKING:
    from ..sheets.layout import SheetLayout
    from ..tenant import Tenant

ROLE_PREFIX = "runplane_s_"
DEFAULT_TTL_S = 600.0
MAX_TTL_S = 24 * 3600.0
DEFAULT_CONNECTION_LIMIT = SESSION_CONNECTION_LIMIT
# Defaults every session role's logins start with: a runaway statement, lock wait or open
# transaction of a session ends on its own. A session may change them; the sweep enforces the
# same limits from outside (`sweep.end_overdue`).
ROLE_SETTINGS = ROLE_TIMEOUTS.role_settings()

ARRAY_FACT_KIND_PREFIX = "array_input_"

log = logging.getLogger("runplane.sessions")


def _operations(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise InvalidInputError(f"operations must be a list of names from {list(OPERATIONS)}")
    ops = set(value)
    unknown = sorted(str(op) for op in ops - set(OPERATIONS))
    if unknown:
        raise InvalidInputError(f"operations: unknown {unknown}; allowed are {list(OPERATIONS)}")
    if not ops:
        raise InvalidInputError("operations must name at least one operation")
    return tuple(op for op in OPERATIONS if op in ops)


@attrs.frozen
class SessionScope:
    """What one session may touch: an org's play, one table namespace, some operations."""

    org_id: str
    play: str
    table_namespace: str = attrs.field(converter=normalize_namespace)
    operations: tuple[str, ...] = attrs.field(converter=_operations)

    def covers(self, operations: Iterable[str]) -> bool:
        return set(_operations(operations)) <= set(self.operations)


@attrs.frozen
class MintedSession:
    """A minted session role: its credentials, expiry (server clock) and scope."""

    role: str
    password: str = attrs.field(repr=False)
    expires_at: datetime.datetime
    scope: SessionScope
    schema: str
    limits: SessionLimits | None = None

    def url(self, dsn: str) -> str:
        return session_url(dsn, self.role, self.password)


def key_ranges(scope: SessionScope) -> dict[str, bytes | None]:
    """The `work_receipts` key ranges of the scope's receipts and array facts (None when the
    operations do not include them). See `engine.values.keys` for why these are exact."""
    play = PlayScope(scope.org_id, scope.play)
    out: dict[str, bytes | None] = dict.fromkeys(
        ("receipts_low", "receipts_high", "facts_low", "facts_high"))
    if "receipts" in scope.operations:
        out["receipts_low"], out["receipts_high"] = kind_range(play, USER_RECEIPT_KIND)
    if "array_input" in scope.operations:
        out["facts_low"], out["facts_high"] = kind_range(play, ARRAY_FACT_KIND_PREFIX, prefix=True)
    return out


# -- minting ----------------------------------------------------------------------------------
_RECORD = """
INSERT INTO {m} (role_name, org_id, play, table_namespace, operations, sheet_table,
                  receipts_low, receipts_high, facts_low, facts_high, expires_at, sheet_lock_key)
VALUES ($1, $2, $3, $4, $5::text[], $6, $7, $8, $9, $10, $11, $12)
"""

# One read before minting: the server's clock, its version, and whether what the session relies
# on is in place (the group, every isolation policy, the sheet table). Commits of minting and
# dropping are asynchronous: a role lost to a server crash only makes the runner mint again.
_MINT_STATE = """
SELECT set_config('synchronous_commit', 'off', true) IS NOT NULL AS async_commit,
       clock_timestamp() + make_interval(secs => $1::float8) AS expires_at,
       current_setting('server_version_num')::integer AS version,
       EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $2) AS group_present,
       ($3::text IS NULL OR to_regclass($3) IS NOT NULL) AS sheet_present,
       (SELECT count(*) FROM pg_catalog.pg_policy p
          JOIN pg_catalog.pg_class c ON c.oid = p.polrelid
          JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $4
           AND (c.relname::text, p.polname::text) IN (SELECT * FROM unnest($5::text[], $6::text[])))
       + (SELECT count(*) FROM pg_catalog.pg_class c
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = $4 AND c.relname = ANY($5::text[]) AND c.relrowsecurity) AS installed
"""


async def _unavailable(conn: pg.Connection, schema: str, group_present: bool) -> InsufficientPrivilegeError:
    if not group_present:
        return InsufficientPrivilegeError(
            f"database sessions are unavailable: the group role {GROUP} does not exist and the "
            "login that bootstrapped the schema may not create roles")
    missing = await missing_policies(conn, schema)
    return InsufficientPrivilegeError(
        f"database sessions are unavailable on schema {schema}: its isolation policies are "
        f"missing ({', '.join(f'{t}.{p}' for t, p in missing[:3])}); open the tenant once "
        "with a login that may create roles")


@attrs.frozen
class _RoleDraft:
    """The session role about to be created: its name and password verifier, what it is
    granted (`grant`, on the sheet of `layout` when it reads or writes rows), and the limits
    recorded with it."""

    role: str
    verifier: str = attrs.field(repr=False)
    grant: SessionScope
    layout: "SheetLayout | None"
    limits: SessionLimits | None
    connection_limit: int


async def mint(
    tenant: Tenant,
    scope: PlayScope,
    table_namespace: str,
    operations: Iterable[str],
    *,
    ttl_s: float = DEFAULT_TTL_S,
    connection_limit: int = DEFAULT_CONNECTION_LIMIT,
    max_sessions: int | None = None,
    limits: SessionLimits | Mapping[str, int] | None = None,
) -> MintedSession:
    """Create a session role for `scope` (see the module docstring); checks input first.
    At most `max_sessions` (default `limits.sessions_per_org()`) live sessions per
    org: past it, `TooManySessionsError`. `limits` (a `SessionLimits` or a mapping of
    `max_rows`, `max_bytes`, `max_requests`) are recorded with the session."""
    from ..sheets import SheetContract, ensure_sheet
    from ..sheets.layout import layout_for

    check_scope(tenant, scope)
    grant = SessionScope(scope.org_id, scope.play, table_namespace, operations)
    limits = SessionLimits.of(limits)
    max_sessions = _checked_bounds(ttl_s, connection_limit, max_sessions)
    layout = None
    if ROW_OPERATIONS & set(grant.operations):
        layout = layout_for(tenant, scope, grant.table_namespace)
    wanted = policies(tenant.schema)
    tables = [t for t, _ in wanted]
    expected = len(wanted) + len(set(tables))
    role = ROLE_PREFIX + secrets.token_hex(10)
    password = secrets.token_urlsafe(32)
    verifier = await trio.to_thread.run_sync(scram_verifier, password)  # ~ms of PBKDF2
    draft = _RoleDraft(role, verifier, grant, layout, limits, connection_limit)
    if layout is not None:
        # Claims the sheet's table name first: a name another sheet holds (a hash collision)
        # raises ConflictError here, so a role is never granted another sheet's table.
        await ensure_sheet(tenant, scope, grant.table_namespace, SheetContract())
    repaired = False
    for _ in range(3):
        async with tenant.login_connection() as conn:
            async with conn.transaction():
                state = await conn.fetchrow(
                    _MINT_STATE, float(ttl_s), GROUP, layout and layout.qualified, tenant.schema,
                    tables, [p for _, p in wanted])
                policies_missing = state["installed"] != expected
                if not state["group_present"] or (policies_missing and repaired):
                    raise await _unavailable(conn, tenant.schema, state["group_present"])
                if state["sheet_present"] and not policies_missing:
                    await check_room(conn, tenant.schema, grant.org_id, max_sessions)
                    expires_at = state["expires_at"]
                    await _create_role(conn, tenant.schema, draft, expires_at, state["version"])
                    await _record_scope(conn, tenant, draft, expires_at)
                    return MintedSession(role, password, expires_at, grant, tenant.schema, limits)
        if policies_missing:
            # A schema bootstrapped before a policy sessions rely on existed: the idempotent
            # bootstrap installs it (a login that may not is told so on the next pass).
            repaired = True
            try:
                await tenant.repair_schema()
            except (InsufficientPrivilegeError, SchemaNotFoundError) as exc:
                log.warning("database sessions: cannot install the isolation policies: %s", exc)
            continue
        # A session granted on rows needs its sheet table to exist: create it bare, then mint.
        await ensure_sheet(tenant, scope, grant.table_namespace, SheetContract())
    raise AssertionError("unreachable: the sheet table exists after ensure_sheet")


def _checked_bounds(ttl_s: object, connection_limit: object, max_sessions: object) -> int:
    """The session's lifetime and connection limit checked, and the org's session cap
    (`limits.sessions_per_org()` unless given) returned checked."""
    if not is_number(ttl_s, high=MAX_TTL_S, above=0):
        raise InvalidInputError(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:.0f}]")
    if not is_int(connection_limit, 1, 100):
        raise InvalidInputError("connection_limit must be an integer from 1 to 100")
    if max_sessions is None:
        max_sessions = sessions_per_org()
    if not is_int(max_sessions, 1):
        raise InvalidInputError("max_sessions must be a positive integer")
    return max_sessions


async def _create_role(conn: pg.Connection, schema: str, draft: _RoleDraft,
                       expires_at: datetime.datetime, server_version: int) -> None:
    """Create the login role in one batch: no privileges of its own, a member of the group
    (inheriting, never set to it, from PostgreSQL 16), its settings, the grants of its
    operations on the columns the schema has, and its limits as the role's comment."""
    role, layout, limits = draft.role, draft.layout, draft.limits
    columns = {row["table_name"]: row["columns"] for row in await conn.fetch(
        COLUMNS, schema, list(SHARED_TABLES))}
    membership = " WITH INHERIT TRUE, SET FALSE" if server_version >= 160000 else ""
    await conn.execute(";\n".join([
        f"CREATE ROLE {quote_ident(role)} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE"
        f" NOREPLICATION NOBYPASSRLS INHERIT CONNECTION LIMIT {draft.connection_limit}"
        f" VALID UNTIL '{expires_at.isoformat()}' PASSWORD '{draft.verifier}'",
        f"GRANT {quote_ident(GROUP)} TO {quote_ident(role)}{membership}",
        *(f"ALTER ROLE {quote_ident(role)} SET {name} = '{value}'"
          for name, value in ROLE_SETTINGS),
        *grants(schema, draft.grant.operations, layout and layout.table, role, columns),
        *([f"COMMENT ON ROLE {quote_ident(role)} IS {limits_comment(limits)}"]
          if limits is not None else []),
    ]))


async def _record_scope(conn: pg.Connection, tenant: Tenant, draft: _RoleDraft,
                        expires_at: datetime.datetime) -> None:
    """Record what the role may touch (`SCOPES_TABLE`): its scope, operations, sheet table,
    the key ranges of its receipts and array facts, its expiry and its sheet's lock key."""
    from ..sheets.layout import sheet_lock_key

    grant, layout = draft.grant, draft.layout
    ranges = key_ranges(grant)
    await conn.execute(
        _RECORD.format(m=qualified(tenant.schema, SCOPES_TABLE)),
        draft.role, grant.org_id, grant.play, grant.table_namespace,
        list(grant.operations), layout and layout.table,
        ranges["receipts_low"], ranges["receipts_high"],
        ranges["facts_low"], ranges["facts_high"], expires_at,
        layout and sheet_lock_key(tenant, layout),
    )


# -- the gateway action ---------------------------------------------------------------------
CREATE_ACTION = "db_sessions.create"
# The actions each operation stands for: a token must allow all of them to get the operation.
_SHEET_ACTIONS = {
    "rows.read": ("sheets.read_rows", "sheets.summary", "sheets.probe", "sheets.failed_rows",
                  "sheets.error_counts", "sheets.run_rows", "sheets.read_page", "sheets.count",
                  "sheets.field_kinds"),
    "rows.upsert": ("sheets.admit", "sheets.complete"),
    "rows.append": ("sheets.append_rows",),
    "rows.replace": ("sheets.replace_rows",),
}
_ACTION_FAMILIES = {"receipts": "receipts.", "array_input": "array_input."}


@functools.cache
def operation_actions() -> dict[str, tuple[str, ...]]:
    """`operation -> the registered actions it stands for`: the sheet reads or writes of one
    sheet, and every action of the receipts and array-input families."""
    registry = actions()
    out = {op: tuple(name for name in names if name in registry) for op, names in _SHEET_ACTIONS.items()}
    for op, prefix in _ACTION_FAMILIES.items():
        out[op] = tuple(sorted(name for name in registry if name.startswith(prefix)))
    return {op: out[op] for op in OPERATIONS}


THROUGH_A_POOLER = (
    "database sessions cannot go through a transaction-mode pooler: a session is a login role "
    "with settings of its own (timeouts, a connection limit) and a password the pooler does "
    "not know; give the gateway --session-dsn with the server's own address")


@attrs.frozen
class MintContext:
    """What a gateway adds to a mint request: the verified token's claims (they bound the
    session) and the DSN the session's URL is built on (None: the port's own)."""

    claims: TokenClaims
    session_dsn: str | None = attrs.field(default=None, repr=False)


@action(CREATE_ACTION, params={"play": STR, "table_namespace": STR, "operations": list_of(STR),
                               "ttl_s": FLOAT, "public_key": optional(RAW),
                               "limits": optional(dict_of(INT))},
        result=RAW, context=("minting",))
async def create(port: Port, play: str, table_namespace: str, operations: Iterable[str],
                 ttl_s: float = DEFAULT_TTL_S, public_key: JsonObject | None = None,
                 limits: SessionLimits | Mapping[str, int] | None = None, *,
                 minting: MintContext | None = None) -> JsonObject:
    """Mint a session on the port's org and answer with `expires_at`, `org`,
    `play`, `table_namespace`, `operations`, `schema`, `limits` (those set, recorded with the
    session: `max_rows` at least 10,000, `max_bytes`, `max_requests`), and
    `encrypted_postgres_url` (a JWE for `public_key`) or, without a key, `postgres_url`.

    Through a gateway (`minting` is what it knows of the request): every action an operation
    stands for must be allowed by the token, and the session lives at most as long as the token.
    A token whose `runs` claim limits it to some runs gets no session (a session reaches every
    run of its play): `ScopeError`. The URL is built on `minting.session_dsn` when the gateway
    names one, else on the port's DSN.
    """
    scope = PlayScope(port.org_id, play)
    grant = SessionScope(scope.org_id, scope.play, table_namespace, operations)
    limits = SessionLimits.of(limits)
    if public_key is not None:
        check_public_key(public_key)
    claims = None if minting is None else minting.claims
    session_dsn = None if minting is None else minting.session_dsn
    if session_dsn is None and port.settings.dsn is not None \
            and pooler_mode(port.settings.dsn) is PoolerMode.TRANSACTION:
        raise InvalidInputError(THROUGH_A_POOLER)
    if claims is not None:
        if claims.runs is not None:
            raise ScopeError("a token limited to some runs (its runs claim) cannot mint a "
                             "database session; its work goes over HTTP")
        for name in (n for op in grant.operations for n in operation_actions()[op]):
            claims.check_action(name)
        if is_number(ttl_s):
            ttl_s = min(ttl_s, claims.exp - time.time())
            if ttl_s <= 0:
                raise AuthError("the token has expired")
    minted = await mint(port, scope, grant.table_namespace, grant.operations, ttl_s=ttl_s,
                        limits=limits)
    metrics.session_minted(minted.expires_at.timestamp())  # `runplane_sessions_live`
    expires_at = minted.expires_at.isoformat()
    answer: JsonObject = {
        "expires_at": expires_at, "org": grant.org_id, "play": grant.play,
        "table_namespace": grant.table_namespace, "operations": list(grant.operations),
        "schema": minted.schema, "limits": limits.as_dict() if limits is not None else {},
    }
    url = minted.url(session_dsn or port.settings.dsn)
    if public_key is None:
        answer["postgres_url"] = url
    else:
        answer["encrypted_postgres_url"] = jwe.encrypt(
            url.encode("utf-8"), public_key,
            {"org": grant.org_id, "play": grant.play, "expires_at": expires_at})
    return answer


# -- doctor -----------------------------------------------------------------------------------
async def password_probe(tenant: Tenant) -> str:
    """One line for `runplane doctor`: whether a session role can log in without its password.

    Creates a throwaway member of the group (no grants, valid for a minute), tries to connect as
    it with no password, and drops it. Starts with "WARNING" when the server let it in.
    """
    role = ROLE_PREFIX + "probe_" + secrets.token_hex(6)
    async with tenant.login_connection() as conn:
        if not await group_exists(conn):
            return f"sessions unavailable: no {GROUP} role (the login may not create roles)"
        try:
            await conn.execute(
                f"CREATE ROLE {quote_ident(role)} LOGIN VALID UNTIL"
                f" '{(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=1)).isoformat()}'"
                f" PASSWORD '{scram_verifier(secrets.token_urlsafe(24))}' IN ROLE {quote_ident(GROUP)}")
        except InsufficientPrivilegeError as exc:
            return f"sessions cannot be checked: the login may not create roles ({exc})"
    try:
        try:
            raw = await tenant.driver.connect(session_url(tenant.dsn, role, None), server_settings={})
        except Exception as exc:  # any refusal is what we hope for; say which
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"ok: a session role without its password was refused ({reason})"
        await pg.close_gracefully(raw, tenant.driver)
        return (f"WARNING: a member of {GROUP} logged in WITHOUT a password; put "
                f"'local all +{GROUP} scram-sha-256' and 'host all +{GROUP} 0.0.0.0/0 "
                "scram-sha-256' ahead of any trust line in pg_hba.conf")
    finally:
        async with tenant.login_connection() as conn:
            await conn.execute(f"DROP ROLE IF EXISTS {quote_ident(role)}")
