"""The sheet write value (`engine.sheets.sheet_write`) and the statements built from it, pure."""

import pytest

from runplane.actors.map_state import MapPlan
from runplane.engine.errors import InvalidInputError
from runplane.engine.values.scopes import PlayScope, RunRef, RunScope
from runplane.engine.sheets import CellPolicy, RowStatus, SheetContract, SheetWrite
from runplane.engine.sheets.admission_sql import PayloadRows, admit_statement
from runplane.engine.sheets.dispositions import probe_statement
from runplane.engine.sheets.layout import SheetColumns, column_name, layout_for

CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
REF = RunRef(RunScope("org", "play", "run"), 7)


class _Port:
    org_id, schema = "org", "tenant_schema"


async def fn(row):
    return {}


def test_a_sheet_write_is_checked_once_where_it_is_built():
    write = SheetWrite(REF, "My Table", CONTRACT, cell_policies={"score": CellPolicy(5)},
                       give_up_after=3)
    assert write.table_namespace == "my_table"
    assert write.lease_status == RowStatus.PENDING == "pending"
    for kwargs, field in (({"give_up_after": 0}, "give_up_after"),
                          ({"cache_hits": "all"}, "cache_hits"), ({"force": 1}, "force"),
                          ({"cell_policies": {"score": 5}}, "cell_policies"),
                          ({"attempt": "a"}, "attempt")):
        with pytest.raises(InvalidInputError, match=field):
            SheetWrite(REF, "t", CONTRACT, **kwargs)
    with pytest.raises(InvalidInputError, match="contract"):
        SheetWrite(REF, "t", ("name",))
    with pytest.raises(InvalidInputError, match="run"):
        SheetWrite("run", "t", CONTRACT)


def test_a_map_plan_builds_its_sheet_write_once():
    plan = MapPlan(None, REF, None, "T", CONTRACT, fn, give_up_after=2)
    assert plan.write == SheetWrite(REF, "t", CONTRACT, give_up_after=2, cache_hits="count")
    with pytest.raises(InvalidInputError, match="cell_policies"):
        MapPlan(None, REF, None, "t", CONTRACT, fn, cell_policies={"score": 1})


def test_statements_carry_every_bind_their_text_names_and_no_other():
    write = SheetWrite(REF, "t", CONTRACT, give_up_after=2)
    layout = layout_for(_Port(), PlayScope("org", "play"), "t")
    columns = SheetColumns({f: column_name(f) for f in CONTRACT.fields})
    no_inputs = SheetWrite(REF, "t", SheetContract(outputs=("score",)))
    for each, rows in ((write, PayloadRows(["k"], [0], '[{"name": "a"}]')),
                       (no_inputs, PayloadRows(["k"], [0], None))):
        statement = admit_statement(_Port(), layout, each, columns, rows)
        used = {n for n in range(1, 60) if f"${n}::" in statement.sql}
        assert used == set(range(1, len(statement.args) + 1))
        assert "IS NULL OR true" not in statement.sql
    statement = probe_statement(_Port(), layout, write, columns, ["k"])
    assert {n for n in range(1, 60) if f"${n}::" in statement.sql} == \
        set(range(1, len(statement.args) + 1))
    assert statement.args[0] == ["k"] and 2 in statement.args  # keys, and give_up_after
