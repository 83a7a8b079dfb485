"""The probe: settle rows from their keys alone, in one read-only statement per chunk.

How it works
- When every row is a fresh cache hit or blocked it returns the `Admission` a count-mode
  `admit` would have returned (nothing to write: admission touches neither), otherwise None
  and the caller admits. It judges rows by the same SQL fragments as admission
  (`dispositions`), on the server's clock; its snapshot is a committed state, so its answer is
  the one an admission at that instant would give.
- `probe_keyed` is the same probe of a `SheetWrite` the caller built (a map builds it once),
  which also hands back the rows' keys it computed (the mapper records the keys of the rows
  it reused without keying them twice).
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

from ..actions import action, routes_remote
from ..values.codecs import BOOL, INT, RUN_REF, STR, USER_JSON, list_of, optional
from ..errors import MissingRelationError
from ..pg import Connection, Record
from ..ports import Port
from ..values.scopes import RunRef

from .admission import ADMIT_CHUNK_ROWS
from .dispositions import probe_statement
from .inputs import prepare_rows
from .column_registry import resolve_columns
from .layout import LANE, SheetColumns, column_name, layout_for
from .telemetry import PhaseClock
from .model import (
    ADMISSION, ATTEMPT, CELL_POLICIES, CONTRACT, Admission, Attempt, BlockedRow, CellPolicy,
    SheetContract, Timing,
)
from .sheet_write import PROBE_ARGUMENTS, SheetWrite


@action("sheets.probe", params={
    "run": RUN_REF, "table_namespace": STR, "contract": CONTRACT, "rows": list_of(USER_JSON),
    "input_offset": INT, "keys": optional(list_of(STR)), "attempt": optional(ATTEMPT),
    "cell_policies": optional(CELL_POLICIES), "give_up_after": optional(INT), "force": BOOL,
}, result=optional(ADMISSION), deadline_s=30.0, writes=False)
async def probe(
    port: Port,
    run: RunRef,
    table_namespace: str,
    contract: SheetContract,
    rows: Sequence[dict],
    *,
    input_offset: int = 0,
    keys: Sequence[str] | None = None,
    attempt: Attempt | None = None,
    cell_policies: Mapping[str, CellPolicy] | None = None,
    give_up_after: int | None = None,
    force: bool = False,
) -> Admission | None:
    """Settle `rows` from their keys alone, writing nothing.

    Returns the `Admission` that `admit(..., cache_hits="count")` would return when every row is
    a fresh cache hit or blocked (`pending` and `inserted` are then empty/0), or None when some
    row needs admitting (new, failed, stale, pending…) — then call `admit`. `force` judges
    rows as `admit(..., force=True)` does.
    """
    write = SheetWrite(run, table_namespace, contract, attempt=attempt,
                       cell_policies=cell_policies, give_up_after=give_up_after,
                       cache_hits="count", force=force)
    settled, _keys = await _probe_here(port, write, rows, input_offset=input_offset, keys=keys)
    return settled


async def _send_probe(
    port: Port, write: SheetWrite, rows: Sequence[dict], *, input_offset: int = 0,
    keys: Sequence[str] | None = None,
) -> tuple[Admission | None, list[str]]:
    """`probe_keyed` through a remote port: the keys are computed here and the action
    `sheets.probe` is sent."""
    if keys is None:
        keys = prepare_rows(rows, write.table_namespace, input_offset=input_offset,
                            keys=None, need_texts=False, keep_rows=False).keys
    settled = await probe(port, rows=rows, input_offset=input_offset, keys=keys,
                          **write.arguments(*PROBE_ARGUMENTS))
    return settled, list(dict.fromkeys(keys))


@routes_remote(_send_probe)
async def probe_keyed(
    port: Port, write: SheetWrite, rows: Sequence[dict], *, input_offset: int = 0,
    keys: Sequence[str] | None = None,
) -> tuple[Admission | None, list[str]]:
    """`probe` of a `SheetWrite`, and the rows' keys (deduplicated) it computed or was given:
    a map records the keys of the rows it reused (`engine.sheets.reuse`) without keying them
    twice. Through a remote port the action layer sends `sheets.probe` instead (`_send_probe`)."""
    return await _probe_here(port, write, rows, input_offset=input_offset, keys=keys)


async def _probe_here(
    port: Port, write: SheetWrite, rows: Sequence[dict], *, input_offset: int,
    keys: Sequence[str] | None,
) -> tuple[Admission | None, list[str]]:
    started = time.perf_counter()
    write.check_port(port)
    prepared = prepare_rows(rows, write.table_namespace, input_offset=input_offset, keys=keys,
                            need_texts=False, keep_rows=False)
    run = write.run
    layout = layout_for(port, run.scope.play_scope, write.table_namespace)
    n = len(prepared.keys)
    clock = PhaseClock()
    # First-choice columns: right unless an output's name collided, which the statement itself
    # tells (`columns_ok`); then the registry is read and the probe runs again.
    columns = SheetColumns({f: column_name(f) for f in write.contract.outputs})

    async def op(conn: Connection) -> list[Record] | None:
        nonlocal columns
        results = []
        for low in range(0, n, ADMIT_CHUNK_ROWS):
            keys_chunk = sorted(prepared.keys[low:low + ADMIT_CHUNK_ROWS])
            statement = probe_statement(port, layout, write, columns, keys_chunk)
            record = await clock.measure("probe", conn.fetchrow(statement.sql, *statement.args))
            if not record["columns_ok"]:
                resolved = await resolve_columns(conn, port, layout, write.contract.outputs)
                if resolved is None or resolved == columns:
                    return None  # an output has no column yet: nothing is settled
                columns = resolved
                return await op(conn)
            if record["unsettled"]:
                return None
            results.append(record)
        return results

    try:
        async with port.connection(LANE) as conn:
            results = await op(conn)
    except MissingRelationError:
        return None, prepared.keys  # no sheet table or column yet: nothing there is settled
    if results is None:
        return None, prepared.keys
    cached = sum(record["cached"] for record in results)
    reasons = {key: reason for record in results for key, reason in
               zip(record["blocked_keys"] or (), record["blocked_reasons"] or ())}
    blocked = [BlockedRow(key, index, reasons[key])
               for key, index in zip(prepared.keys, prepared.indexes) if key in reasons] \
        if reasons else []
    clock.add("total", time.perf_counter() - started)
    return Admission(
        inserted=0, skipped=prepared.skipped, pending=(), completed=(), blocked=tuple(blocked),
        write_version=run.epoch,
        timings=tuple(Timing(phase, ms, n) for phase, ms in clock.ms.items()), cached=cached,
    ), prepared.keys
