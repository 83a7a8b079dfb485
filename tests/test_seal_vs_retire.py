"""The seal_vs_retire simulation, CI-sized, and its pure model's judgements."""

from __future__ import annotations

import json

from runplane.engine import array_input as A
from runplane.engine.array_input.pages import encode_page
from runplane.simulations import run_scenario
from runplane.simulations.array_model import ArrayModel, StoredFact


def test_seal_vs_retire_ci_sized_run_is_clean(dsn):
    report = run_scenario("seal_vs_retire", examples=30, seed=20261130, dsn=dsn)
    assert (report.violations, report.examples, report.faults > 0) == ([], 30, True)


def _model():
    return ArrayModel([A.Occurrence({"i": i}) for i in range(1500)])


def test_model_flags_a_success_after_retirement_and_leftover_facts():
    model = _model()
    start = model.begin_call()
    model.end_call("retirer", "retire", start, "ok", A.RetireResult(True, 0))
    start = model.begin_call()
    model.end_call("stager", "put_page", start, "ok")
    page = json.loads(encode_page(model.fingerprint, 0, 0, model.drafts[0].rows).text)
    stored = [StoredFact("array_input_guard", None, {"kind": "array_input_guard", "retired": True}),
              StoredFact("array_input_page", 0, page)]
    violations = model.check(stored)
    assert any("after retirement was done" in v for v in violations)
    assert any("still holds" in v for v in violations)
    assert model.check(stored[:1]) != []  # the late success alone is still a violation


def test_model_flags_a_partial_seal_a_foreign_page_and_unexpected_errors():
    model = _model()
    start = model.begin_call()
    model.end_call("stager", "put_page", start, "ConflictError")
    seal = {"kind": "array_input_seal", "source_fingerprint": model.fingerprint,
            "source_rows": 1500, "has_source_identities": False, "page_count": 1,
            "digest_chain": model.chain}
    foreign = json.loads(encode_page(model.fingerprint, 1, 1000, [{"i": -1}]).text)
    violations = model.check([StoredFact("array_input_seal", None, seal),
                              StoredFact("array_input_page", 1, foreign)])
    assert len(violations) == 3, violations


def test_model_accepts_a_clean_history():
    model = _model()
    stored = [StoredFact("array_input_guard", None, {"kind": "array_input_guard", "retired": False})]
    for draft in model.drafts:
        stored.append(StoredFact("array_input_page", draft.ordinal, json.loads(
            encode_page(model.fingerprint, draft.ordinal, draft.offset, draft.rows).text)))
    stored.append(StoredFact("array_input_seal", None, {
        "kind": "array_input_seal", "source_fingerprint": model.fingerprint, "source_rows": 1500,
        "has_source_identities": False, "page_count": 2, "digest_chain": model.chain}))
    start = model.begin_call()
    page = A.Page(model.drafts[1].offset, model.drafts[1].rows)
    model.end_call("reader", "read_page", start, "ok", (1, page))
    assert model.check(stored) == []
