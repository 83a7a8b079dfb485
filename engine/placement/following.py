"""A tenant on a direct connection that follows its org from server to server while it runs.

How it works
- `following(path, org)` opens a router on the tenants file (`open_router`: the control table,
  polled every second) and, for the block, sets `engine.opening.PLACER` (`placed`): a tenant
  opened there without a DSN (`open_tenant`, `open_reader`) connects to the server its org is
  placed on now and gets a `Following` as its `route` (`engine.tenant.Route`). An org the
  control table does not name (a console's reader) follows `org`.
- Each checkout and each new connection of the tenant asks the router first (a lookup in the
  placements the last poll read, no I/O). Once the org's server changed, the tenant is pointed
  at the new one (`Tenant.moved_to`): idle pooled connections to the old server close, the
  ones checked out close when they are released, new ones go to the new server; the first of
  them reads the schema's lock material there (each server has its own).
- While the org is fenced its writes on the old server fail with SQLSTATE 55P03
  (`LockTimeoutError`, a `StoreUnavailableError`): a run rides them within its outage budget
  and retries, and once the route switched its retries land on the new server. Runs in flight
  are cut there and resume on the target with what they hold (their run, epoch and cache).
  Reads are not fenced: until the switch they read the old server, which holds every row.
- A reader on a replica (`RUNPLANE_READ_DSN`) is given a DSN, so it is not placed: it reads
  the replica, as without a tenants file.
- The schema never changes with a move (the target keeps the org's schema name).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import AsyncIterator, Callable, Iterator

import attrs

from .. import pg
from ..dsn_text import describe_dsn
from ..errors import unwrap_single_error
from ..opening import PLACER
from ..tenant import Tenant
from .router import Router, open_router
from .tenants_file import DEFAULT_ORG

log = logging.getLogger("runplane.placement")


@attrs.define(eq=False)
class Following:
    """A tenant's route: the org's server as the router sees it (module docstring)."""

    router: Router
    org: str
    at: str = attrs.field(repr=False)  # the DSN the route gave when last asked
    _opened_on: weakref.WeakKeyDictionary[pg.RawConnection, str] = attrs.field(
        init=False, factory=weakref.WeakKeyDictionary, repr=False)
    _material_due: bool = attrs.field(init=False, default=False)
    moves: int = attrs.field(init=False, default=0)

    def dsn(self) -> str:
        return self.router.dsn(self.router.resolve(self.org).server)

    @property
    def tenants_file(self) -> str | None:
        """The file the router read (local worker processes follow the org with it)."""
        path = self.router.file.path
        return None if path is None else os.path.abspath(path)

    def follow(self, tenant: Tenant) -> None:
        dsn = self.dsn()
        if dsn == self.at:
            return
        self.at = dsn
        self.moves += 1
        self._material_due = tenant.lock_secret is not None or bool(tenant.sheet_lock_keys)
        log.info("placement: org %s moved: its connections go to %s now", self.org,
                 describe_dsn(dsn))
        tenant.moved_to(dsn)

    async def opened(self, tenant: Tenant, raw: pg.RawConnection, dsn: str) -> None:
        self._opened_on[raw] = dsn
        if not self._material_due or dsn != tenant.dsn:
            return
        try:
            await tenant.read_lock_material(pg.Connection(raw, tenant.driver))
        except BaseException:
            pg.terminate(raw)
            raise
        self._material_due = False

    def current(self, tenant: Tenant, raw: pg.RawConnection) -> bool:
        """Whether `raw` may be pooled again: it reaches the server the tenant uses now."""
        return self._opened_on.get(raw, tenant.dsn) == tenant.dsn


def placer(router: Router, org: str) -> Callable[[str], tuple[str, Following]]:
    """Where a tenant of `tenant_org` connects and what it follows: its own placement when the
    control table names that org, else `org`'s (a console's reader, or an org only the
    default places, goes where `org` lives)."""
    def place(tenant_org: str) -> tuple[str, Following]:
        named = tenant_org in router.placements and tenant_org != DEFAULT_ORG
        follows = tenant_org if named else org
        dsn = router.dsn(router.resolve(follows).server)
        return dsn, Following(router, follows, dsn)
    return place


@contextlib.contextmanager
def placed(router: Router, org: str) -> Iterator[None]:
    """Tenants opened in the block without a DSN connect where `router` places their org (or
    `org`) and follow it (`engine.opening.PLACER`)."""
    token = PLACER.set(placer(router, org))
    try:
        yield
    finally:
        PLACER.reset(token)


@contextlib.asynccontextmanager
async def following(path: str, org: str) -> AsyncIterator[Router]:
    """A router on the tenants file at `path`, polled until the block ends, in which tenants
    opened without a DSN follow `org` (`placed`). A lone error of the block comes out as
    itself (not in the router's exception group)."""
    with unwrap_single_error():
        async with open_router(path) as router:
            router.resolve(org.strip())  # a ScopeError before anything else connects
            with placed(router, org.strip()):
                yield router
