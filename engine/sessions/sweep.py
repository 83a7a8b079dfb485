"""Dropping database sessions once they expire (`engine.sessions` mints them).

How it works
- `drop_expired(tenant)` picks this schema's session roles whose `VALID UNTIL` has passed (or
  whose role is gone), terminates every connection still open under them
  (`pg_terminate_backend`, waiting up to `TERMINATE_WAIT_MS` for each backend to exit: an
  expired session keeps no connection that still reads or writes), then drops the roles with
  everything they own or were granted, and their scope rows. The login needs to be a
  superuser, a member of `pg_signal_backend`, or to have privileges of the session roles (the
  login that created them, PostgreSQL 16+); when it may not signal them it says so in the log
  and drops only the roles that have no open connection.
- `include_unexpired` also drops unexpired roles that have no open connection when looked at
  (for tests, and for revoking a schema's sessions at once); their connections are not cut.
- `end_overdue(tenant)` terminates this schema's session backends that are past the limits of
  `limits.ROLE_TIMEOUTS`, whatever the session `SET`: idle in a transaction past the
  idle limit, a statement running past the statement limit, a lock wait past the lock limit, a
  transaction older than statement + idle limits. So no session pins the vacuum horizon (or
  holds its locks) past its limit for longer than one overdue interval.
- `sweep_expired(tenant)` runs `end_overdue` every `OVERDUE_INTERVAL_S` and `drop_expired`
  every `SWEEP_INTERVAL_S` until cancelled: the gateway and `runplane supervise` run it, so an
  expired session's connections end within one interval of its expiry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from .. import pg
from ..errors import DatabaseError, EngineError, InsufficientPrivilegeError
from .isolation import SCOPES_TABLE
from .limits import ROLE_TIMEOUTS, SessionTimeouts
from ..sql import qualified, quote_ident

if TYPE_CHECKING:
    from ..tenant import Tenant

DROP_BATCH = 200
SWEEP_INTERVAL_S = 60.0
OVERDUE_INTERVAL_S = 5.0
TERMINATE_WAIT_MS = 5_000

log = logging.getLogger("runplane.sessions")

_DROPPABLE = """
SELECT m.role_name, m.sheet_table,
       EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity AS a WHERE a.usename = m.role_name)
           AS connected
  FROM {m} AS m
  LEFT JOIN pg_catalog.pg_roles AS r ON r.rolname = m.role_name
 WHERE (r.oid IS NULL OR r.rolvaliduntil < clock_timestamp()
        OR ($1 AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity AS a
                                WHERE a.usename = m.role_name)))
 ORDER BY m.expires_at
 LIMIT $2
   FOR UPDATE OF m SKIP LOCKED
"""

# Terminates the roles' backends and waits for each to exit; the count is of those that did not.
_TERMINATE = """
SELECT count(*) FILTER (WHERE NOT pg_catalog.pg_terminate_backend(a.pid, $2::bigint))
  FROM pg_catalog.pg_stat_activity AS a
 WHERE a.usename = ANY($1::text[]) AND a.pid <> pg_catalog.pg_backend_pid()
"""


# Session backends past a limit, with the limit they passed; `state_change` of an active backend
# is when its statement started (or, waiting on a lock, when it began to wait at the latest).
_OVERDUE = """
SELECT a.pid, a.usename AS role_name,
       CASE WHEN a.xact_start < now - make_interval(secs => $4) THEN 'transaction'
            WHEN a.state LIKE 'idle in transaction%' THEN 'idle in transaction'
            WHEN a.wait_event_type = 'Lock' AND a.state_change < now - make_interval(secs => $3)
                THEN 'lock wait'
            ELSE 'statement' END AS why
  FROM pg_catalog.pg_stat_activity AS a, (SELECT clock_timestamp() AS now) AS t
 WHERE a.usename IN (SELECT m.role_name FROM {m} AS m)
   AND a.pid <> pg_catalog.pg_backend_pid()
   AND (a.xact_start < now - make_interval(secs => $4)
        OR (a.state LIKE 'idle in transaction%' AND a.state_change < now - make_interval(secs => $1))
        OR (a.state = 'active' AND a.query_start < now - make_interval(secs => $2))
        OR (a.state = 'active' AND a.wait_event_type = 'Lock'
            AND a.state_change < now - make_interval(secs => $3)))
"""


def _revokes(schema: str, roles: list[str], sheet_tables: list[str]) -> str:
    rs = ", ".join(quote_ident(r) for r in roles)
    tables = ", ".join(qualified(schema, t) for t in (
        "meta", SCOPES_TABLE, "work_receipts", "sheet_summary", "sheet_column_summary",
        "sheet_columns", "sheet_reuse", "sheet_counter_deltas", "sheet_column_deltas",
        *sheet_tables))
    return (f"REVOKE ALL ON SCHEMA {quote_ident(schema)} FROM {rs};\n"
            f"REVOKE ALL ON TABLE {tables} FROM {rs};\n"
            f"REVOKE ALL ON SEQUENCE {qualified(schema, 'row_versions')} FROM {rs}")


async def _drop_owned(conn: pg.Connection, roles: str) -> bool:
    """`DROP OWNED BY roles` (quoted, comma-separated); False when this login may not. A
    superuser may; an owner role with CREATEROLE administers the roles it created and may once
    it made itself their member."""
    for statements in ((f"DROP OWNED BY {roles}",),
                       (f"GRANT {roles} TO CURRENT_USER", f"DROP OWNED BY {roles}")):
        try:
            async with conn.transaction():
                for statement in statements:
                    await conn.execute(statement)
            return True
        except InsufficientPrivilegeError:
            continue
    return False


async def _drop_roles(conn: pg.Connection, schema: str, roles: list[str], sheet_tables: list[str]) -> None:
    """Drop `roles` with what they own and were granted (one savepoint, all or nothing)."""
    async with conn.transaction():
        existing = await conn.fetchval(
            "SELECT coalesce(array_agg(rolname::text), '{}') FROM pg_catalog.pg_roles"
            " WHERE rolname = ANY($1::text[])", roles)
        if existing:
            rs = ", ".join(quote_ident(r) for r in existing)
            if not await _drop_owned(conn, rs):
                # Revoke what mint granted instead. A role that still owns something (a large
                # object it made) then cannot be dropped; every sweep tries again.
                present = await conn.fetchval(
                    "SELECT coalesce(array_agg(t), '{}') FROM unnest($1::text[]) AS t"
                    " WHERE to_regclass(quote_ident($2) || '.' || quote_ident(t)) IS NOT NULL",
                    sheet_tables, schema)
                await conn.execute(_revokes(schema, existing, list(present)))
            await conn.execute(f"DROP ROLE {rs}")
        await conn.execute(
            f"DELETE FROM {qualified(schema, SCOPES_TABLE)} WHERE role_name = ANY($1::text[])", roles)


async def _terminate(conn: pg.Connection, rows: list[Any]) -> list[Any]:
    """End the connections of the expired roles among `rows`; return the rows to drop (those
    whose connections are gone, or that had none)."""
    connected = [r["role_name"] for r in rows if r["connected"]]
    if not connected:
        return rows
    try:
        async with conn.transaction():
            stuck = await conn.fetchval(_TERMINATE, connected, TERMINATE_WAIT_MS)
    except InsufficientPrivilegeError as exc:
        log.warning("cannot end the connections of expired database sessions (grant the login "
                    "pg_signal_backend): %s", exc)
        return [r for r in rows if not r["connected"]]
    if stuck:
        log.warning("%d connection(s) of expired database sessions did not end within %d ms; "
                    "their roles are dropped on a later sweep", stuck, TERMINATE_WAIT_MS)
        return [r for r in rows if not r["connected"]]
    return rows


async def drop_expired(tenant: Tenant, *, include_unexpired: bool = False, limit: int = 10_000) -> int:
    """Cut the connections of this schema's expired session roles and drop them; return how
    many roles were dropped (see the module docstring)."""
    dropped = 0
    sql = _DROPPABLE.format(m=qualified(tenant.schema, SCOPES_TABLE))
    async with tenant.login_connection() as conn:
        while dropped < limit:
            async with conn.transaction():
                await conn.execute("SELECT set_config('synchronous_commit', 'off', true)")
                rows = await conn.fetch(sql, include_unexpired, min(DROP_BATCH, limit - dropped))
                if not rows:
                    break
                droppable = await _terminate(conn, list(rows))
                roles = [row["role_name"] for row in droppable]
                tables = sorted({row["sheet_table"] for row in droppable if row["sheet_table"]})
                done = 0
                if roles:
                    try:
                        await _drop_roles(conn, tenant.schema, roles, tables)
                        done = len(roles)
                    except DatabaseError:
                        # One role is stuck (it still owns something): go one by one.
                        for role, table in [(r["role_name"], r["sheet_table"]) for r in droppable]:
                            try:
                                await _drop_roles(conn, tenant.schema, [role], [table] if table else [])
                                done += 1
                            except DatabaseError:
                                continue
                dropped += done
                if done < len(rows):
                    break
    return dropped


async def end_overdue(tenant: Tenant, timeouts: SessionTimeouts = ROLE_TIMEOUTS) -> int:
    """Terminate this schema's session backends past `timeouts` (module docstring); return how
    many were ended. Needs the same signalling privilege as `drop_expired`; without it, logs a
    warning and ends none."""
    sql = _OVERDUE.format(m=qualified(tenant.schema, SCOPES_TABLE))
    async with tenant.login_connection() as conn:
        overdue = await conn.fetch(sql, timeouts.idle_s, timeouts.statement_s, timeouts.lock_s,
                                   timeouts.transaction_s)
        ended = 0
        for row in overdue:
            try:
                if await conn.fetchval("SELECT pg_catalog.pg_terminate_backend($1)", row["pid"]):
                    ended += 1
                    log.warning("ended a connection of database session %s: %s past its limit",
                                row["role_name"], row["why"])
            except InsufficientPrivilegeError as exc:
                log.warning("cannot end overdue connections of database sessions (grant the "
                            "login pg_signal_backend): %s", exc)
                break
    return ended


async def sweep_expired(tenant: Tenant, *, interval_s: float = SWEEP_INTERVAL_S,
                        overdue_interval_s: float = OVERDUE_INTERVAL_S,
                        timeouts: SessionTimeouts = ROLE_TIMEOUTS) -> None:
    """End overdue session backends every `overdue_interval_s` and drop expired sessions every
    `interval_s`, from now until cancelled (the gateway and `runplane supervise` run this). A
    failed sweep is logged and tried again next time."""
    next_drop = trio.current_time()
    while True:
        try:
            await end_overdue(tenant, timeouts)
        except EngineError as exc:
            log.warning("ending overdue database-session connections failed (will retry): %s", exc)
        if trio.current_time() >= next_drop:
            next_drop = trio.current_time() + interval_s
            try:
                dropped = await drop_expired(tenant)
                if dropped:
                    log.info("dropped %d expired database session role(s) in schema %s", dropped,
                             tenant.schema)
            except EngineError as exc:
                log.warning("dropping expired database sessions failed (will retry): %s", exc)
        await trio.sleep(min(interval_s, overdue_interval_s))
