"""`open_console`: the console served alone, for every org, on loopback only.

How it works
- Opens one reader (`opening.open_reader`: no bootstrap, every transaction read-only, on
  `RUNPLANE_READ_DSN` when that names a replica) whose only lane is the console's, and serves `console_app` at `/ui` with Hypercorn's trio worker. A schema that
  holds no runplane tables yet (or does not exist) is served too: an operator may start the
  console before the first run; its runs page shows an empty state, and every page fills in
  once a run creates the schema (each read names its tables; nothing is cached at start). Every org's runs are read through that pool: the console's
  statements name the org themselves.
- Actions (cancel a run, `console.actions`) write through one tenant per org, opened at that
  org's first action (`_Writers`), so a console that is only looked at writes nothing.
- The bind must be a loopback address (127.0.0.0/8, ::1 or localhost): the one-time link is the
  only login, so the console is never offered to the network.
- `ConsoleServer.login_url()` makes a new one-time link `http://HOST:PORT/ui/login?once=CODE`
  (valid once, for a session that sees every org).
- `GET /metrics` answers the operator's `RUNPLANE_METRICS_TOKEN` bearer only
  (`engine.observability.exposition`); the console's sessions never open it.
"""

from __future__ import annotations

import contextlib
import ipaddress
from typing import AsyncIterator

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from ..errors import InvalidInputError
from ..observability.exposition import METRICS_PATH, metrics_route
from ..ports import CONSOLE_LANE, RECEIPTS_LANE, Port
from ..schema import schema_status
from ..opening import open_reader, open_tenant
from .actions import RetryStarter
from .auth import Sessions
from .routes import Console, console_app

POOL_ORG = "console"
LANE_LIMIT = 2
SHUTDOWN_GRACE_S = 2.0


def check_loopback(bind: str) -> None:
    """`InvalidInputError` unless `bind` (HOST:PORT) names a loopback host."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidInputError(f"--bind must be HOST:PORT, got {bind!r}")
    host = host.strip("[]")
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidInputError(
            f"the console binds to loopback only (127.0.0.1, ::1 or localhost), not {host!r}; "
            "to serve it to a network, use `runplane serve`, where gateway tokens log in")


@attrs.define(eq=False)
class ConsoleServer:
    console: Console
    url: str = ""
    schema_ready: bool = True  # False: the schema held no runplane tables at start

    def login_url(self) -> str:
        return f"{self.url}/ui/login?once={self.console.sessions.new_code()}"


@attrs.define(eq=False)
class _Writers:
    """The console's writers, one tenant per org, opened at the first action of that org (an
    operator who only looks never opens one), each hosted by a task of the console's nursery
    until the console closes."""

    dsn: str | None
    schema: str
    nursery: trio.Nursery | None = None
    closing: trio.Event = attrs.field(factory=trio.Event)
    _tenants: dict[str, Port] = attrs.field(factory=dict)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)

    async def get(self, org: str) -> Port:
        async with self._lock:
            if org not in self._tenants:
                if self.nursery is None or self.closing.is_set():
                    raise InvalidInputError("the console is closing")
                self._tenants[org] = await self.nursery.start(self._host, org)
            return self._tenants[org]

    async def _host(self, org: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_tenant(org, self.dsn, schema=self.schema, lanes={RECEIPTS_LANE: 1},
                               max_connections=1) as tenant:
            task_status.started(tenant)
            await self.closing.wait()


@contextlib.asynccontextmanager
async def open_console(*, dsn: str | None = None, schema: str = "runplane",
                       bind: str = "127.0.0.1:8788",
                       start_retry: RetryStarter | None = None) -> AsyncIterator[ConsoleServer]:
    """Serve the console until the block ends (see the module docstring); `start_retry` hosts
    the retries its operators start (`actions.RetryStarter`; None: no retry buttons)."""
    check_loopback(bind)
    # A reader: on RUNPLANE_READ_DSN (a replica) when set, every transaction read-only.
    async with open_reader(POOL_ORG, dsn, schema=schema, lanes={CONSOLE_LANE: LANE_LIMIT},
                           max_connections=LANE_LIMIT) as tenant:
        async with tenant.connection(CONSOLE_LANE) as conn:
            ready = await schema_status(conn, schema) is not None

        async def port_for(_org: str) -> Port:
            return tenant

        writers = _Writers(dsn, schema)
        console = Console(Sessions(), port_for, token_login=False, writer_for=writers.get,
                          start_retry=start_retry)
        app = Starlette(routes=[Mount("/ui", app=console_app(console)),  # and the operator's:
                                Route(METRICS_PATH, metrics_route, methods=["GET"])])
        config = Config()
        config.bind = [bind]
        config.accesslog = None
        config.loglevel = "WARNING"
        config.graceful_timeout = SHUTDOWN_GRACE_S
        shutdown = trio.Event()
        server = ConsoleServer(console, schema_ready=ready)
        async with trio.open_nursery() as nursery:
            writers.nursery = nursery
            binds = await nursery.start(lambda task_status: serve(
                app, config, shutdown_trigger=shutdown.wait, task_status=task_status))
            server.url = binds[0]
            try:
                yield server
            finally:
                console.closing.set()
                writers.closing.set()
                shutdown.set()
