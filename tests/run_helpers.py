"""Shared helpers for the actor tests: what a run left in the store."""

from __future__ import annotations


async def fact_kinds(port, run_id: str) -> list[str]:
    """Kinds of the array-input facts a run has in `work_receipts` (sorted)."""
    async with port.connection("receipts") as conn:
        rows = await conn.fetch(
            f'SELECT output->>\'kind\' AS kind FROM "{port.schema}".work_receipts '
            "WHERE run_id = $1 AND output->>'kind' LIKE 'array_input_%' ORDER BY 1",
            run_id,
        )
    return [row["kind"] for row in rows]


async def guard_retired(port, run_id: str) -> bool | None:
    async with port.connection("receipts") as conn:
        value = await conn.fetchval(
            f'SELECT (output->>\'retired\')::boolean FROM "{port.schema}".work_receipts '
            "WHERE run_id = $1 AND output->>'kind' = 'array_input_guard'",
            run_id,
        )
    return value


async def outbox_state(port, run_id: str) -> str | None:
    async with port.connection("receipts") as conn:
        return await conn.fetchval(
            f'SELECT state FROM "{port.schema}".terminal_outbox WHERE run_id = $1', run_id
        )


def occurrences(n: int, *, tag: str = "row") -> list:
    from runplane.engine.array_input import Occurrence

    return [Occurrence({"name": f"{tag}-{i}", "i": i}) for i in range(n)]


async def forget_recorded_lists(tenant) -> None:
    """Delete every recorded list (`engine.sheets.lists`): the next rerun of a list then takes
    the ordinary path (probes), which a test of that path needs."""
    async with tenant.connection("sheet") as conn:
        await conn.execute(f'DELETE FROM "{tenant.schema}".sheet_lists')
