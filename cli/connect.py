"""Where a command's engine operations go: a tenant's database, or a gateway.

`open_port(args)` opens the tenant the options name (`--dsn`, `--org`, `--schema`), or, with
`--gateway URL` (or `RUNPLANE_GATEWAY_URL`), a `Gateway` acting with the token in
`RUNPLANE_TOKEN`: its org is the token's, and the command needs no database access at all.
`require_tenant_schema(port)` is the one place a command asks which of the two it opened.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import AsyncIterator

from runplane.engine import open_tenant
from runplane.engine.actions import RemotePort
from runplane.engine.ports import Port

from .operators import UsageError, require_schema


@contextlib.asynccontextmanager
async def open_port(args: argparse.Namespace, *, read_only: bool = False) -> AsyncIterator[Port]:
    """The tenant the options name (with `read_only`, one that bootstraps nothing), or with
    `--gateway` a Gateway acting with RUNPLANE_TOKEN (over database sessions with
    `--db-sessions`)."""
    if getattr(args, "gateway", None):
        from runplane.engine.gateway import open_gateway

        token = os.environ.get("RUNPLANE_TOKEN", "").strip()
        if not token:
            raise UsageError("--gateway needs a token in RUNPLANE_TOKEN "
                             "(make one with `runplane token`)")
        async with open_gateway(args.gateway, token,
                                db_sessions=getattr(args, "db_sessions", False)) as gateway:
            yield gateway
    else:
        if getattr(args, "db_sessions", False):
            raise UsageError("--db-sessions needs --gateway URL (or RUNPLANE_GATEWAY_URL)")
        async with open_tenant(args.org, args.dsn, schema=args.schema,
                               bootstrap=not read_only) as tenant:
            yield tenant


async def require_tenant_schema(port: Port) -> None:
    """`operators.require_schema` when `open_port` opened a tenant; nothing for a gateway (a
    connection kind, not a capability), which checks its own schema."""
    if not isinstance(port, RemotePort):
        await require_schema(port)
