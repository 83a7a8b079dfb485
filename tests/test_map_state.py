"""A map's frozen plan and owned state, without a database."""

from __future__ import annotations

import attrs
import pytest

from runplane.actors.map_state import MapPlan, MapState
from runplane.engine.errors import InvalidInputError
from runplane.engine.values.scopes import RunRef, RunScope
from runplane.engine.sheets import Admission, AdmittedRow, Completion, FencedRow, RowOutcome, SheetContract

CONTRACT = SheetContract(inputs=("name",), outputs=("upper",))
REF = RunRef(RunScope("org", "play", "run"), 1)


async def fn(row):
    return {}


def admission(*keys: str) -> Admission:
    pending = tuple(AdmittedRow(key, i, {"name": key}) for i, key in enumerate(keys))
    return Admission(inserted=len(keys), skipped=0, pending=pending, completed=(), blocked=(),
                     write_version=1)


@pytest.mark.parametrize("field, value", [
    ("concurrency", 0), ("concurrency", True), ("page_rows", -1), ("batch_rows", 1.5),
    ("linger_s", -0.1), ("flush_deadline_s", float("nan")),
])
def test_a_plan_refuses_bad_options_naming_them(field, value):
    with pytest.raises(InvalidInputError, match=field):
        MapPlan(None, REF, None, "t", CONTRACT, fn, **{field: value})


def test_a_plan_refuses_a_bad_contract_function_or_namespace():
    with pytest.raises(InvalidInputError, match="contract"):
        MapPlan(None, REF, None, "t", ("name",), fn)
    with pytest.raises(InvalidInputError, match="fn"):
        MapPlan(None, REF, None, "t", CONTRACT, "not callable")
    with pytest.raises(InvalidInputError, match="table_namespace"):
        MapPlan(None, REF, None, 7, CONTRACT, fn)
    plan = MapPlan(None, REF, None, "t", CONTRACT, fn)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.concurrency = 3


def test_state_drops_duplicates_in_flight_until_their_write_settles():
    state = MapState.observed_by(None)
    assert [row.key for row in state.take_admission(2, admission("a", "b"))] == ["a", "b"]
    assert [row.key for row in state.take_admission(2, admission("a", "c"))] == ["c"]
    assert state.tally.skipped == 1

    ticket, outcomes = state.open_batch()
    state.record(outcomes, RowOutcome("a", "completed", data={"upper": "A"}))
    state.settle([ticket], outcomes, Completion(updated=1, committed_keys=("a",), fenced=()))
    assert state.tally.completed == 1 and state.tally.executed == 1
    assert [row.key for row in state.take_admission(1, admission("a"))] == ["a"]  # settled


def test_state_hands_back_exactly_what_was_computed_and_not_settled():
    state = MapState.observed_by(None)
    first, written = state.open_batch()
    second, computed = state.open_batch()
    state.record(written, RowOutcome("a", "completed", data={}))
    state.record(computed, RowOutcome("b", "failed", error="boom"))
    state.record(computed, RowOutcome("c", "completed", data={}))
    state.settle([first], written, Completion(
        updated=0, committed_keys=(), fenced=(FencedRow("a", "stale_write_version", 9),)))
    assert [outcome.key for outcome in state.take_unsettled()] == ["b", "c"]
    assert state.take_unsettled() == []
    assert state.tally.fenced == 1 and state.tally.completed == 0
