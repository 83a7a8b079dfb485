"""A list map's proof that every row ends a cache hit (`actors.list_proof`): a batch of plain
completed outcomes is checked an output at a time; it must find what the check of each
outcome finds."""

from __future__ import annotations

import pytest

from runplane.actors.list_proof import ListProof
from runplane.engine.sheets import RowOutcome
from runplane.engine.sheets.outcome_inputs import completed_outcome
from runplane.engine.sheets.write_ledger import WriteLedger

OUTPUTS = ("score", "tags")


def proof() -> ListProof:
    return ListProof(WriteLedger(("o", "p", "t")), OUTPUTS)


def good(i: int) -> RowOutcome:
    return completed_outcome(f"k{i}", {"score": i, "tags": ["a"], "other": None}, i, 1)


@pytest.mark.parametrize("odd, spoils", [
    (None, False),
    (completed_outcome("x", {"score": 0, "tags": False}, 9, 1), False),  # falsy values are hits
    (completed_outcome("x", {"score": None, "tags": ["a"]}, 9, 1), True),
    (completed_outcome("x", {"score": 1, "tags": ""}, 9, 1), True),
    (completed_outcome("x", {"score": 1}, 9, 1), True),
    (RowOutcome("x", "completed", None, 9), True),
    (RowOutcome("x", "completed", {"score": 1, "tags": 2}, 9, cell_meta={"score": {"a": 1}}),
     True),
    (RowOutcome("x", "failed", None, 9, error="boom"), False),  # not counted: never recorded
])
def test_a_batch_is_checked_as_each_outcome_would_be(odd, spoils):
    batch = [good(i) for i in range(5)] + ([] if odd is None else [odd])
    whole, each = proof(), proof()
    whole.check(batch)
    for outcome in batch:
        each.check([outcome])
    assert whole.no_hit_seen is each.no_hit_seen is spoils


def test_no_outputs_no_spoil():
    bare = ListProof(WriteLedger(("o", "p", "t")), ())
    bare.check([RowOutcome("x", "completed", None, 1), good(2)])
    assert not bare.no_hit_seen
