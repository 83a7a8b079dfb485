"""The reporter of a map's rows in a call (`engine.runs.row_calls`): what "running" counts.

How it works
- `report_calls` runs beside a map in each process hosting its rows (`Run.map` for a run's own
  rows, `MapWorker.serve` for a shared map's worker) and writes the process's count of rows
  inside a call (`CallGauge.in_call`) to `row_calls`: once the first row enters a call, then
  whenever the count changed (looked at every `CHECK_S`, when the map's own progress also
  catches up with a count the gauge's rate limit held back) and at least every
  `engine.runs.row_calls.REPORT_S` seconds, changed or not. A map whose rows never enter a call (a
  rerun answered from the cache) writes nothing.
- When the map ends or is cancelled (Ctrl-C, SIGTERM) the last report is 0, shielded and
  within `FINAL_DEADLINE_S` (skipped while the run waits for the database, so a map cancelled
  during an outage ends at once; its report then stops counting once stale): "running" drops at once on a clean end; a crashed process's count
  stops counting once its last report is stale (`engine.runs.row_calls.FRESH_S`).
- A report that fails (the database is away) is skipped: the map's own store calls ride the
  outage; this figure is observational and never stops a map.
"""

from __future__ import annotations

import os
import socket
import trio

from runplane.engine.errors import EngineError
from runplane.engine.ports import Port
from runplane.engine.runs import row_calls
from runplane.engine.values.scopes import RunScope

from .progress import CallGauge
from .retry import hurry_if_waiting

CHECK_S = 1.0
FINAL_DEADLINE_S = 2.0


def process_name() -> str:
    """This process, as its reports name it (host, pid and a random suffix: pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


async def report_calls(port: Port, scope: RunScope, map_key: str, table_namespace: str,
                       gauge: CallGauge, *, process: str | None = None) -> None:
    """Report the `gauge`'s rows in a call for this process until cancelled (see the module
    docstring); each look first has the map's progress catch up with a count its rate limit
    held back (`CallGauge.catch_up`), so the bars never show fewer rows running than this."""
    name = process or process_name()

    async def send(value: int) -> bool:
        try:
            await row_calls.report(port, scope, map_key, name, table_namespace, value)
        except EngineError:
            return False
        return True

    sent: int | None = None
    sent_at = 0.0
    try:
        while True:
            gauge.catch_up()
            value, now = gauge.in_call, trio.current_time()
            due = sent is not None and now - sent_at >= row_calls.REPORT_S
            if (value != sent and (value or sent is not None)) or due:
                if await send(value):
                    sent, sent_at = value, now
            await trio.sleep(CHECK_S)
    finally:
        if sent is not None:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + FINAL_DEADLINE_S), \
                    hurry_if_waiting() as waiting:
                if not waiting:  # during an outage the report goes stale instead (15 s)
                    await send(0)
