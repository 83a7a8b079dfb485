"""A map worker's outcomes: normalized and encoded once (`completed_outcome`), and completion
writes that text without checking or encoding the data again."""

from __future__ import annotations

import attrs
import pytest

from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import OutcomeStatus, RowOutcome, SheetContract, admit, complete
from runplane.engine.sheets.outcome_inputs import (
    completed_outcome, encoded_data, prepare_outcomes, prepared_completed, prepared_completed_many,
)

from .sheet_helpers import PLAY, new_run, play_scope, raw_rows

KEY = "k" * 32
CONTRACT = SheetContract(inputs=("name",), outputs=("score", "tags"))
NS = "encoded"


PLAIN = ([f"{i:032d}" for i in range(4)], [{"score": i, "tags": ["é"]} for i in range(4)],
         [0, 1, 2, 3], [1, 1, 2, 1])


@pytest.mark.parametrize("column, position, value", [
    (None, 0, None),  # all plain: checked a column at a time
    (1, 2, {"score": 2.0}),  # an integral float, normalized
    (2, 1, None),  # no input index
    (3, 3, 7),
    (0, 0, "clé"),
])
def test_outcomes_prepared_a_field_at_a_time_equal_one_at_a_time(column, position, value):
    fields = [list(field) for field in PLAIN]
    if column is not None:
        fields[column][position] = value
    many = prepared_completed_many(*fields)
    assert many == [prepared_completed(*one) for one in zip(*fields)]
    assert many == [completed_outcome(*one)._encoded for one in zip(*fields)]
    assert prepare_outcomes(many) == prepare_outcomes([completed_outcome(*one)
                                                       for one in zip(*fields)])


@pytest.mark.parametrize("column, value, error", [
    (0, "", "key"), (1, ["not", "a dict"], "data"), (1, {"x": float("nan")}, "output"),
    (2, -1, "input_index"), (2, 2**63, "input_index"), (3, 0, "attempts"),
    (3, True, "attempts"),
])
def test_a_bad_field_is_refused_as_one_at_a_time_refuses_it(column, value, error):
    fields = [list(field) for field in PLAIN]
    fields[column][1] = value
    with pytest.raises(InvalidInputError, match=error) as many:
        prepared_completed_many(*fields)
    with pytest.raises(InvalidInputError) as one:
        completed_outcome(*[field[1] for field in fields])
    assert str(many.value) == str(one.value)


def test_it_equals_the_checked_constructor_and_prepares_alike():
    data = {"score": 1.0, "tags": ["a", "b\x00"], "ratio": 0.5}
    fast = completed_outcome(KEY, data, 3, 2)
    slow = RowOutcome(KEY, OutcomeStatus.COMPLETED, data={"score": 1, "tags": ["a", "b\ufffd"],
                                                          "ratio": 0.5},
                      input_index=3, attempts=2)
    assert fast == slow and repr(fast) == repr(slow)
    assert type(fast.data["score"]) is int
    assert encoded_data(fast) == ('{"score":1,"tags":["a","b\ufffd"],"ratio":0.5}',
                                  ("score", "tags", "ratio"))
    assert encoded_data(slow) is None
    assert prepare_outcomes([fast]) == prepare_outcomes([slow])


def test_a_copy_or_evolve_carries_no_encoding():
    fast = completed_outcome(KEY, {"score": 1}, None, 1)
    assert encoded_data(attrs.evolve(fast)) is None
    changed = attrs.evolve(fast, data={"score": 2})
    assert prepare_outcomes([changed])[0][0].data_text == '{"score":2}'


@pytest.mark.parametrize("data, message", [
    ({"score": float("nan")}, "output.score: nan is not a JSON number"),
    ({"score": object()}, "output.score: object is not a JSON value"),
    ({1: 2}, "output: key 1 is not a string"),
])
def test_bad_data_is_refused_naming_its_path(data, message):
    with pytest.raises(InvalidInputError, match=message):
        completed_outcome(KEY, data, None, 1)


@pytest.mark.parametrize("key, index, attempts, message", [
    ("", None, 1, "RowOutcome.key must have 1 to"),
    (KEY, -1, 1, "input_index must be an integer >= 0"),
    (KEY, True, 1, "input_index must be an integer >= 0"),
    (KEY, 2**63, 1, "input_index must be an integer >= 0"),
    (KEY, None, 0, "attempts must be an integer from 1"),
    (KEY, None, 10**7, "attempts must be an integer from 1"),
])
def test_bad_parts_get_the_constructors_errors(key, index, attempts, message):
    with pytest.raises(InvalidInputError, match=message):
        completed_outcome(key, {"score": 1}, index, attempts)


def test_output_names_are_still_checked_by_prepare_outcomes():
    with pytest.raises(InvalidInputError, match=r"outcomes\[0\].data: field name '_x'"):
        prepare_outcomes([completed_outcome(KEY, {"_x": 1}, None, 1)])


async def test_completion_writes_the_data_as_it_was_encoded(tenant):
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    first, second = admission.pending
    shared = {"score": 1, "tags": ["x"]}
    outcomes = [completed_outcome(first.key, shared, first.input_index, 1),
                RowOutcome(second.key, OutcomeStatus.COMPLETED, data={"score": 2.0},
                           input_index=second.input_index)]
    shared["score"] = float("nan")  # the caller's dict changes after the outcome was built
    done = await complete(tenant, run, NS, CONTRACT, outcomes)
    assert done.committed_keys == (first.key, second.key)
    stored = await raw_rows(tenant, play_scope(tenant), NS, fields=("score", "tags"))
    assert (stored[first.key]["score"], stored[first.key]["tags"]) == (1, ["x"])
    assert stored[second.key]["score"] == 2
    assert stored[first.key]["_status"] == stored[second.key]["_status"] == "enriched"
