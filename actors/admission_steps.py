"""What the admission actor does with its next unit: probe it, probe the rest of its group, or
admit it straight away — a state machine written as a table.

How it works
- A probe (`engine.sheets.probe`) costs one read-only statement and saves the admission's
  write when every row of a unit is settled; it is wasted when rows need admitting. So the
  actor follows what the last unit said:
    * `PROBE_UNIT` (the start): probe the unit; if it is not settled, admit it.
    * `PROBE_REST`: the last probe settled its unit, so the rest likely is too: probe the rest
      of the group in one statement (at most once per group, and only for two or more units);
      if that does not settle, go on unit by unit (`REST_UNSETTLED`), else the group is done.
      With one unit left, or the group probed once already, it is probed alone.
    * `ADMIT`: the last unit's rows were all new, so the next ones likely are too: admit
      without probing. Reached from a unit that was all new (or from a list into a sheet
      that held no row), the next unit may be sent while that one is still on its way
      (`sends_ahead`); reached from a list's leading probes it is not: the unit they found
      unsettled may be a rerun's one changed row, and its next unit would then be settled.
- Events are what a unit turned out to be (`event_of`): settled by its probe, admitted with
  every row new, or admitted with some row already there (or a duplicate). `TRANSITIONS`
  maps (step, event) to the next step; a pair not in it is a bug (`KeyError`).
- A list source's leading rows are probed before the list is encoded (`actors.admission`);
  the first unit after them is admitted without a probe (`LEADING_UNSETTLED`): it is the one
  those probes found unsettled.
This module does no I/O; the admission actor (`actors.admission`) drives it.
"""

from __future__ import annotations

import enum

import attrs


class Step(enum.Enum):
    """What admission does with the next unit."""

    PROBE_UNIT = "probe the unit, admit it if unsettled"
    PROBE_REST = "probe the rest of the group whole"
    ADMIT = "admit the unit without probing"


class Event(enum.Enum):
    """What a unit (or the rest of a group) turned out to be."""

    SETTLED = "a probe settled the unit"
    ALL_NEW = "admitted; every row was new"
    SOME_EXISTED = "admitted; some row existed already, or was a duplicate"
    REST_SETTLED = "the probe of the rest of the group settled it"
    REST_UNSETTLED = "the probe of the rest of the group did not settle it"
    LEADING_UNSETTLED = "the probes of a list's leading rows stopped at rows to admit"
    EMPTY_SHEET = "a list goes into a sheet that held no row: every row is new"


TRANSITIONS: dict[tuple[Step, Event], Step] = {
    (Step.PROBE_UNIT, Event.SETTLED): Step.PROBE_REST,
    (Step.PROBE_UNIT, Event.ALL_NEW): Step.ADMIT,
    (Step.PROBE_UNIT, Event.SOME_EXISTED): Step.PROBE_UNIT,
    (Step.PROBE_UNIT, Event.LEADING_UNSETTLED): Step.ADMIT,
    (Step.PROBE_UNIT, Event.EMPTY_SHEET): Step.ADMIT,
    (Step.PROBE_REST, Event.SETTLED): Step.PROBE_REST,
    (Step.PROBE_REST, Event.ALL_NEW): Step.ADMIT,
    (Step.PROBE_REST, Event.SOME_EXISTED): Step.PROBE_UNIT,
    (Step.PROBE_REST, Event.REST_SETTLED): Step.PROBE_REST,
    (Step.PROBE_REST, Event.REST_UNSETTLED): Step.PROBE_UNIT,
    (Step.ADMIT, Event.ALL_NEW): Step.ADMIT,
    (Step.ADMIT, Event.SOME_EXISTED): Step.PROBE_UNIT,
}


def event_of(settled: bool, inserted: int, rows: int) -> Event:
    """The event of one unit of `rows` rows: settled by its probe, or admitted with `inserted`
    rows new."""
    if settled:
        return Event.SETTLED
    return Event.ALL_NEW if inserted >= rows else Event.SOME_EXISTED


@attrs.define(eq=False)
class AdmissionSteps:
    """The admission actor's current step; changed only through `on`."""

    step: Step = Step.PROBE_UNIT
    grouped: bool = False  # the current group was probed whole once already
    last: Event | None = None  # the last event

    def start_group(self) -> None:
        self.grouped = False

    def probes_rest(self, units_left: int) -> bool:
        """Whether to probe the rest of the group (`units_left` units) in one statement now."""
        return self.step is Step.PROBE_REST and not self.grouped and units_left > 1

    @property
    def probes_unit(self) -> bool:
        """Whether to probe the next unit before admitting it."""
        return self.step is not Step.ADMIT

    @property
    def sends_ahead(self) -> bool:
        """Whether the next unit may be sent while the one before is on its way: admitting
        without probing, after a unit that was all new or into a sheet that held no row."""
        return self.step is Step.ADMIT and self.last in (Event.ALL_NEW, Event.EMPTY_SHEET)

    def on(self, event: Event) -> None:
        if event in (Event.REST_SETTLED, Event.REST_UNSETTLED):
            self.grouped = True
        self.step = TRANSITIONS[(self.step, event)]
        self.last = event
