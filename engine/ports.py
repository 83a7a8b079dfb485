"""The `Port`: what every engine operation talks to the store through.

A port is anything that offers what `Port` names: its org, its schema, its `PortSettings`
(one frozen value built once: outer transaction, outage budget, lock material, diagnostics
queue, DSN, token plays, whether it is remote), connections on permit lanes, permit telemetry
and the schema repair. `Tenant` is the real one; a `Gateway` (a `RemotePort`) runs operations on
the gateway server; simulations and tests wrap a port in a `PortWrapper` to count queries or
inject delays, faults and cancellations at checkouts and query boundaries. `PortDefaults` is a
port that has none of the optional parts: its settings are the defaults for its schema.

`with_connection` is how engine operations run: it checks out a connection on a lane and runs
the operation; when the operation hits a missing relation or column (42P01 / 42703) it repairs
the schema once and retries the operation once, then lets the error through.
"""

from __future__ import annotations

import types
from typing import (TYPE_CHECKING, AsyncContextManager, Awaitable, Callable, Mapping, Protocol,
                    TypeVar, runtime_checkable)

import attrs

from .errors import MissingRelationError
from .pg import Connection
from .sql import qualified

if TYPE_CHECKING:
    from .diagnostics import DiagnosticsQueue
    from .permits import PermitStats

T = TypeVar("T")

# The permit lanes: every checkout names one, and these are their only spellings.
SHEET_LANE = "sheet"            # sheets: admission, completion, reads
RECEIPTS_LANE = "receipts"      # runs, receipts and array-input facts (foreground)
RETIREMENT_LANE = "retirement"  # retirement and the terminal outbox (background)
CONSOLE_LANE = "console"        # the web console's read-only, bounded reads (small)
LANES = (SHEET_LANE, RECEIPTS_LANE, RETIREMENT_LANE, CONSOLE_LANE)

_NO_KEYS: Mapping[str, int] = types.MappingProxyType({})


@attrs.frozen
class PortSettings:
    """What a port is, beyond its connections: built once when the port opens (a tenant
    rebuilds it when it reads its lock material), read by operations and actors."""

    schema: str
    # Every checkout already runs inside a transaction (an execution role): operations open
    # savepoints.
    outer_transaction: bool = False
    # How long runs on this port ride out a store outage; None: the default
    # (`RUNPLANE_OUTAGE_BUDGET_S`, else 60 s).
    outage_budget_s: float | None = None
    # The schema's secret sheet keys are derived with (None: not read), and keys given
    # outright by sheet table (a database session's own sheet).
    lock_secret: bytes | None = attrs.field(default=None, repr=False)
    sheet_lock_keys: Mapping[str, int] = attrs.field(default=_NO_KEYS, repr=False)
    # The queue completion diagnostics go through to their sinks (None: delivered inline).
    diagnostics: "DiagnosticsQueue | None" = attrs.field(default=None, repr=False)
    # The database address local worker processes inherit (None: no direct connection).
    dsn: str | None = attrs.field(default=None, repr=False)
    # The tenants file placing this port's org (local workers follow its moves with it too).
    tenants_file: str | None = None
    # The plays this port is confined to (a gateway token's); None: every play.
    token_plays: tuple[str, ...] | None = None
    # Operations run elsewhere (a gateway client): the action layer sends them.
    remote: bool = False


@runtime_checkable
class Port(Protocol):
    """Everything a port offers; engine operations and actors use nothing else of it."""

    @property
    def org_id(self) -> str:
        """The one org this port serves; scopes naming another are refused."""

    # `settings.schema` too: a member of its own because every statement qualifies its tables
    # by it (`table(port, name)`), and wrappers and test ports name it first.
    @property
    def schema(self) -> str:
        """The tenant schema its tables live in."""

    @property
    def settings(self) -> PortSettings:
        """What the port is beyond its connections (see `PortSettings`)."""

    def permits(self) -> "Mapping[str, PermitStats]":
        """Permit telemetry by lane (empty when the port has no permits of its own)."""

    def connection(self, lane: str) -> AsyncContextManager[Connection]:
        """A checked-out connection on permit lane `lane`."""

    async def repair_schema(self) -> None:
        """Re-run the idempotent schema bootstrap (or raise when this port may not)."""


class PortDefaults:
    """A port with none of the optional parts: its settings are the defaults for its schema
    (default outage budget, no lock material, inline diagnostics, no DSN, every play) and it
    has no permits. A subclass gives `org_id`, `schema`, `connection` and `repair_schema`."""

    schema: str

    @property
    def settings(self) -> PortSettings:
        return PortSettings(self.schema)

    def permits(self) -> "Mapping[str, PermitStats]":
        return {}


@attrs.define(eq=False)
class PortWrapper:
    """A port that is `inner` in everything a subclass does not override (usually
    `connection`, to watch or disturb checkouts and statements)."""

    inner: Port

    @property
    def org_id(self) -> str:
        return self.inner.org_id

    @property
    def schema(self) -> str:
        return self.inner.schema

    @property
    def settings(self) -> PortSettings:
        return self.inner.settings

    def permits(self) -> "Mapping[str, PermitStats]":
        return self.inner.permits()

    def connection(self, lane: str) -> AsyncContextManager[Connection]:
        return self.inner.connection(lane)

    async def repair_schema(self) -> None:
        await self.inner.repair_schema()


async def with_connection(
    port: Port, lane: str, operation: Callable[[Connection], Awaitable[T]]
) -> T:
    """Run `operation(conn)` on a connection of `lane`, self-healing a missing relation once."""
    try:
        async with port.connection(lane) as conn:
            return await operation(conn)
    except MissingRelationError:
        await port.repair_schema()
    async with port.connection(lane) as conn:
        return await operation(conn)


def table(port: Port, name: str) -> str:
    """The qualified, quoted name of a table in the port's schema."""
    return qualified(port.schema, name)


def sequence_literal(port: Port, name: str) -> str:
    """A SQL string literal naming a sequence of the port's schema, for `nextval(...::regclass)`."""
    return "'" + table(port, name).replace("'", "''") + "'"
