"""The gateway client's retry decision, as a pure function (no server), and the per-action
attempt timeouts (a `sheets.admit` request may take 10 minutes)."""

from __future__ import annotations

import json

import pytest

from runplane.engine.actions import actions
from runplane.engine.errors import (
    ConflictError, GatewayUnavailableError, InvalidInputError, StoreUnavailableError,
)
from runplane.engine.gateway.retry import (
    Attempted, RetryPolicy, RetryState, decide, window,
)
from runplane.engine.gateway.transport import DEADLINE_MARGIN_S, attempt_timeout
from runplane.engine.gateway.senders import outcome_texts
from runplane.engine.sheets.outcome_inputs import prepare_outcomes
from runplane.engine.sheets.model import ROW_OUTCOME, RowOutcome

POLICY = RetryPolicy(answered_delays_s=(1.0, 2.0, 4.0), unreachable_budget_s=10.0,
                     completion_total_s=20.0, min_answered_wait_s=2.0)
WHERE = "the gateway at http://stub"


def error(code: str, **extra) -> dict:
    return {"error": "no", "code": code, "action": "x", **extra}


def test_an_answer_ends_the_operation_and_counts_one_answered_attempt():
    d = decide(POLICY, RetryState(0.0), Attempted(200, {"result": 1}), 0.0, 0.1, "x", WHERE)
    assert (d.kind, d.payload, d.state.answered, d.state.attempts) == ("answer", {"result": 1}, 1, 1)


def test_answered_failures_wait_the_ladder_or_the_server_whichever_is_longer():
    state = RetryState(0.0)
    busy = Attempted(504, error("unavailable", retry_after_ms=3000))
    d = decide(POLICY, state, busy, 0.0, 0.0, "x", WHERE)
    assert (d.kind, d.wait_s) == ("retry", 3.0)  # the server's 3 s beats the ladder's 1 s
    silent = Attempted(503, error("unavailable"))
    d = decide(POLICY, d.state, silent, 0.0, 0.0, "x", WHERE)
    assert (d.kind, d.wait_s) == ("retry", 2.0)  # no wait named: at least 2 s (ladder: 2 s)
    d = decide(POLICY, d.state, Attempted(502, None, failure=ValueError("cut")), 0, 0, "x", WHERE)
    assert (d.kind, d.wait_s) == ("retry", 4.0)  # a failed body is retried like a 5xx
    d = decide(POLICY, d.state, silent, 0.0, 0.0, "x", WHERE)
    assert d.kind == "stop" and d.state.answered == 4  # the ladder's 3 steps + 1 attempt
    assert isinstance(d.error, StoreUnavailableError) and "answered-attempt budget" in str(d.error)


def test_a_refusal_stops_at_once_with_its_own_error():
    d = decide(POLICY, RetryState(0.0), Attempted(409, error("conflict")), 0.0, 0.0, "x", WHERE)
    assert d.kind == "stop" and d.wait_s == 0 and isinstance(d.error, ConflictError)
    d = decide(POLICY, RetryState(0.0), Attempted(400, error("invalid_input")), 0, 0, "x", WHERE)
    assert isinstance(d.error, InvalidInputError)


def test_unreachable_attempts_spend_time_not_the_ladder_and_stop_at_the_budget():
    state = RetryState(0.0)
    gone = Attempted(None, failure=ConnectionRefusedError("refused"))
    waits = []
    now = 0.0
    while True:
        d = decide(POLICY, state, gone, now, now + 0.5, "x", WHERE)
        state, now = d.state, now + 0.5 + d.wait_s
        waits.append(d.wait_s)
        if d.kind == "stop":
            break
    assert state.answered == 0 and waits[:3] == [1.0, 2.0, 4.0]
    assert now == pytest.approx(POLICY.unreachable_budget_s)  # waits out the budget exactly
    assert isinstance(d.error, GatewayUnavailableError) and "unreachable budget" in str(d.error)
    assert "http://stub" in str(d.error)


def test_an_outage_extends_a_completions_deadline():
    state = RetryState(0.0, total_deadline=True)
    assert window(POLICY, state, 5.0, 30.0, "sheets.complete", WHERE) == 15.0  # cut to 20 s
    d = decide(POLICY, state, Attempted(None, failure=OSError("reset")), 0.0, 6.0, "c", WHERE)
    assert d.state.unreachable_s == 6.0 + 1.0  # the attempt and its wait
    assert d.state.answered_deadline(POLICY) == 27.0
    assert window(POLICY, d.state, 25.0, 30.0, "sheets.complete", WHERE) == 2.0
    with pytest.raises(GatewayUnavailableError, match="completion deadline"):
        window(POLICY, d.state, 27.0, 30.0, "sheets.complete", WHERE)
    busy = Attempted(504, error("unavailable", retry_after_ms=5000))
    late = decide(POLICY, d.state, busy, 23.0, 23.0, "c", WHERE)
    assert late.kind == "stop" and "last answer" in str(late.error)  # 23 + 5 > 27


def test_an_admission_request_may_take_ten_minutes_others_their_deadline():
    registry = actions()
    admit, complete, register = (registry[n] for n in ("sheets.admit", "sheets.complete",
                                                       "runs.register"))
    policy = RetryPolicy()
    assert policy.admission_timeout_s == 600.0
    assert admit.deadline_s == 30.0  # the server's own: past it, a 503 the client rides
    assert attempt_timeout(policy, admit) == 600.0
    assert attempt_timeout(policy, complete) == complete.deadline_s + DEADLINE_MARGIN_S
    assert attempt_timeout(policy, register) == register.deadline_s + DEADLINE_MARGIN_S
    assert attempt_timeout(RetryPolicy(request_timeout_s=90.0), register) == 90.0
    assert attempt_timeout(RetryPolicy(admission_timeout_s=5.0), admit) == \
        admit.deadline_s + DEADLINE_MARGIN_S  # never under the server's own deadline
    with pytest.raises(InvalidInputError, match="admission_timeout_s"):
        RetryPolicy(admission_timeout_s=-1)


def test_outcomes_travel_in_the_one_codec_last_one_wins():
    outcomes = [RowOutcome("a", "completed", {"score": 1}, input_index=3),
                RowOutcome("b", "failed", error="boom", attempts=2,
                           cell_meta={"score": {"note": "é"}}),
                RowOutcome("a", "completed", {"score": 2})]
    prepared, _ = prepare_outcomes(outcomes)
    texts = outcome_texts(outcomes, prepared)
    decoded = [ROW_OUTCOME.decode(json.loads(text), "o") for text in texts]
    assert decoded == [outcomes[1], outcomes[2]]
    hostile = [RowOutcome("c", "failed", error="bad \ud800 \x00 byte"),
               RowOutcome("d", "failed", error="  ")]
    prepared, _ = prepare_outcomes(hostile)
    errors = [json.loads(text)["error"] for text in outcome_texts(hostile, prepared)]
    assert errors == [p.error for p in prepared] and "\ud800" not in errors[0]
