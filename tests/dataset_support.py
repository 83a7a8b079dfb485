"""A sheet for the dataset and export tests: enriched rows with nested outputs, failed rows,
rows whose outputs are missing, unicode and NUL-replaced text."""

from __future__ import annotations

from runplane.engine import sheets
from runplane.engine.sheets import RowOutcome, SheetContract

from .sheet_helpers import new_run, play_scope

CONTRACT = SheetContract(inputs=("name", "n"), outputs=("score", "info", "tags", "ok"))
NS = "companies"


def input_row(i: int) -> dict:
    name = ("zürich ☃ 東京 " if i % 7 == 0 else "plain ") + str(i)
    if i % 11 == 0:
        name += "\x00nul"  # stored as U+FFFD
    return {"name": name, "n": i}


def outcome(key: str, i: int) -> RowOutcome:
    if i % 5 == 3:
        return RowOutcome(key, "failed", error=f"quota \"exceeded\"\nfor {i}, ünïcode")
    return RowOutcome(key, "completed", data={
        "score": i * 1.5 if i % 2 else i,
        "info": {"city": "Zürich", "depth": {"list": [1, "two", None, {"x": i}]}},
        "tags": ["a", "b,c", "quote\"d"],
        "ok": i % 3 == 0,
    })


async def fill(port, rows: int, run_id: str = "r1", namespace: str = NS, *,
               offset: int = 0, settle_every: int = 4) -> list[str]:
    """Admit `rows` rows under run `run_id` and settle all but every `settle_every`-th
    (those stay pending: their outputs are missing). Returns the keys in input order."""
    scope = play_scope(port)
    run = await new_run(port, scope.play, run_id)
    await sheets.ensure_sheet(port, scope, namespace, CONTRACT)
    keys: list[str] = []
    for start in range(0, rows, 5000):
        chunk = [input_row(offset + i) for i in range(start, min(rows, start + 5000))]
        admission = await sheets.admit(port, run, namespace, CONTRACT, chunk,
                                       input_offset=offset + start)
        admitted = admission.pending + admission.completed
        keys += [a.key for a in sorted(admitted, key=lambda a: a.input_index)]
        outcomes = [outcome(a.key, a.input_index) for a in admission.pending
                    if a.input_index % settle_every != 1]
        if outcomes:
            await sheets.complete(port, run, namespace, CONTRACT, outcomes)
    return keys
