"""Write modes besides upsert: append rows as new ones, or replace a table's rows.

How it works
- Both are admissions (`admission.admit_prepared`): the rows go in `pending` under the run's
  write version through the same admission statement, in one sheet write transaction, and come
  back as an `Admission`. Each first runs a prelude in that transaction, after the sheet lock
  (which holds the sheet's `sheet_summary` row, so writers of one sheet are serialized and
  what the prelude reads stays true until commit).
- `append_rows(..., idempotency_key=K)`: every row is a new row, duplicates included. Its key
  is a hash of the table namespace, K, the row's ordinal in the call and its row key, so a
  retried append (same K, same rows) finds its rows and adds nothing twice. Input indexes
  continue from the sheet's largest (`_MAX_INDEX`: one step down the row-order index); a retry
  keeps the indexes its first attempt gave (`_RETRY_BASE`: the first row, looked up by key).
- `replace_rows`: the table's rows are removed (`TRUNCATE`, transactional: it takes an ACCESS
  EXCLUSIVE lock, so a reader of the sheet waits until the replace commits or rolls back, then
  sees the new rows — it never sees a half-replaced table; it needs no scan, so no plan of it depends on the sheet's size), its
  counters set to zero, and `rows` admitted as new `pending` rows (duplicates: the first wins,
  as with `admit`); the counters then equal exactly the rows admitted.
"""

from __future__ import annotations

import hashlib
import time
from typing import Sequence

from ..actions import action
from ..values.codecs import RUN_REF, STR, USER_JSON, list_of
from ..errors import InvalidInputError
from ..values.keys import check_user_key
from ..pg import Connection
from ..ports import Port, table
from ..values.scopes import RunRef, normalize_namespace

from .admission import admit_prepared
from .inputs import prepare_rows, row_key
from .layout import layout_for
from .sheet_txn import SheetTxn
from .model import ADMISSION, CONTRACT, Admission, SheetContract
from .sheet_write import SheetWrite

# The input index the first attempt of a retried append gave its first row ($1 its key).
_RETRY_BASE = "SELECT s._input_index FROM {t} AS s WHERE s._key = $1 LIMIT 1"

# The sheet's largest input index: the last entry of the row-order index that has one.
_MAX_INDEX = """
SELECT s._input_index FROM {t} AS s WHERE s._input_index IS NOT NULL
 ORDER BY s._input_index DESC LIMIT 1
"""

_CLEAR_COUNTERS = """
WITH summary AS (
    UPDATE {summary} SET total = 0, queued = 0, running = 0, completed = 0, failed = 0,
                         updated_at = now()
     WHERE org_id = $1 AND play = $2 AND table_namespace = $3
    RETURNING 1
), deltas AS (
    UPDATE {deltas} SET total = 0, queued = 0, running = 0, completed = 0, failed = 0
     WHERE org_id = $1 AND play = $2 AND table_namespace = $3
), column_deltas AS (
    UPDATE {column_deltas} SET completed = 0, failed = 0
     WHERE org_id = $1 AND play = $2 AND table_namespace = $3
)
UPDATE {column_summary} SET completed = 0, failed = 0
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3
"""


def appended_key(table_namespace: str, idempotency_key: str, ordinal: int, key: str) -> str:
    """The key of the `ordinal`-th row (row key `key`) of an append with `idempotency_key`."""
    text = f"{normalize_namespace(table_namespace)}\nappend\n{idempotency_key}\n{ordinal}\n{key}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _check_rows(rows: object) -> None:
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Sequence):
        raise InvalidInputError("rows must be a sequence of dicts")


@action("sheets.append_rows", params={
    "run": RUN_REF, "table_namespace": STR, "contract": CONTRACT, "rows": list_of(USER_JSON),
    "idempotency_key": STR,
}, result=ADMISSION, deadline_s=120.0)
async def append_rows(
    port: Port, run: RunRef, table_namespace: str, contract: SheetContract,
    rows: Sequence[dict], *, idempotency_key: str,
) -> Admission:
    """Add `rows` to the sheet as new `pending` rows (see the module docstring)."""
    started = time.perf_counter()
    write = SheetWrite(run, table_namespace, contract)
    write.check_port(port)
    try:
        check_user_key(idempotency_key)
    except InvalidInputError as exc:
        raise InvalidInputError(f"idempotency_key: {exc}") from None
    _check_rows(rows)
    namespace = write.table_namespace
    keys = [appended_key(namespace, idempotency_key, i, row_key(row, namespace))
            for i, row in enumerate(rows)]
    prepared = prepare_rows(rows, namespace, input_offset=0, keys=keys,
                            need_texts=bool(contract.inputs))
    layout = layout_for(port, run.scope.play_scope, namespace)

    async def continue_indexes(conn: Connection, _sheet: SheetTxn) -> int:
        if not keys:
            return 0
        base = await conn.fetchval(_RETRY_BASE.format(t=layout.qualified), keys[0])
        if base is not None:
            return base
        last = await conn.fetchval(_MAX_INDEX.format(t=layout.qualified))
        return 0 if last is None else last + 1

    return await admit_prepared(port, write, prepared, started=started, prelude=continue_indexes)


@action("sheets.replace_rows", params={
    "run": RUN_REF, "table_namespace": STR, "contract": CONTRACT, "rows": list_of(USER_JSON),
}, result=ADMISSION, deadline_s=120.0)
async def replace_rows(
    port: Port, run: RunRef, table_namespace: str, contract: SheetContract, rows: Sequence[dict],
) -> Admission:
    """Replace every row of the sheet by `rows`, admitted `pending`, in one transaction."""
    started = time.perf_counter()
    write = SheetWrite(run, table_namespace, contract)
    write.check_port(port)
    _check_rows(rows)
    namespace = write.table_namespace
    prepared = prepare_rows(rows, namespace, input_offset=0, keys=None,
                            need_texts=bool(contract.inputs))
    layout = layout_for(port, run.scope.play_scope, namespace)

    async def clear(conn: Connection, _sheet: SheetTxn) -> int:
        await conn.execute(f"TRUNCATE {layout.qualified}")
        await conn.execute(
            _CLEAR_COUNTERS.format(summary=table(port, "sheet_summary"),
                                   column_summary=table(port, "sheet_column_summary"),
                                   deltas=table(port, "sheet_counter_deltas"),
                                   column_deltas=table(port, "sheet_column_deltas")),
            *layout.counter_args)
        return 0

    return await admit_prepared(port, write, prepared, started=started, prelude=clear)
