"""COPY between two servers: rows streamed from one connection's `COPY … TO STDOUT` into
another's `COPY … FROM STDIN`, in PostgreSQL's binary format, in constant memory.

Choices: both connections must live on the same `Driver` (one asyncio loop), since the two COPYs
run as one asyncio task pair joined by a bounded queue (`QUEUE_CHUNKS` chunks in flight: the
faster side waits for the slower). A source that fails mid-stream fails the transfer after the
target has consumed what arrived: the caller runs the target's side inside a transaction and
rolls it back on any error. Errors are translated as every statement's are (`translate`).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

from .connection import Connection
from .translation import is_driver_error, translate

QUEUE_CHUNKS = 32


async def _pipe(source: Connection, target: Connection, select_sql: str, args: Sequence[object],
                table: tuple[str, str], columns: Sequence[str]) -> None:
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=QUEUE_CHUNKS)

    async def put(chunk: bytes) -> None:
        await queue.put(bytes(chunk))

    async def produce() -> None:
        try:
            await source.raw.copy_from_query(select_sql, *args, output=put, format="binary")
        finally:
            await queue.put(None)

    async def chunks() -> AsyncIterator[bytes]:
        while (chunk := await queue.get()) is not None:
            yield chunk

    producing = asyncio.ensure_future(produce())
    try:
        await target.raw.copy_to_table(table[1], schema_name=table[0], columns=list(columns),
                                       source=chunks(), format="binary")
    except BaseException:
        producing.cancel()
        raise
    await producing  # the source's error, if it failed mid-stream


async def copy_between(source: Connection, target: Connection, select_sql: str,
                       args: Sequence[object], table: tuple[str, str],
                       columns: Sequence[str]) -> None:
    """Stream the rows of `select_sql` (its columns in the order of `columns`) on `source` into
    `table` = (schema, name) on `target`. Both connections are on one driver."""
    try:
        await source._driver.call(_pipe(source, target, select_sql, args, table, columns))
    except BaseException as exc:
        if is_driver_error(exc):
            raise translate(exc) from exc
        raise
