"""How big a hosting process's connection budget is (`engine.limits.connections`).

The server's `max_connections` is shared out (docs/guide/operations.md, "Connection budget"):

    max_connections = owner reserve + session budget + each hosting process's budget

- owner reserve: `superuser_reserved_connections`, plus `reserved_connections` on PostgreSQL
  16+ (what the server keeps for owner logins);
- session budget: `RUNPLANE_SESSIONS_PER_SERVER` (16) × each session role's connection limit
  (8), what database sessions may hold at most (`engine.sessions.limits`);
- what is left is for runplane's own processes. A hosting process (the gateway) takes
  `HOSTING_SHARE` (half) of it by default: the other half is for the runners, workers, the
  console and `runplane` commands that connect directly, and for the few connections a
  budget overdraws. `--max-connections N` sets the budget instead (size the server so the sum
  above holds for every process).
When the session budget leaves less than `MIN_HOSTING` connections, the default is a quarter of
what the server allows past its reserve (the server is too small for the session budget; a log
line says so).

A server on this machine (this process reaches it over a Unix-domain socket or a loopback
address, and the server sees its end of the connection so too: not a local pooler in front of
a remote server; the embedded server is one) shares this machine's cores: the default is then
at most `PER_CORE` connections a core (`local_cores`). Past a few active connections a core, a
busy server spends more CPU on them than they bring (docs/guide/benchmarks.md, ninth pass: a
hundred orgs mapping through one gateway on two cores did about 20 % more rows/s with 12
connections than with 48). A remote server's cores cannot be read over SQL, so its default is
the share alone. The figures are read once, when the budget is made (`server_budget`).
"""

from __future__ import annotations

import logging
import os

import attrs

from .. import pg
from ..errors import TenantUnreachableError
from ..sessions.limits import SESSION_CONNECTION_LIMIT, sessions_per_server
from ..tenant import describe_dsn
from .connections import ServerBudget

log = logging.getLogger("runplane.connections")

HOSTING_SHARE = 0.5
MIN_HOSTING = 4
PER_CORE = 6  # a local server's default: at most this many connections a core of this machine
# `inet_server_addr()` is NULL over a Unix-domain socket.
_LIMITS = """
SELECT current_setting('max_connections')::int AS max,
       current_setting('superuser_reserved_connections')::int AS superuser_reserved,
       coalesce(current_setting('reserved_connections', true)::int, 0) AS reserved,
       coalesce(inet_server_addr() << '127.0.0.0/8'::inet
                OR inet_server_addr() = '::1'::inet, true) AS local
"""


@attrs.frozen
class ServerConnections:
    """What a server allows: `max_connections` and what it keeps for owner logins; `local`:
    it runs on this machine (reached over a Unix-domain socket or a loopback address)."""

    max_connections: int
    superuser_reserved: int
    reserved: int = 0
    local: bool = False

    @property
    def owner_reserve(self) -> int:
        return self.superuser_reserved + self.reserved


def default_size(server: ServerConnections, session_connections: int,
                 cores: int = 0) -> tuple[int, str]:
    """The default budget for `server` with `session_connections` set aside for database
    sessions, at most `PER_CORE` a core when the server is local and `cores` is known, and
    how it was reached (module docstring)."""
    allowed = server.max_connections - server.owner_reserve
    hosting = allowed - session_connections
    if hosting < MIN_HOSTING:
        size = max(1, allowed // 4)
        source = (f"a quarter of max_connections {server.max_connections} - reserve "
                  f"{server.owner_reserve}: the session budget ({session_connections}) "
                  "leaves too little; raise max_connections")
    else:
        size = max(1, int(hosting * HOSTING_SHARE))
        source = (f"half of max_connections {server.max_connections} - reserve "
                  f"{server.owner_reserve} - sessions {session_connections}")
    if server.local and cores > 0 and size > PER_CORE * cores:
        return PER_CORE * cores, (f"{PER_CORE} a core: the server is on this machine, "
                                  f"{cores} cores; below {source}")
    return size, source


def local_cores() -> int:
    """The cores this process may run on (a local server shares them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


async def read_server_connections(dsn: str) -> ServerConnections:
    """The server's connection settings, read on a connection of its own (closed after);
    `TenantUnreachableError` when it cannot be reached (an outage: the caller retries)."""
    async with pg.open_driver() as driver:
        try:
            raw = await driver.connect(dsn, server_settings={"application_name": "runplane"})
        except Exception as exc:
            reason = str(exc).replace(dsn, describe_dsn(dsn)) or type(exc).__name__
            raise TenantUnreachableError(
                f"cannot read the connection limits of {describe_dsn(dsn)}: {reason}") from exc
        try:
            row = await pg.Connection(raw, driver).fetchrow(_LIMITS)
            # both ends say local: a pooler on this machine may front a remote server
            local = row["local"] and pg.reached_locally(raw)
        finally:
            await pg.close_gracefully(raw, driver)
    return ServerConnections(row["max"], row["superuser_reserved"], row["reserved"], local)


async def server_budget(dsn: str, size: int | None = None) -> ServerBudget:
    """A budget of `size` connections (`--max-connections`), else the default for the server
    at `dsn` (read now); logged once, with how it was sized."""
    if size is not None:
        budget = ServerBudget(size, "--max-connections")
    else:
        server = await read_server_connections(dsn)
        size, source = default_size(server, sessions_per_server() * SESSION_CONNECTION_LIMIT,
                                    local_cores())
        budget = ServerBudget(size, source)
    log.info("connection budget for %s: %d (%s)", describe_dsn(dsn), budget.size, budget.source)
    return budget


__all__ = ["ServerConnections", "default_size", "local_cores", "read_server_connections",
           "server_budget", "HOSTING_SHARE", "PER_CORE"]
