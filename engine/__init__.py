"""runplane's engine: tenants, scopes, canonical JSON, runs, receipts, array inputs, sheets."""

from .pg import Connection
from .ports import Port
from .values.scopes import MapScope, PlayScope, RunRef, RunScope
from .tenant import Tenant, open_tenant

__all__ = [
    "open_tenant", "Tenant", "Port", "Connection", "PlayScope", "RunScope", "MapScope", "RunRef",
]
