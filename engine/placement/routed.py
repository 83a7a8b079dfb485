"""The gateway's tenants over many servers: each request goes to the server of its org.

`RoutedTenants` answers `get(org)` as `engine.gateway.tenants.OrgTenants` does, after asking the
router (`engine.placement.router`) where the org lives now: a fenced org (a move under way) is
refused with `StoreUnavailableError` (the gateway answers 503 with `retry_after_ms`, which
clients ride); an org the file does not place is refused with `ScopeError` (403). Each
(server, schema) has its own `OrgTenants`, opened on first use, with its own connection budget.
An org moved away keeps its tenant on the old server until the gateway stops (its idle
connections close after 15 s); nothing routes to it any more.
"""

from __future__ import annotations

from typing import Mapping

import attrs
import trio

from ..errors import StoreUnavailableError
from ..gateway.tenants import OrgTenants
from ..limits.connections import BudgetStats
from ..tenant import Tenant
from .router import Router


@attrs.define(eq=False)
class RoutedTenants:
    """The open tenants of a gateway routing by org (see the module docstring)."""

    router: Router
    options: Mapping[str, object] = attrs.field(factory=dict)
    max_connections: int | None = None
    _servers: dict[tuple[str, str], OrgTenants] = attrs.field(init=False, factory=dict)
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None, repr=False)

    def serve_in(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        for tenants in self._servers.values():
            tenants.serve_in(nursery)

    def close(self) -> None:
        self._nursery = None
        for tenants in self._servers.values():
            tenants.close()

    def budget_stats(self) -> BudgetStats | None:
        for tenants in self._servers.values():
            stats = tenants.budget_stats()
            if stats is not None:
                return stats
        return None

    def server_of(self, org: str) -> str:
        """The server `org` is routed to now (ScopeError when the file places it nowhere)."""
        return self.router.resolve(org).server

    async def get(self, org: str) -> Tenant:
        placement = self.router.resolve(org)
        if placement.fenced:
            raise StoreUnavailableError(
                f"org {org!r} is being moved to another server; retry shortly")
        key = (placement.server, placement.schema)
        tenants = self._servers.get(key)
        if tenants is None:
            if self._nursery is None:
                raise StoreUnavailableError("the gateway is shutting down")
            tenants = self._servers[key] = OrgTenants(
                self.router.dsn(placement.server), placement.schema, self.options,
                self.max_connections)
            tenants.serve_in(self._nursery)
        return await tenants.get(org)
