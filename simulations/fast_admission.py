"""Scenario `fast_admission`: the fast admission paths answer exactly what today's admission does.

How it works
- Hypothesis draws a `Plan`: a small sheet where each row is in one of the states a rerun meets
  (`STATES`: absent, completed and fresh, completed but stale under the map's cell policy,
  completed with an output missing, failed in one run or in two, pending from an older run or
  from ours, leased by another attempt of our run (lease live or expired), owned by a newer run
  — pending or completed), the rows a map then admits (with duplicates, and possibly changed
  inputs), the admitting attempt (none, or one), `give_up_after` (None, 1 or 2), and which fast
  path to take:
    * `probe` — `sheets.probe` from keys alone, then, when it does not settle every row,
      `admit(cache_hits="count")` with the rows sent;
    * `staged` — the same, but the rows are first staged and sealed as an array input of the
      admitting run and the admission reads them from the page fact (`staged_page=`).
- The same states are built in two sheets of one tenant (two table namespaces, explicit keys so
  both sheets share them) through the engine's own calls (admit/complete by an older, our and a
  newer run; staleness by moving `completed_at` back two hours). Today's admission
  (`admit`, default mode) runs on one sheet, the fast path on the other.
- Invariants: inserted, skipped and cached counts, pending rows (key, input index, row) and
  blocked rows (key, input index, reason) are equal; a probe that settled every row wrote
  nothing; afterwards both sheets hold the same rows (status, run, write version, input index,
  attempt, error, inputs, outputs, cell meta statuses) and each sheet's counters equal COUNT.
"""

from __future__ import annotations

import uuid
from typing import Literal

import attrs
import trio
from hypothesis import strategies as st

from runplane.engine import MapScope, PlayScope, RunScope, array_input, runs, sheets
from runplane.engine.array_input.pages import encode_page
from runplane.engine.ports import SHEET_LANE
from runplane.engine.sheets.layout import column_name, layout_for

from .counters import counters_match
from .harness import open_example_tenant, run_examples
from .report import SimulationReport

NAME = "fast_admission"
EXAMPLE_TIMEOUT = 60.0
ORG, PLAY = "org-sim", "play-sim"
SLOW, FAST = "slow_sheet", "fast_sheet"
CONTRACT = sheets.SheetContract(inputs=("name", "v"), outputs=("score", "tag"))
POLICY = {"score": sheets.CellPolicy(3600.0)}

STATES = (
    "absent", "completed", "stale", "missing_output", "failed", "failed_twice", "pending_older",
    "pending_ours",
    "leased_live", "leased_expired", "newer_pending", "newer_completed",
)
Path = Literal["probe", "staged"]


@attrs.frozen
class Plan:
    states: tuple[str, ...]
    admitted: tuple[int, ...]    # row numbers the map admits, in order (duplicates allowed)
    changed: tuple[bool, ...]    # per admitted entry: its input differs from the stored one
    attempt: bool
    give_up_after: int | None
    path: Path

    def describe(self) -> str:
        return (f"states={list(self.states)} admitted={list(self.admitted)} "
                f"changed={[i for i, c in enumerate(self.changed) if c]} "
                f"attempt={self.attempt} give_up_after={self.give_up_after} path={self.path}")


@st.composite
def plans(draw) -> Plan:
    states = tuple(draw(st.lists(st.sampled_from(STATES), min_size=1, max_size=12), label="states"))
    n = len(states)
    admitted = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n),
                          label="admitted"))
    changed = tuple(draw(st.lists(st.integers(0, 5).map(lambda x: x == 0),
                                  min_size=len(admitted), max_size=len(admitted))))
    return Plan(states, admitted, changed, draw(st.booleans(), label="attempt"),
                draw(st.sampled_from((None, 1, 2)), label="give_up_after"),
                draw(st.sampled_from(("probe", "staged")), label="path"))


def _key(i: int) -> str:
    return f"key-{i}"


def _row(i: int, changed: bool = False) -> dict:
    return {"name": f"row-{i}", "v": 1 if changed else 0}


async def _build(tenant, namespace: str, plan: Plan, oldest, older, ours, newer,
                 key=_key) -> None:
    """Put every row of the plan into its drawn state in the sheet `namespace` (row `i` has
    the key `key(i)`, by default an explicit one both sheets share)."""
    by_state: dict[str, list[int]] = {}
    for i, state in enumerate(plan.states):
        by_state.setdefault(state, []).append(i)

    def rows_in(*states: str) -> list[int]:
        return [i for state in states for i in by_state.get(state, [])]

    async def admit(run, numbers, attempt=None):
        if numbers:
            await sheets.admit(tenant, run, namespace, CONTRACT, [_row(i) for i in numbers],
                               keys=[key(i) for i in numbers], attempt=attempt)

    async def complete(run, numbers, *, failed=False, data=None):
        if numbers:
            outcomes = [
                sheets.RowOutcome(key(i), "failed" if failed else "completed",
                                  data if data is not None else {"score": i, "tag": f"t{i}"},
                                  error="boom" if failed else None)
                for i in numbers
            ]
            await sheets.complete(tenant, run, namespace, CONTRACT, outcomes)

    await sheets.ensure_sheet(tenant, PlayScope(ORG, PLAY), namespace, CONTRACT)
    await admit(oldest, rows_in("failed_twice"))
    await complete(oldest, rows_in("failed_twice"), failed=True)
    await admit(older, rows_in("completed", "stale", "missing_output", "failed", "failed_twice",
                               "pending_older"))
    await complete(older, rows_in("completed", "stale"))
    await complete(older, rows_in("missing_output"), data={"score": 1})
    await complete(older, rows_in("failed", "failed_twice"), failed=True)
    await admit(ours, rows_in("pending_ours"))
    await admit(ours, rows_in("leased_live"), sheets.Attempt("other", 1, lease_s=3600.0))
    await admit(ours, rows_in("leased_expired"), sheets.Attempt("other", 1, lease_s=0.0))
    await admit(newer, rows_in("newer_pending", "newer_completed"))
    await complete(newer, rows_in("newer_completed"))
    stale = [key(i) for i in rows_in("stale")]
    if stale:
        layout = layout_for(tenant, PlayScope(ORG, PLAY), namespace)
        async with tenant.connection(SHEET_LANE) as conn:
            await conn.execute(
                f"""UPDATE {layout.qualified}
                       SET _cell_meta = jsonb_set(_cell_meta, '{{score,completed_at}}',
                           to_jsonb((_cell_meta #>> '{{score,completed_at}}')::float8 - 7200))
                     WHERE _key = ANY($1::text[])""",
                stale,
            )


async def _stored(tenant, namespace: str) -> dict[str, tuple]:
    """Every row of a sheet, without what legitimately differs between two sheets (versions,
    timestamps, lease instants)."""
    layout = layout_for(tenant, PlayScope(ORG, PLAY), namespace)
    cells = "".join(f', "{column_name(f)}"::text' for f in CONTRACT.fields)
    async with tenant.connection(SHEET_LANE) as conn:
        records = await conn.fetch(
            f"""SELECT _key, _status, _run_id, _write_version, _input_index, _attempt_id,
                       _attempt_expires_at IS NULL, _error,
                       (SELECT jsonb_object_agg(k, v -> 'status') FROM jsonb_each(_cell_meta)
                         AS m(k, v))::text{cells}
                  FROM {layout.qualified}"""
        )
    return {record[0]: tuple(record)[1:] for record in records}


def _admission_view(admission: sheets.Admission) -> tuple:
    return (
        admission.inserted, admission.skipped, admission.cached,
        [(row.key, row.input_index, row.row) for row in admission.pending],
        [(row.key, row.input_index, row.reason) for row in admission.blocked],
    )


async def _stage(tenant, scope: MapScope, rows: list[dict]) -> list[tuple[int, str]]:
    """Stage and seal `rows` as one array input; the (offset, digest) of each page."""
    source = [array_input.Occurrence(row) for row in rows]
    fingerprint = array_input.source_fingerprint(source)
    drafts = array_input.paginate(source)
    await array_input.begin(tenant, scope, source_fingerprint=fingerprint,
                            source_rows=len(source), has_source_identities=False)
    for draft in drafts:
        await array_input.put_page(tenant, scope, source_fingerprint=fingerprint,
                                   ordinal=draft.ordinal, offset=draft.offset, rows=draft.rows)
    await array_input.seal(tenant, scope, source_fingerprint=fingerprint,
                           source_rows=len(source), page_count=len(drafts))
    return [(d.offset, encode_page(fingerprint, d.ordinal, d.offset, d.rows).digest)
            for d in drafts]


async def run_example(dsn: str, plan: Plan) -> tuple[list[str], int]:
    violations: list[str] = []
    async with open_example_tenant(ORG, dsn) as tenant:
        with trio.fail_after(EXAMPLE_TIMEOUT):
            oldest, older, ours, newer = [
                await runs.register(tenant, RunScope(ORG, PLAY, f"run-{name}"))
                for name in ("oldest", "older", "ours", "newer")
            ]
            for namespace in (SLOW, FAST):
                await _build(tenant, namespace, plan, oldest, older, ours, newer)
            rows = [_row(i, changed) for i, changed in zip(plan.admitted, plan.changed)]
            keys = [_key(i) for i in plan.admitted]
            attempt = sheets.Attempt("mine", 2, lease_s=3600.0) if plan.attempt else None
            common = dict(keys=keys, attempt=attempt, cell_policies=POLICY,
                          give_up_after=plan.give_up_after)

            slow = await sheets.admit(tenant, ours, SLOW, CONTRACT, rows, **common)
            before = await _stored(tenant, FAST)
            fast = await sheets.probe(tenant, ours, FAST, CONTRACT, rows, **common)
            if fast is not None and await _stored(tenant, FAST) != before:
                violations.append("a probe that settled every row wrote to the sheet")
            if fast is None and plan.path == "probe":
                fast = await sheets.admit(tenant, ours, FAST, CONTRACT, rows, cache_hits="count",
                                          **common)
            elif fast is None:
                scope = MapScope(ORG, PLAY, ours.run_id, FAST, f"map-{uuid.uuid4().hex[:8]}")
                ((offset, digest),) = await _stage(tenant, scope, rows)
                fast = await sheets.admit(
                    tenant, ours, FAST, CONTRACT, rows, input_offset=offset, cache_hits="count",
                    staged_page=sheets.StagedPage(scope, 0, digest), **common)
            if fast.completed != ():
                violations.append("count mode listed cache hits")
            if _admission_view(fast) != _admission_view(slow):
                violations.append(
                    f"fast admission {_admission_view(fast)} != today's {_admission_view(slow)}"
                )
            if await _stored(tenant, FAST) != await _stored(tenant, SLOW):
                violations.append("the two sheets differ after admission")
            for namespace in (SLOW, FAST):
                ok, detail = await counters_match(tenant, PlayScope(ORG, PLAY), namespace)
                if not ok:
                    violations.append(f"{namespace}: {detail}")
    return violations, 0


# Failing schedules found, `(plan, scheduler seed)`: each runs first in every run
# (docs/guide/testing.md, "Simulations"). Paste the "minimal failing schedule" a failed run prints.
REGRESSIONS: list[tuple[Plan, int]] = []


def run(examples: int, seed: int | None, dsn: str | None = None) -> SimulationReport:
    """Run `examples` hypothesis examples of the scenario; collect what they violate."""
    return run_examples(NAME, plans(), run_example, examples=examples, seed=seed, dsn=dsn,
                        regressions=REGRESSIONS)
