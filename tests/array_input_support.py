"""Shared helpers for the array-input tests: staging a source and looking at the stored facts."""

from __future__ import annotations

import json

from runplane.engine import array_input as A
from runplane.engine.values.keys import decode_key
from runplane.engine.ports import table


def occurrences(count: int, *, width: int = 20, identities: bool = False, start: int = 0):
    return [
        A.Occurrence(
            {"i": i, "name": f"company-{i}", "pad": "x" * width},
            A.SourceIdentity("dataset-1", i) if identities else None,
        )
        for i in range(start, start + count)
    ]


async def stage(port, scope, source, *, seal: bool = True, batch_size: int = 4):
    """begin + put every page (+ seal); returns (fingerprint, drafts)."""
    fingerprint = A.source_fingerprint(source)
    drafts = A.paginate(source)
    await A.begin(port, scope, source_fingerprint=fingerprint, source_rows=len(source),
                  has_source_identities=any(o.source_identity for o in source))
    for draft in drafts:
        await A.put_page(port, scope, source_fingerprint=fingerprint, ordinal=draft.ordinal,
                         offset=draft.offset, rows=draft.rows)
    if seal:
        await A.seal(port, scope, source_fingerprint=fingerprint, source_rows=len(source),
                     page_count=len(drafts), batch_size=batch_size)
    return fingerprint, drafts


async def facts(tenant, run_id: str | None = None) -> list[tuple[str, list]]:
    """(kind, decoded key) of every stored row, optionally of one run, ordered by key."""
    async with tenant.connection("receipts") as conn:
        rows = await conn.fetch(
            f"SELECT k, run_id, status, epoch FROM {table(tenant, 'work_receipts')} ORDER BY k"
        )
    out = []
    for row in rows:
        key = decode_key(bytes(row["k"]))
        if run_id is None or row["run_id"] == run_id:
            out.append((key[2], key))
    return out


async def snapshot(tenant) -> list[tuple]:
    """Every row of work_receipts, exactly, for 'nothing changed' assertions."""
    async with tenant.connection("receipts") as conn:
        rows = await conn.fetch(
            f"SELECT k, status, output::text, error, run_id, epoch "
            f"FROM {table(tenant, 'work_receipts')} ORDER BY k"
        )
    return [tuple(row) for row in rows]


async def guard_output(tenant, scope) -> dict | None:
    from runplane.engine.array_input.facts import guard_key

    async with tenant.connection("receipts") as conn:
        text = await conn.fetchval(
            f"SELECT output::text FROM {table(tenant, 'work_receipts')} WHERE k = $1",
            guard_key(scope),
        )
    return None if text is None else json.loads(text)


async def tamper_page(tenant, scope, ordinal: int, sql_expression: str) -> None:
    """Rewrite a stored page's output with `sql_expression` (over `output`)."""
    from runplane.engine.array_input.facts import page_key

    async with tenant.connection("receipts") as conn:
        status = await conn.execute(
            f"UPDATE {table(tenant, 'work_receipts')} SET output = {sql_expression} WHERE k = $1",
            page_key(scope, ordinal),
        )
    assert status == "UPDATE 1"
