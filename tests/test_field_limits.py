"""Field names and field counts: refused before any query where the API takes them,
and, where a map function returns them, failing only their row while the batch is written."""

from __future__ import annotations

import pytest

from runplane.actors import open_run
from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import (
    RowOutcome, SheetContract, admit, complete, ensure_sheet, read_rows,
)
from runplane.engine.sheets.field_names import MAX_FIELD_CHARS
from runplane.engine.sheets.model import MAX_SHEET_FIELDS
from runplane.simulations.ports import CountingPort
from tests.sheet_helpers import PLAY, counters_match, new_run, play_scope

NS = "limits"


@pytest.mark.parametrize("name, problem", [
    ("_key", "must not start with '_'"),
    ("_status", "must not start with '_'"),
    ("a\x00b", "must not contain NUL"),
    ("x" * (MAX_FIELD_CHARS + 1), f"at most {MAX_FIELD_CHARS} characters"),
    ("", "must not be empty"),
])
def test_contract_field_names_past_the_limits_are_refused(name, problem):
    with pytest.raises(InvalidInputError, match=problem):
        SheetContract(inputs=(name,))
    with pytest.raises(InvalidInputError, match=problem):
        SheetContract(outputs=("ok", name))


def test_a_contract_past_the_field_limit_is_refused():
    with pytest.raises(InvalidInputError, match=f"at most {MAX_SHEET_FIELDS}"):
        SheetContract(inputs=("name",), outputs=tuple(f"o{i}" for i in range(MAX_SHEET_FIELDS)))
    with pytest.raises(InvalidInputError, match=f"at most {MAX_SHEET_FIELDS}"):
        SheetContract(outputs=tuple(f"o{i}" for i in range(840)))


async def test_a_contract_at_the_limit_can_be_completed_in_full(tenant):
    """The limit is what completion can write: every field of a widest row is stored, long
    values (moved out of line) and short ones (kept in the row) alike."""
    outputs = tuple(f"output number {i}" for i in range(MAX_SHEET_FIELDS - 1))
    contract = SheetContract(inputs=("name",), outputs=outputs)
    await ensure_sheet(tenant, play_scope(tenant), NS, contract)
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, contract, [{"name": "long"}, {"name": "short"}])
    keys = {row.row["name"]: row.key for row in admission.pending}
    long_values = {f: f"{i:04d}" + "v" * 3000 for i, f in enumerate(outputs)}
    short_values = {f: i for i, f in enumerate(outputs)}
    completion = await complete(tenant, run, NS, contract, [
        RowOutcome(keys["long"], "completed", long_values),
        RowOutcome(keys["short"], "completed", short_values),
    ])
    assert completion.updated == 2 and completion.fenced == ()
    rows = {r["name"]: r for r in await read_rows(tenant, play_scope(tenant), NS)}
    assert {f: rows["long"][f] for f in outputs} == long_values
    assert {f: rows["short"][f] for f in outputs} == short_values
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


@pytest.mark.parametrize("data, problem", [
    ({"_error": "x"}, "must not start with '_'"),
    ({"y" * (MAX_FIELD_CHARS + 1): 1}, f"at most {MAX_FIELD_CHARS} characters"),
    ({f"k{i}": i for i in range(MAX_SHEET_FIELDS + 1)}, f"at most {MAX_SHEET_FIELDS}"),
])
async def test_complete_refuses_unstorable_outputs_before_any_query(tenant, data, problem):
    contract = SheetContract(inputs=("name",), outputs=("score",))
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, contract, [{"name": "a"}])
    port = CountingPort(tenant)
    with pytest.raises(InvalidInputError, match=problem):
        await complete(port, run, NS, contract, [
            RowOutcome(admission.pending[0].key, "completed", data)])
    assert port.boundaries == []


async def test_a_poison_row_fails_alone_and_the_batch_is_written(tenant):
    """One row returns 1,700 new keys, one a field name of a megabyte, one a system column's
    name: each fails with its reason; every other row of the batch is stored, and a rerun calls
    the function for the failed rows only."""
    contract = SheetContract(inputs=("name",), outputs=("score",))
    rows = [{"name": f"r{i}"} for i in range(200)]
    poison = {
        "r7": lambda: {f"k{i}": i for i in range(1700)},
        "r50": lambda: {"z" * 1_000_000: 1},
        "r120": lambda: {"_status": "mine"},
    }
    calls: list[str] = []

    async def fn(row):
        calls.append(row["name"])
        make = poison.get(row["name"])
        return make() if make else {"score": len(row["name"])}

    async with open_run(tenant, PLAY) as run:
        result = await run.map(NS, rows, fn, contract=contract)
    assert (result.completed, result.failed) == (197, 3)
    stored = {r["name"]: r for r in await read_rows(tenant, play_scope(tenant), NS)}
    assert f"a sheet holds at most {MAX_SHEET_FIELDS}" in stored["r7"]["_error"]
    assert f"at most {MAX_FIELD_CHARS} characters" in stored["r50"]["_error"]
    assert "must not start with '_'" in stored["r120"]["_error"]
    assert all(stored[f"r{i}"]["_status"] == "enriched" for i in range(200)
               if f"r{i}" not in poison)
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail
    calls.clear()
    async with open_run(tenant, PLAY) as run:
        again = await run.map(NS, rows, fn, contract=contract)
    assert sorted(calls) == sorted(poison) and again.cached == 197


async def test_rows_that_together_pass_the_field_limit_fail_from_the_first_past_it(tenant):
    contract = SheetContract(inputs=("name",), outputs=("score",))
    width = 150  # two such rows fit beside the contract; a third would pass the limit

    async def fn(row):
        i = int(row["name"][1:])
        return {f"r{i}-{j}": j for j in range(width)}

    async with open_run(tenant, PLAY) as run:
        result = await run.map(NS, [{"name": f"r{i}"} for i in range(4)], fn, contract=contract,
                               concurrency=1)
    assert (result.completed, result.failed) == (2, 2)
    stored = {r["name"]: r for r in await read_rows(tenant, play_scope(tenant), NS)}
    assert [stored[f"r{i}"]["_status"] for i in range(4)] == [
        "enriched", "enriched", "failed", "failed"]
    assert "new output fields would make" in stored["r2"]["_error"]
