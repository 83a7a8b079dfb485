"""`runplane doctor`'s account of where the server is and how to reach it with psql.

- The embedded default (no DSN): its `postmaster.pid` gives the socket directory, port, data
  directory and pid; the connection string is a `postgresql://` URI naming the socket directory
  and port, which `psql` accepts as is.
- A DSN: the DSN itself without its password (psql asks for it, or reads `PGPASSWORD` /
  `~/.pgpass`); the data directory when the login may read it; the pid only when the server is
  on this machine (a unix-socket DSN whose data directory holds a live `postmaster.pid`).
"""

from __future__ import annotations

import os
import shlex
import urllib.parse
from pathlib import Path
from runplane.engine.embedded import EmbeddedServer, default_pgdata, embedded_server
from runplane.engine.errors import DatabaseError
from runplane.engine.pg import Connection
from runplane.engine.sql import qualified
from runplane.engine.tenant import OUTAGE_BUDGET_ENV, Tenant


def without_password(dsn: str) -> str:
    """The DSN with its password removed (URL or key=value form)."""
    if "://" not in dsn:
        return " ".join(part for part in dsn.split() if not part.startswith("password="))
    url = urllib.parse.urlsplit(dsn)
    query = urllib.parse.urlencode(
        [(k, v) for k, v in urllib.parse.parse_qsl(url.query, keep_blank_values=True)
         if k != "password"], safe="/")
    if url.password is None and "password=" not in url.query:
        return dsn
    netloc = url.netloc.rpartition("@")[2]
    if url.username is not None:
        netloc = f"{urllib.parse.quote(url.username, safe='')}@{netloc}"
    return urllib.parse.urlunsplit((url.scheme, netloc, url.path, query, url.fragment))


def _socket_host(dsn: str) -> bool:
    if "://" in dsn:
        url = urllib.parse.urlsplit(dsn)
        host = url.hostname or (urllib.parse.parse_qs(url.query).get("host") or [""])[0]
    else:
        fields = dict(part.split("=", 1) for part in dsn.split() if "=" in part)
        host = fields.get("host", "")
    return host.startswith("/")


async def _data_directory(conn: Connection) -> str | None:
    try:
        return await conn.fetchval("SELECT current_setting('data_directory')")
    except DatabaseError:  # needs superuser or pg_read_all_settings
        return None


async def connection_lines(conn: Connection, dsn: str | None) -> list[str]:
    """`connect`, `data dir` and `server pid` lines of the report."""
    server: EmbeddedServer | None
    if dsn is None:
        server = embedded_server(default_pgdata())
        connect = server.psql_uri if server is not None else "(the embedded server stopped)"
        data_dir = str(server.data_dir) if server is not None else str(default_pgdata())
    else:
        connect = without_password(dsn)
        data_dir = await _data_directory(conn)
        server = embedded_server(Path(data_dir)) if data_dir and _socket_host(dsn) else None
    pid = str(server.pid) if server is not None else "unknown (the server is not on this machine)"
    lines = [f"connect     psql {shlex.quote(connect)}"]
    if dsn is None:  # the embedded server stops with the last runplane process using it
        lines.append("            (works while a runplane process keeps the embedded server up;"
                     " `runplane psql` keeps it up for its psql session)")
    return lines + [
        f"data dir    {data_dir or 'not visible to this login'}",
        f"server pid  {pid}",
    ]


def outage_line(tenant: Tenant) -> str:
    """The `outage` line: the outage budget runs on this tenant get, and where it comes from."""
    source = (f"from {OUTAGE_BUDGET_ENV}" if os.environ.get(OUTAGE_BUDGET_ENV)
              else f"the default; set {OUTAGE_BUDGET_ENV} to change it")
    return (f"outage      budget {tenant.outage_budget_s:g}s ({source}): a run waits this long "
            "for a database that is away, then ends with its resume command")


# Client connections: a login's backends (another role's show no backend type to a login
# without pg_read_all_stats, but do show their user).
_CLIENTS = "usesysid IS NOT NULL AND coalesce(backend_type, 'client backend') = 'client backend'"
_CONNECTIONS = """
SELECT current_setting('max_connections')::int AS max,
       current_setting('superuser_reserved_connections')::int
         + coalesce(current_setting('reserved_connections', true)::int, 0) AS reserved,
       (SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE {clients})::int AS used
"""
_BY_ROLE = """
SELECT coalesce(usename::text, '?') AS role, count(*)::int AS n
  FROM pg_catalog.pg_stat_activity WHERE {clients}
 GROUP BY 1 ORDER BY 2 DESC, 1
"""
# Database sessions' connections by org: a session role is recorded with its org.
_SESSIONS_BY_ORG = """
SELECT s.org_id, count(*)::int AS n
  FROM {scopes} AS s JOIN pg_catalog.pg_stat_activity AS a ON a.usename = s.role_name
 GROUP BY 1 ORDER BY 2 DESC, 1
"""
# The privileges beyond CREATEROLE and CREATE that some guarantees need
# (docs/guide/production.md, "No superuser: the owner role").
_EXTRA_PRIVILEGES = (
    ("pg_signal_backend", "ends expired and overdue database sessions' connections"),
    ("pg_use_reserved_connections", "gets in when sessions fill the server (PostgreSQL 16+)"),
)


def _listed(pairs: list[tuple[str, int]], limit: int = 8) -> str:
    shown = ", ".join(f"{name} {n}" for name, n in pairs[:limit])
    return shown + (f", … {len(pairs) - limit} more" if len(pairs) > limit else "")


async def connection_budget_lines(conn: Connection, schema: str) -> list[str]:
    """`connections` lines: the server's headroom, connections by role, database sessions'
    connections by org, and the privileges this login lacks (a superuser lacks none)."""
    budget = await conn.fetchrow(_CONNECTIONS.format(clients=_CLIENTS))
    free = budget["max"] - budget["reserved"] - budget["used"]
    lines = [f"connections {budget['used']} of {budget['max']} in use ({budget['reserved']} "
             f"reserved): headroom {max(free, 0)}"]
    roles = [(r["role"], r["n"]) for r in await conn.fetch(_BY_ROLE.format(clients=_CLIENTS))]
    lines.append(f"            by role: {_listed(roles) or 'none'}")
    try:
        async with conn.transaction():  # a savepoint inside a checkout's own transaction
            orgs = [(r["org_id"], r["n"]) for r in await conn.fetch(
                _SESSIONS_BY_ORG.format(scopes=qualified(schema, "session_scopes")))]
        lines.append(f"            database sessions by org: {_listed(orgs) or 'none'}")
    except DatabaseError:  # no schema yet, or this login may not read its session scopes
        pass
    superuser = await conn.fetchval("SELECT rolsuper FROM pg_catalog.pg_roles"
                                    " WHERE rolname = current_user")
    if not superuser:
        for role, why in _EXTRA_PRIVILEGES:
            held = await conn.fetchval(
                "SELECT CASE WHEN to_regrole($1) IS NULL THEN NULL"
                " ELSE pg_catalog.pg_has_role(current_user, $1, 'USAGE') END", role)
            if held is False:
                lines.append(f"privileges  missing {role}: it {why} "
                             f"(GRANT {role} TO {await conn.fetchval('SELECT current_user')})")
    return lines
