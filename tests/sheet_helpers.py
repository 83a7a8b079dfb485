"""Shared helpers for the sheet tests: the play and contract most of them use, runs, rows as
stored, counts over the sheet."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

import trio

from runplane.engine.sheets.inputs import text_keys
from runplane.engine import array_input, canonical
from runplane.engine.runs import register
from runplane.engine.values.scopes import PlayScope, RunScope
from runplane.engine.sheets import RowOutcome, SheetContract
from runplane.engine.sheets.layout import column_name, layout_for
from runplane.simulations.counters import counters_match  # noqa: F401  (re-exported for the tests)

PLAY = "play"
# The sheet most tests use: one input, one output. Tests that need more define their own.
CONTRACT = SheetContract(inputs=("name",), outputs=("score",))


def encode_and_key(items: list[Any], table_namespace: str) -> tuple[Any, list[str]]:
    """The encoded source and each row's sheet key, as a list source computes them."""
    encoded = array_input.encode_source(items)
    return encoded, text_keys(table_namespace, encoded.texts)


def play_scope(port, play: str = PLAY) -> PlayScope:
    """The scope of `play` in the org the port serves."""
    return PlayScope(port.org_id, play)


async def new_run(port, play: str, run_id: str):
    return await register(port, RunScope(port.org_id, play, run_id))


def named_rows(tag: str, n: int) -> list[dict]:
    """`n` rows of `CONTRACT`'s one input, named `tag-0` ...: distinct keys per tag."""
    return [{"name": f"{tag}-{i}"} for i in range(n)]


def completions(admission) -> list[RowOutcome]:
    """A completed outcome (`score` = its position) for each row `admission` left pending."""
    return [RowOutcome(r.key, "completed", {"score": i}) for i, r in enumerate(admission.pending)]


def is_commit(boundary) -> bool:
    """Whether a `GatedPort` boundary is a transaction's COMMIT."""
    return boundary.kind == "query" and boundary.sql == "COMMIT"


async def raw_rows(port, scope, namespace: str, fields=()):
    """Every stored row by key: system columns plus the given fields (decoded)."""
    layout = layout_for(port, scope, namespace)
    cols = "".join(f', "{column_name(f)}"::text AS "c{i}"' for i, f in enumerate(fields))
    async with port.connection("sheet") as conn:
        present = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", layout.qualified)
        if not present:
            return {}
        records = await conn.fetch(
            f"""SELECT _key, _status, _run_id, _write_version, _input_index, _attempt_id,
                       _attempt_seq, _attempt_expires_at, _cell_meta::text AS meta, _error,
                       _version{cols}
                  FROM {layout.qualified}"""
        )
    out = {}
    for r in records:
        row = {k: r[k] for k in ("_status", "_run_id", "_write_version", "_input_index",
                                 "_attempt_id", "_attempt_seq", "_attempt_expires_at",
                                 "_error", "_version")}
        row["_cell_meta"] = canonical.loads(r["meta"])
        for i, f in enumerate(fields):
            row[f] = canonical.loads(r[f"c{i}"])
        out[r["_key"]] = row
    return out


@contextlib.asynccontextmanager
async def table_locked(tenant, qualified_table: str, mode: str) -> AsyncIterator[None]:
    """`qualified_table` locked in `mode` (`ACCESS EXCLUSIVE`, ...) by a transaction on another
    connection of `tenant`, held for the block."""
    locked, release = trio.Event(), trio.Event()

    async def hold() -> None:
        async with tenant.connection("retirement") as conn:
            async with conn.transaction():
                await conn.execute(f"LOCK TABLE {qualified_table} IN {mode} MODE")
                locked.set()
                await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        await locked.wait()
        try:
            yield
        finally:
            release.set()
