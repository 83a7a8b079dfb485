"""The fencing simulation, CI-sized, and its pure model's judgements."""

from __future__ import annotations

from runplane.simulations import run_scenario
from runplane.simulations.fencing import run
from runplane.simulations.sheet_model import (
    AdmitCall,
    CompleteCall,
    SentOutcome,
    SheetHistory,
    StoredRow,
)


def test_fencing_ci_sized_run_is_clean(dsn):
    report = run_scenario("fencing", examples=25, seed=20261130, dsn=dsn)
    assert (report.violations, report.examples, report.faults > 0) == ([], 25, True)


def test_fencing_on_the_pre_18_statement_is_clean(dsn, monkeypatch):
    from runplane.engine.sheets import completion

    monkeypatch.setattr(completion, "RETURNING_OLD_SINCE", 10**9)
    report = run(examples=10, seed=7, dsn=dsn)
    assert report.violations == []
    assert report.examples == 10


def _history() -> SheetHistory:
    history = SheetHistory()
    history.admissions.append(AdmitCall("a", 1, "att-1", ("k",), ("k",), (), ()))
    history.admissions.append(AdmitCall("b", 2, None, ("k",), ("k",), (), ()))
    history.completions.append(CompleteCall(
        "a", 1, "att-1", (SentOutcome("k", "completed", "old"),), (),
        (("k", "stale_write_version", 2),),
    ))
    history.completions.append(CompleteCall(
        "b", 2, None, (SentOutcome("k", "completed", "new"),), ("k",), (),
    ))
    return history


def test_model_accepts_a_clean_history():
    assert _history().check({"k": StoredRow("k", "enriched", 2, None, "new", None)}) == []


def test_model_flags_a_fenced_value_an_old_version_and_a_lost_row():
    history = _history()
    assert any("fenced outcome" in v for v in history.check(
        {"k": StoredRow("k", "enriched", 2, None, "old", None)}))
    assert any("highest version" in v for v in history.check(
        {"k": StoredRow("k", "enriched", 1, None, "new", None)}))
    assert any("not stored" in v for v in history.check({}))
    assert any("no call took it" in v for v in history.check({
        "k": StoredRow("k", "enriched", 2, None, "new", None),
        "x": StoredRow("x", "pending", 2, None, None, None),
    }))


def test_model_flags_a_value_from_another_attempt_and_wrong_fence_reasons():
    history = SheetHistory()
    history.admissions.append(AdmitCall("a", 1, "att-1", ("k",), ("k",), (), ()))
    history.admissions.append(AdmitCall("b", 1, "att-2", ("k",), ("k",), (), ()))
    history.completions.append(CompleteCall(
        "a", 1, "att-1", (SentOutcome("k", "completed", "from-1"),), ("k",), (),
    ))
    history.completions.append(CompleteCall(
        "b", 1, "att-2", (SentOutcome("k", "failed", "boom"),), (),
        (("k", "unadmitted", 2),),  # an unadmitted row must be older, not newer
    ))
    violations = history.check({"k": StoredRow("k", "enriched", 1, "att-2", "from-1", None)})
    assert any("attempt att-1" in v for v in violations)
    assert any("fenced k as unadmitted" in v for v in violations)


def test_model_flags_blocks_nobody_caused():
    history = SheetHistory()
    history.admissions.append(AdmitCall("a", 1, None, ("k",), (), (), (("k", "newer_run"),)))
    history.admissions.append(AdmitCall("b", 1, "att-1", ("j",), (), (), (("j", "attempt_active"),)))
    violations = history.check({})
    assert any("newer_run" in v for v in violations)
    assert any("attempt_active" in v for v in violations)
