"""A process's view of where orgs live: the control table, polled every second.

How it works
- `open_router(path)` reads the tenants file, seeds the control table from it
  (`control.seed`), reads every placement, and polls the table every `poll_s` (1 s) for as long
  as the block runs: a gateway follows a moved or fenced org within a second, with no signal.
  A failed poll keeps the last placements read and logs one warning (the next poll retries).
- SIGHUP (where the process may receive signals: the main thread) reloads the file: new
  servers' DSNs are used from then on, and orgs it adds are seeded; placements the table
  already holds stay as they are (a move is never undone by the file).
- `resolve(org)` is the org's placement, else the `default` row's (as that org), else a
  `ScopeError` (the file refuses unnamed orgs). `wait_for_poll()` waits for the next poll to
  land (tests and the mover use it instead of sleeping).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import AsyncIterator, Mapping

import attrs
import trio

from .. import pg
from ..errors import EngineError, ScopeError
from . import control
from .control import Placement
from .tenants_file import DEFAULT_ORG, TenantsFile, load_tenants_file

POLL_S = 1.0

log = logging.getLogger("runplane.placement")


@attrs.define(eq=False)
class Router:
    """Where each org lives now (see the module docstring)."""

    file: TenantsFile
    placements: Mapping[str, Placement]
    poll_s: float = POLL_S
    polls: int = 0
    _polled: trio.Event = attrs.field(init=False, factory=trio.Event, repr=False)

    def resolve(self, org: str) -> Placement:
        """Where `org` lives (its own row, else the default's), or ScopeError."""
        placement = self.placements.get(org)
        if placement is None or org == DEFAULT_ORG:
            default = self.placements.get(DEFAULT_ORG)
            if default is None or placement is not None:
                raise ScopeError(f"org {org!r} is not placed on any server by the tenants file")
            placement = attrs.evolve(default, org=org, fenced=False, move_to=None,
                                     move_step=None)
        return placement

    def dsn(self, server: str) -> str:
        return self.file.dsn(server)

    async def wait_for_poll(self) -> None:
        """Return after the next poll has read the table (or failed to)."""
        await self._polled.wait()

    def _landed(self, placements: Mapping[str, Placement] | None) -> None:
        if placements is not None:
            self.placements = placements
        self.polls += 1
        self._polled.set()
        self._polled = trio.Event()

    async def _poll(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        conn: pg.Connection | None = None
        async with contextlib.AsyncExitStack() as stack:
            task_status.started()
            while True:
                await trio.sleep(self.poll_s)
                try:
                    if conn is None or conn.broken:
                        conn = await stack.enter_async_context(
                            control.control_connection(self.file.control_dsn))
                    self._landed(await control.read(conn))
                except EngineError as exc:
                    log.warning("placement: cannot read the control table: %s", exc)
                    conn = None
                    self._landed(None)

    async def reload(self) -> None:
        """Read the tenants file again and seed what it adds (SIGHUP)."""
        try:
            file = load_tenants_file(self.file.path or "")
            async with control.control_connection(file.control_dsn) as conn:
                await control.seed(conn, file)
                placements = await control.read(conn)
        except EngineError as exc:
            log.warning("placement: the tenants file was not reloaded: %s", exc)
            return
        self.file = file
        self._landed(placements)
        log.info("placement: reloaded %s (%d servers)", file.path, len(file.servers))

    async def _on_sighup(self) -> None:
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                await self.reload()


async def load_router(path: str, *, poll_s: float = POLL_S) -> Router:
    """A router with the placements read once (seeded from the file first); not polling."""
    file = load_tenants_file(path)
    async with control.control_connection(file.control_dsn) as conn:
        await control.seed(conn, file)
        placements = await control.read(conn)
    return Router(file, placements, poll_s)


@contextlib.asynccontextmanager
async def open_router(path: str, *, poll_s: float = POLL_S) -> AsyncIterator[Router]:
    """A router kept current until the block ends (see the module docstring)."""
    router = await load_router(path, poll_s=poll_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(router._poll)
        if threading.current_thread() is threading.main_thread():  # signals reach it only
            nursery.start_soon(router._on_sighup)
        try:
            yield router
        finally:
            nursery.cancel_scope.cancel()
