"""Inputs are not outputs: an output field named like one of the contract's inputs would write
over the input cell (and the next run would call the row cached). Such a row fails alone with
a clear `_error` in a map, and `sheets.complete` refuses such outcomes before any query."""

from __future__ import annotations

import pytest

from runplane.actors import open_run
from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import RowOutcome, SheetContract, admit, complete, read_rows
from runplane.simulations.ports import CountingPort
from tests.sheet_helpers import PLAY, counters_match, new_run, play_scope

NS = "inputs-not-outputs"
CONTRACT = SheetContract(inputs=("name", "city"), outputs=("score",))


async def test_a_row_returning_an_input_field_fails_alone_and_keeps_its_input(tenant):
    rows = [{"name": f"r{i}", "city": "Oslo"} for i in range(20)]
    calls: list[str] = []

    async def fn(row):
        calls.append(row["name"])
        if row["name"] == "r7":
            return {"score": 1, "city": "overwritten"}
        return {"score": len(row["name"])}

    async with open_run(tenant, PLAY) as run:
        result = await run.map(NS, rows, fn, contract=CONTRACT)
    assert (result.completed, result.failed) == (19, 1)
    stored = {r["name"]: r for r in await read_rows(tenant, play_scope(tenant), NS)}
    assert stored["r7"]["city"] == "Oslo"
    assert stored["r7"]["_status"] == "failed"
    assert "'city'" in stored["r7"]["_error"] and "input" in stored["r7"]["_error"]
    assert all(stored[f"r{i}"]["_status"] == "enriched" for i in range(20) if i != 7)
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail

    calls.clear()
    async with open_run(tenant, PLAY) as run:
        again = await run.map(NS, rows, fn, contract=CONTRACT)
    assert calls == ["r7"] and again.cached == 19 and again.failed == 1
    stored = {r["name"]: r for r in await read_rows(tenant, play_scope(tenant), NS)}
    assert stored["r7"]["city"] == "Oslo"


@pytest.mark.parametrize("status", ["completed", "failed"])
async def test_complete_refuses_an_output_named_like_an_input_before_any_query(tenant, status):
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a", "city": "Oslo"}])
    key = admission.pending[0].key
    port = CountingPort(tenant)
    refused = r"outcomes\[1\]\.data: field name 'city' is an input"
    with pytest.raises(InvalidInputError, match=refused):
        await complete(port, run, NS, CONTRACT, [
            RowOutcome(key, "completed", {"score": 1}),
            RowOutcome(key, status, {"score": 2, "city": "elsewhere"}, error="boom"),
        ])
    assert port.boundaries == []
    stored = await read_rows(tenant, play_scope(tenant), NS)
    assert [(r["city"], r["_status"]) for r in stored] == [("Oslo", "pending")]
