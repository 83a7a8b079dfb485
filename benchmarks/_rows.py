"""What the map benchmarks map: two input fields, one output field, a function that does
nothing (the engine's cost alone). One copy for every benchmark in this folder."""

from __future__ import annotations

from typing import AsyncIterator

from runplane.engine import sheets

CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("ok",))
OUTPUT = {"ok": True}


def row(i: int, tag: str = "company") -> dict:
    """Row `i`: its name tagged with `tag` (another tag, other rows: no cache hits)."""
    return {"name": f"{tag}-{i}", "n": i}


async def stream(rows: int, tag: str = "company") -> AsyncIterator[dict]:
    """`rows` rows as an async iterable (a streamed source)."""
    for i in range(rows):
        yield row(i, tag)


async def noop(_row: dict) -> dict:
    return OUTPUT
