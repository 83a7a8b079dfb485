"""The `Port`: what every engine operation talks to the store through.

A port is anything with `org_id`, `schema`, `outer_transaction`, `connection(lane)` and
`repair_schema()`. `Tenant` is the real one; simulations and tests wrap a tenant to count
queries or inject delays, faults and cancellations at checkouts and query boundaries.

`with_connection` is how engine operations run: it checks out a connection on a lane and runs
the operation; when the operation hits a missing relation or column (42P01 / 42703) it repairs
the schema once and retries the operation once, then lets the error through.
"""

from __future__ import annotations

from typing import Any, AsyncContextManager, Awaitable, Callable, Protocol, TypeVar, runtime_checkable

from .errors import MissingRelationError
from .pg import Connection
from .sql import qualified

T = TypeVar("T")

# The permit lanes: every checkout names one, and these are their only spellings.
SHEET_LANE = "sheet"            # sheets: admission, completion, reads
RECEIPTS_LANE = "receipts"      # runs, receipts and array-input facts (foreground)
RETIREMENT_LANE = "retirement"  # retirement and the terminal outbox (background)
CONSOLE_LANE = "console"        # the web console's read-only, bounded reads (small)
LANES = (SHEET_LANE, RECEIPTS_LANE, RETIREMENT_LANE, CONSOLE_LANE)


@runtime_checkable
class Port(Protocol):
    org_id: str
    schema: str
    outer_transaction: bool

    def connection(self, lane: str) -> AsyncContextManager[Connection]: ...

    async def repair_schema(self) -> None: ...


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


def table(port: Any, name: str) -> str:
    """The qualified, quoted name of a table in the port's schema."""
    return qualified(port.schema, name)


def sequence_literal(port: Any, name: str) -> str:
    """A SQL string literal naming a sequence of the port's schema, for `nextval(...::regclass)`."""
    return "'" + table(port, name).replace("'", "''") + "'"
