"""The gateway's tenants: one per org, opened on the org's first request and kept until the
server stops.

How it works
- `OrgTenants.get(org)` answers at once for an org whose tenant is open. An org's first request
  starts a holder task in the server's nursery (`serve_in`), which opens the org's tenant (the
  server's DSN and schema, `options` for the rest) and keeps it open; that request and any
  other of the org arriving meanwhile wait for it. A tenant that could not be opened is
  forgotten: every waiter gets the error, and the org's next request tries again.
- The first tenant that opens also runs the session sweep (`sessions.sweep_expired`: the
  schema's expired session roles dropped every minute) for as long as it is held.
- Tenants open sharing what the first one read of the schema and the server
  (`engine.opening.SharedOpening`): an org's opening after the first sends no statement.
- Every tenant draws on one connection budget for the server (`engine.limits.connections`):
  `max_connections` slots, else the server's default share (`engine.limits.server_share`,
  read on the first request: an unreachable server fails that request, and the next one reads
  again). Orgs past the budget wait in its fair line, within their request's deadline.
- `close()` (the server has stopped serving) refuses new orgs (`StoreUnavailableError`) and has
  every holder close its tenant.
`gateway_tenants` opens these, or a gateway's tenants over many servers
(`engine.placement.routed`: one `OrgTenants` per server, each org routed by the control table).
Only `engine.gateway.server` and `engine.placement.routed` use this module.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping

import attrs
import trio

from .. import sessions
from ..embedded import resolve_dsn
from ..errors import EngineError, StoreUnavailableError
from ..limits.connections import BudgetStats, ServerBudget, hosting
from ..limits.server_share import server_budget
from ..opening import SharedOpening, open_tenant, sharing
from ..tenant import Tenant

if TYPE_CHECKING:
    from ..placement.routed import RoutedTenants
    from ..placement.router import Router


@attrs.define(eq=False)
class _TenantSlot:
    """One org's tenant, once its holder opened it (or the error that kept it from opening)."""

    ready: trio.Event = attrs.field(factory=trio.Event)
    tenant: Tenant | None = None
    error: BaseException | None = None


@attrs.define(eq=False)
class OrgTenants:
    """The open tenants of a gateway, by org (see the module docstring). `options` are the
    keyword arguments of `open_tenant` besides the DSN and schema; `max_connections` the
    budget's size (None: the server's default share)."""

    dsn: str = attrs.field(repr=False)
    schema: str
    options: Mapping[str, object] = attrs.field(factory=dict)
    max_connections: int | None = None
    budget: ServerBudget | None = attrs.field(init=False, default=None)
    _sizing: trio.Lock = attrs.field(init=False, factory=trio.Lock, repr=False)
    _slots: dict[str, _TenantSlot] = attrs.field(init=False, factory=dict, repr=False)
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None, repr=False)
    _sweeping: bool = attrs.field(init=False, default=False, repr=False)
    _closing: trio.Event = attrs.field(init=False, factory=trio.Event, repr=False)
    _opening: SharedOpening = attrs.field(init=False, factory=SharedOpening, repr=False)

    def serve_in(self, nursery: trio.Nursery) -> None:
        """Hold the tenants opened from now on in `nursery` (the server's)."""
        self._nursery = nursery

    def close(self) -> None:
        """Open no more tenants, and close the open ones (their holders end)."""
        self._nursery = None
        self._closing.set()

    def budget_stats(self) -> BudgetStats | None:
        """The connection budget's figures, starting a new period for the longest wait (None
        before the first request sized the budget)."""
        return None if self.budget is None else self.budget.stats(new_period=True)

    async def _size_budget(self) -> None:
        async with self._sizing:
            if self.budget is None:
                self.budget = await server_budget(self.dsn, self.max_connections)

    async def get(self, org: str) -> Tenant:
        """The tenant of `org`, opened on first use; raises what opening it raised."""
        slot = self._slots.get(org)
        if slot is not None and slot.tenant is not None:
            return slot.tenant  # open already: no wait (nor a trip through the scheduler)
        if self.budget is None:
            await self._size_budget()
        slot = self._slots.get(org)
        if slot is None:
            if self._nursery is None:
                raise StoreUnavailableError("the gateway is shutting down")
            slot = self._slots[org] = _TenantSlot()
            self._nursery.start_soon(self._hold, org, slot)
        await slot.ready.wait()
        if slot.tenant is None:
            assert slot.error is not None
            raise slot.error
        return slot.tenant

    async def _hold(self, org: str, slot: _TenantSlot) -> None:
        try:
            with hosting(self.budget), sharing(self._opening):
                async with open_tenant(org, self.dsn, schema=self.schema, **self.options) as tenant:
                    slot.tenant = tenant
                    slot.ready.set()
                    await self._keep(tenant)
        except EngineError as exc:
            slot.error = exc
            if self._slots.get(org) is slot:
                del self._slots[org]  # the next request tries again
        finally:
            slot.ready.set()

    async def _keep(self, tenant: Tenant) -> None:
        """Hold `tenant` open until `close()`."""
        async with trio.open_nursery() as nursery:
            if not self._sweeping:  # one tenant's login drops the schema's expired sessions
                self._sweeping = True
                nursery.start_soon(sessions.sweep_expired, tenant)
            await self._closing.wait()
            nursery.cancel_scope.cancel()


async def gateway_tenants(dsn: str | None, schema: str, options: Mapping[str, object],
                          max_connections: int | None,
                          router: Router | None) -> OrgTenants | RoutedTenants:
    """A gateway's tenants: on `dsn` (default `RUNPLANE_DSN`, else the embedded server) and
    `schema`, or with a `router` each org on its own server (`engine.placement.routed`)."""
    if router is not None:
        from ..placement.routed import RoutedTenants  # it builds on this module

        return RoutedTenants(router, options, max_connections)
    resolved = dsn or os.environ.get("RUNPLANE_DSN") or await resolve_dsn()
    return OrgTenants(resolved, schema, options, max_connections)
