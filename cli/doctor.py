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
