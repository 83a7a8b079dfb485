"""`ensure_sheet`: create a sheet's table, contract columns and counter rows (idempotent).

How it works
- A sheet whose contract fields all have registered columns (every map after the first) takes
  only the shared lock and checks in one statement that its table has every later system
  column and the row-order index; anything missing sends it down the exclusive path of the
  sheet transaction (`sheet_txn`), which creates what is missing.
- `ready_statement` asks the same without a lock or a write, in one read (with the sheet's row
  total): a list map's opening through a gateway (`list_opening`) ensures the sheet only when
  it is not ready, so a map of a known sheet sends no transaction to begin.
"""

from __future__ import annotations

from ..actions import action
from ..values.codecs import PLAY_SCOPE, STR, record
from ..errors import InvalidInputError, MissingRelationError
from ..pg import Connection
from ..ports import Port, table
from ..values.scopes import PlayScope, check_scope

from .counters import summary_source
from .layout import LATER_SYSTEM_COLUMNS, SheetLayout, layout_for
from .model import CONTRACT, SheetContract
from .sheet_txn import SheetTxn, run_sheet_transaction


_ENSURE_COLUMN_COUNTERS = """
INSERT INTO {column_summary} (org_id, play, table_namespace, field)
SELECT $1, $2, $3, f FROM unnest($4::text[]) AS f
ON CONFLICT DO NOTHING
"""

# The shared path's one statement: the counters, and whether the table has every later system
# column and the row-order and cause indexes (false when it lacks one, or does not exist: the
# exclusive path creates what is missing).
_ENSURE_SHARED = """
WITH counters AS (
    INSERT INTO {column_summary} (org_id, play, table_namespace, field)
    SELECT $1, $2, $3, f FROM unnest($4::text[]) AS f
    ON CONFLICT DO NOTHING
)
SELECT count(*) = cardinality($6::text[]) AND to_regclass($7) IS NOT NULL
       AND to_regclass($8) IS NOT NULL FROM pg_attribute
 WHERE attrelid = to_regclass($5) AND attname = ANY($6::text[]) AND NOT attisdropped
"""

ENSURE_STATEMENT_TIMEOUT_MS = 60_000

# Whether a sheet is ready for a map of a contract, read without a lock or a write: its summary
# row claims its table; every field has a registered column (registered in the transaction
# that created the table and the column); every output has its counter row; the table has
# every later system column and both indexes. And the sheet's row total (0: no counters yet).
_READY = """
SELECT EXISTS (SELECT 1 FROM {summary_table} WHERE org_id = $1 AND play = $2
                  AND table_namespace = $3 AND table_name = $4)
       AND (SELECT count(*) FROM {registry} WHERE org_id = $1 AND play = $2
               AND table_namespace = $3 AND field = ANY($5::text[])) = cardinality($5::text[])
       AND (SELECT count(*) FROM {column_summary} WHERE org_id = $1 AND play = $2
               AND table_namespace = $3 AND field = ANY($6::text[])) = cardinality($6::text[])
       AND (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($7)
               AND attname = ANY($8::text[]) AND NOT attisdropped) = cardinality($8::text[])
       AND to_regclass($9) IS NOT NULL AND to_regclass($10) IS NOT NULL AS ready,
       coalesce((SELECT total FROM {summary} AS s WHERE s.org_id = $1 AND s.play = $2
                    AND s.table_namespace = $3), 0) AS total
"""


def ready_statement(port: Port, layout: SheetLayout, contract: SheetContract
                    ) -> tuple[str, tuple[object, ...]]:
    """The statement and arguments of `_READY` for `layout` and `contract` (module docstring);
    a contract without fields is never ready (`ensure_sheet` takes the exclusive lock then)."""
    fields = list(dict.fromkeys(contract.fields))
    sql = _READY.format(summary_table=table(port, "sheet_summary"),
                        registry=table(port, "sheet_columns"),
                        column_summary=table(port, "sheet_column_summary"),
                        summary=summary_source(port))
    if not fields:
        fields = [""]  # no field is registered as "": not ready
    return sql, (*layout.counter_args, layout.table, fields, list(dict.fromkeys(contract.outputs)),
                 layout.regclass_text, list(LATER_SYSTEM_COLUMNS), layout.order_index,
                 layout.cause_index)


LAYOUT = record(SheetLayout, schema=STR, org_id=STR, play=STR, namespace=STR, table=STR)


@action("sheets.ensure_sheet", params={
    "scope": PLAY_SCOPE, "table_namespace": STR, "contract": CONTRACT,
}, result=LAYOUT, deadline_s=60.0)
async def ensure_sheet(
    port: Port, scope: PlayScope, table_namespace: str, contract: SheetContract
) -> SheetLayout:
    """Create the sheet table, its contract columns and its counter rows (idempotent).

    Returns where the sheet lives. A sheet whose contract fields all have registered columns
    (every map after the first: its table exists, since fields are registered in the
    transaction that creates it) takes only the shared lock, so a map starting does not wait
    for the writers of the sheet; otherwise (or with no fields to tell) the exclusive lock.
    """
    check_scope(port, scope)
    if not isinstance(contract, SheetContract):
        raise InvalidInputError("contract must be a SheetContract")
    layout = layout_for(port, scope, table_namespace)
    column_summary = table(port, "sheet_column_summary")
    sql = _ENSURE_COLUMN_COUNTERS.format(column_summary=column_summary)
    shared_sql = _ENSURE_SHARED.format(column_summary=column_summary)
    later = list(LATER_SYSTEM_COLUMNS)

    async def op(conn: Connection, sheet: SheetTxn) -> None:
        if not sheet.exclusive:
            complete = await conn.fetchval(shared_sql, *layout.counter_args,
                                           list(contract.outputs), layout.regclass_text, later,
                                           layout.order_index, layout.cause_index)
            if not complete:
                raise MissingRelationError("the sheet's table lacks a system column or index")
        elif contract.outputs:
            await conn.execute(sql, *layout.counter_args, list(contract.outputs))

    await run_sheet_transaction(
        port, layout, contract.fields, op, timeout_ms=ENSURE_STATEMENT_TIMEOUT_MS,
        mode="shared" if contract.fields else "exclusive",
    )
    return layout
