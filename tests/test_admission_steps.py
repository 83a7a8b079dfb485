"""The admission actor's probe-or-admit state machine (`actors.admission_steps`), pure."""

import pytest

from runplane.actors.admission_steps import (
    TRANSITIONS, AdmissionSteps, Event, Step, event_of,
)


def test_events_say_what_a_unit_turned_out_to_be():
    assert event_of(True, 0, 5) is Event.SETTLED
    assert event_of(False, 5, 5) is Event.ALL_NEW
    assert event_of(False, 4, 5) is Event.SOME_EXISTED


def test_a_settled_unit_probes_the_rest_of_its_group_once():
    steps = AdmissionSteps()
    steps.start_group()
    assert steps.probes_unit and not steps.probes_rest(3)
    steps.on(Event.SETTLED)
    assert steps.step is Step.PROBE_REST and steps.probes_rest(2) and not steps.probes_rest(1)
    steps.on(Event.REST_UNSETTLED)  # the group goes unit by unit from here
    assert steps.step is Step.PROBE_UNIT and steps.probes_unit
    steps.on(Event.SETTLED)
    assert steps.step is Step.PROBE_REST and not steps.probes_rest(2)  # once per group
    steps.start_group()
    assert steps.probes_rest(2)


def test_all_new_rows_admit_the_next_unit_without_a_probe_until_one_existed():
    steps = AdmissionSteps()
    steps.on(Event.ALL_NEW)
    assert steps.step is Step.ADMIT and not steps.probes_unit
    steps.on(Event.ALL_NEW)
    assert not steps.probes_unit
    steps.on(Event.SOME_EXISTED)
    assert steps.step is Step.PROBE_UNIT and steps.probes_unit


def test_the_leading_probes_hand_over_to_admitting():
    steps = AdmissionSteps()
    steps.on(Event.LEADING_UNSETTLED)
    assert steps.step is Step.ADMIT


def test_units_are_sent_ahead_only_after_all_new_rows_or_into_an_empty_sheet():
    steps = AdmissionSteps()
    assert not steps.sends_ahead
    steps.on(Event.LEADING_UNSETTLED)  # maybe a rerun's one changed row: one at a time
    assert not steps.probes_unit and not steps.sends_ahead
    steps.on(Event.ALL_NEW)
    assert steps.sends_ahead
    steps.on(Event.SOME_EXISTED)
    assert not steps.sends_ahead
    empty = AdmissionSteps()
    empty.on(Event.EMPTY_SHEET)
    assert empty.step is Step.ADMIT and empty.sends_ahead


def test_an_impossible_event_is_a_bug_not_a_silent_step():
    steps = AdmissionSteps(Step.ADMIT)
    with pytest.raises(KeyError):
        steps.on(Event.SETTLED)  # no probe ran
    assert all(isinstance(nxt, Step) for nxt in TRANSITIONS.values())
