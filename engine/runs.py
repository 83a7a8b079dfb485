"""Runs and their fencing epochs.

`register(port, RunScope)` allocates the run's epoch from the `run_epochs` sequence the first time
the run is seen and returns the same epoch on every later call (a wake). Sequences only grow, so
a later run always gets a larger epoch; every fenced write compares epochs, never run ids.
One statement: insert-if-absent, else read the stored row.
"""

from __future__ import annotations

import os
import time

from .actions import action
from .codecs import RUN_REF, RUN_SCOPE
from .ports import Port, sequence_literal, table, with_connection
from .scopes import RunRef, RunScope, check_scope

_REGISTER = """
WITH inserted AS (
    INSERT INTO {runs} (org_id, play, run_id, epoch)
    VALUES ($1, $2, $3, nextval({seq}::regclass))
    ON CONFLICT (org_id, play, run_id) DO NOTHING
    RETURNING epoch
)
SELECT epoch FROM inserted
UNION ALL
SELECT epoch FROM {runs}
 WHERE org_id = $1 AND play = $2 AND run_id = $3 AND NOT EXISTS (SELECT 1 FROM inserted)
"""


@action("runs.register", params={"scope": RUN_SCOPE}, result=RUN_REF)
async def register(port: Port, scope: RunScope) -> RunRef:
    check_scope(port, scope)
    sql = _REGISTER.format(runs=table(port, "runs"), seq=sequence_literal(port, "run_epochs"))

    async def op(conn):
        # Empty only when a concurrent registration committed after our snapshot: read again.
        while True:
            epoch = await conn.fetchval(sql, scope.org_id, scope.play, scope.run_id)
            if epoch is not None:
                return epoch

    return RunRef(scope, await with_connection(port, "receipts", op))


def new_run_id() -> str:
    """A time-ordered run id: a UUIDv7 (48-bit millisecond clock, then randomness)."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis << 80) | (0x7 << 76) | ((rand >> 68) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
