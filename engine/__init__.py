"""runplane's engine: tenants, scopes, canonical JSON, runs, receipts, array inputs, sheets.

The root holds the spine every capability uses (errors, identifier quoting, the `Port` and the
action registry, tenants, permits, the schema, the embedded server, diagnostics, tokens) and
the public modules `canonical` and `receipts`; each capability is a package whose docstring
says what it holds and who may call it: `pg`, `values`, `limits`, `runs`, `array_input`,
`sheets`, `shared`, `sessions`, `gateway`, `console`.
"""

from .pg import Connection
from .ports import Port
from .values.scopes import MapScope, PlayScope, RunRef, RunScope
from .opening import open_tenant
from .tenant import Tenant

__all__ = [
    "open_tenant", "Tenant", "Port", "Connection", "PlayScope", "RunScope", "MapScope", "RunRef",
]
