"""The `Port`: what every engine operation talks to the store through.

A port is anything that offers what `Port` names: its org and schema, whether checkouts run
inside an outer transaction, connections on permit lanes, the schema repair, and what runs and
sheets read from it (outage budget, sheet lock material, the diagnostics queue, permit
telemetry, the DSN workers inherit, the plays a gateway token confines it to). `Tenant` is the
real one; a `Gateway` (a `RemotePort`) runs operations on the gateway server; simulations and
tests wrap a tenant to count queries or inject delays, faults and cancellations at checkouts
and query boundaries. `PortDefaults` gives a port that has none of the optional parts their
"none" values.

`with_connection` is how engine operations run: it checks out a connection on a lane and runs
the operation; when the operation hits a missing relation or column (42P01 / 42703) it repairs
the schema once and retries the operation once, then lets the error through.
"""

from __future__ import annotations

import types
from typing import (TYPE_CHECKING, AsyncContextManager, Awaitable, Callable, Mapping, Protocol,
                    TypeVar, runtime_checkable)

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


@runtime_checkable
class Port(Protocol):
    """Everything a port offers; engine operations and actors use nothing else of it."""

    @property
    def org_id(self) -> str:
        """The one org this port serves; scopes naming another are refused."""

    @property
    def schema(self) -> str:
        """The tenant schema its tables live in."""

    @property
    def outer_transaction(self) -> bool:
        """Whether every checkout already runs inside a transaction (an execution role), so
        operations open savepoints."""

    @property
    def outage_budget_s(self) -> float | None:
        """How long runs on this port ride out a store outage; None: the default
        (`RUNPLANE_OUTAGE_BUDGET_S`, else 60 s)."""

    @property
    def lock_secret(self) -> bytes | None:
        """The schema's secret sheet advisory-lock keys are derived with (None: not read)."""

    @property
    def sheet_lock_keys(self) -> Mapping[str, int]:
        """Sheet lock keys given outright, by sheet table (a database session's own sheet)."""

    @property
    def diagnostics(self) -> "DiagnosticsQueue | None":
        """The queue completion diagnostics go through to their sinks (None: delivered inline)."""

    @property
    def dsn(self) -> str | None:
        """The database address local worker processes inherit (None: no direct connection)."""

    @property
    def token_plays(self) -> tuple[str, ...] | None:
        """The plays this port is confined to (a gateway token's); None: every play."""

    def permits(self) -> "Mapping[str, PermitStats]":
        """Permit telemetry by lane (empty when the port has no permits of its own)."""

    def connection(self, lane: str) -> AsyncContextManager[Connection]:
        """A checked-out connection on permit lane `lane`."""

    async def repair_schema(self) -> None:
        """Re-run the idempotent schema bootstrap (or raise when this port may not)."""


class PortDefaults:
    """The values of a port's optional parts for a port that has none of them: the default
    outage budget, no lock material, inline diagnostics, no DSN, every play, no permits."""

    outage_budget_s: float | None = None
    lock_secret: bytes | None = None
    sheet_lock_keys: Mapping[str, int] = types.MappingProxyType({})
    diagnostics: "DiagnosticsQueue | None" = None
    dsn: str | None = None
    token_plays: tuple[str, ...] | None = None

    def permits(self) -> "Mapping[str, PermitStats]":
        return {}


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
