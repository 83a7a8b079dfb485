"""Where a command's engine operations go: a tenant's database, or a gateway.

`open_port(args)` opens the tenant the options name (`--dsn`, `--org`, `--schema`), or, with
`--gateway URL` (or `RUNPLANE_GATEWAY_URL`), a `Gateway` acting with the token in
`RUNPLANE_TOKEN`: its org is the token's, and the command needs no database access at all.
With `--tenants FILE` the tenant is opened where the file's control table places `--org`, and
follows the org when it moves while the command runs (`engine.placement.following`).
`require_tenant_schema(port)` is the one place a command asks which of the two it opened.
What a command may do to the database is its `Access`: read commands (`status`, `runs`,
`failures`, `export`, `sql`) open a reader, on `RUNPLANE_READ_DSN` (a replica) when it is set,
whose every transaction is read-only; `replica_line` says how far behind that replica is.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
from typing import AsyncContextManager, AsyncIterator

from runplane.engine import open_tenant
from runplane.engine.actions import RemotePort
from runplane.engine.ports import Port
from runplane.engine.opening import open_reader, reads_replica
from runplane.engine.placement.following import following
from runplane.engine.tenant import READ_DSN_ENV, Tenant

from .operators import UsageError, require_schema


class Access(enum.Enum):
    """What a command may do to the database."""

    WRITES = "writes"    # bootstraps the schema and writes
    NO_DDL = "no DDL"    # creates no schema (`doctor`, which probes with a role of its own)
    READS = "reads"      # reads only, on RUNPLANE_READ_DSN when set


@contextlib.asynccontextmanager
async def open_port(args: argparse.Namespace, *, access: Access = Access.WRITES
                    ) -> AsyncIterator[Port]:
    """The tenant the options name, as `access` allows, or with `--gateway` a Gateway acting
    with RUNPLANE_TOKEN (over database sessions with `--db-sessions`)."""
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

        def opener(dsn: str | None) -> AsyncContextManager[Tenant]:
            if access is Access.READS:
                return open_reader(args.org, dsn, schema=args.schema)
            return open_tenant(args.org, dsn, schema=args.schema,
                               bootstrap=access is Access.WRITES)

        if getattr(args, "tenants", None):  # placed by a tenants file: follow its moves
            async with following(args.tenants, args.org):
                async with opener(None) as tenant:
                    yield tenant
            return
        async with opener(args.dsn) as tenant:
            yield tenant


async def replica_line(port: Port) -> str | None:
    """`reading from a replica …, N s behind its primary` when the port reads a replica."""
    if not reads_replica(port):
        return None
    lag = await port.replay_lag_s()
    if lag is None:
        return f"reading through {READ_DSN_ENV} ({port.host}), which is no replica"
    return f"reading from a replica ({READ_DSN_ENV}, {port.host}), {lag:.1f} s behind its primary"


async def require_tenant_schema(port: Port) -> None:
    """`operators.require_schema` when `open_port` opened a tenant; nothing for a gateway (a
    connection kind, not a capability), which checks its own schema."""
    if not isinstance(port, RemotePort):
        await require_schema(port)
