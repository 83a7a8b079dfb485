"""run.map's fast admission (probe first, count cache hits, admit from page facts) answers
exactly as page-by-page default admission does, and a wake after a crash in a fast rerun
finishes every row exactly once."""

from __future__ import annotations

import collections
import os
from unittest import mock

import attrs
import trio
from hypothesis import HealthCheck, example, given, settings, strategies as st

from runplane.actors import open_run
from runplane.actors import admission as mapper_admission
from runplane.engine import PlayScope, RunScope, array_input as A, runs, sheets
from runplane.engine.array_input import source_pass as array_source
from runplane.engine.runs import new_run_id
from runplane.engine.sheets.layout import layout_for
from runplane.simulations import fast_admission as sim
from runplane.simulations.counters import counters_match
from runplane.simulations.harness import open_example_tenant
from runplane.simulations.ports import CountingPort

from .run_helpers import fact_kinds, forget_recorded_lists

SLOW, FAST = "slow_map", "fast_map"


@attrs.frozen
class MapPlan:
    states: tuple[str, ...]
    admitted: tuple[int, ...]   # row numbers of the source, in order (duplicates allowed)
    attempt: bool
    give_up_after: int | None
    listed: bool                # a list source (staged) or an async iterable
    page_rows: int              # rows per streamed page / admission unit of a list
    fact_rows: int = 1000       # rows per array-input page of a list


@st.composite
def map_plans(draw) -> MapPlan:
    states = tuple(draw(st.lists(st.sampled_from(sim.STATES), min_size=1, max_size=10)))
    n = len(states)
    admitted = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n)))
    return MapPlan(states, admitted, draw(st.booleans()), draw(st.sampled_from((None, 1, 2))),
                   draw(st.booleans()), draw(st.integers(1, 6)), draw(st.integers(1, 3)))


async def stream(rows):
    for row in rows:
        yield row


async def run_map(tenant, plan: MapPlan, namespace: str, fast: bool):
    """Map the plan's source over `namespace` as the run `ours`; what it did, by row number."""
    number = {sheets.row_key(sim._row(i), namespace): i for i in range(len(plan.states))}
    calls: list[int] = []
    admitted = trio.Event()

    # Calls wait until every page is admitted, so a later duplicate of a row always meets it in
    # flight (whether its first occurrence is written by then is a race in either path).
    async def fn(row):
        calls.append(int(row["name"].split("-")[1]))
        await admitted.wait()
        return {"score": 7, "tag": "new"}

    def on_progress(snapshot):
        if snapshot.source_rows == len(plan.admitted):
            admitted.set()

    rows = [sim._row(i) for i in plan.admitted]
    attempt = sheets.Attempt("mine", 2, lease_s=3600.0) if plan.attempt else None
    async with open_run(tenant, sim.PLAY, "run-ours", attempt=attempt,
                        retire_on_exit=False) as run:
        result = await run.map(
            namespace, rows if plan.listed else stream(rows), fn, contract=sim.CONTRACT,
            concurrency=32, cell_policies=sim.POLICY, give_up_after=plan.give_up_after,
            page_rows=plan.page_rows, fast_admission=fast, on_progress=on_progress)
    counts = (result.admitted, result.cached, result.blocked, result.skipped, result.executed,
              result.completed, result.failed, result.fenced)
    blocked = sorted((number[row.key], row.input_index, row.reason) for row in result.blocked_rows)
    stored = {number[key]: row for key, row in (await sim._stored(tenant, namespace)).items()}
    return counts, sorted(calls), blocked, stored


async def compare(dsn: str, plan: MapPlan) -> list[str]:
    violations = []
    async with open_example_tenant(sim.ORG, dsn) as tenant:
        with trio.fail_after(60):
            ladder = [await runs.register(tenant, RunScope(sim.ORG, sim.PLAY, f"run-{name}"))
                      for name in ("oldest", "older", "ours", "newer")]
            for namespace in (SLOW, FAST):
                await sim._build(tenant, namespace, plan, *ladder,
                                 key=lambda i, ns=namespace: sheets.row_key(sim._row(i), ns))
            # Small array-input pages, probes and probe groups: a short list spans several.
            with mock.patch.object(array_source, "MAX_PAGE_ROWS", plan.fact_rows), \
                    mock.patch.object(mapper_admission, "FIRST_PROBE_ROWS", plan.page_rows), \
                    mock.patch.object(mapper_admission, "LEADING_PROBE_ROWS", 2 * plan.page_rows + 1), \
                    mock.patch.object(mapper_admission, "PROBE_GROUP_ROWS", 2 * plan.page_rows + 1):
                slow = await run_map(tenant, plan, SLOW, fast=False)
                fast = await run_map(tenant, plan, FAST, fast=True)
            for name, a, b in zip(("counts", "calls", "blocked rows", "sheet"), fast, slow):
                if a != b:
                    violations.append(f"{name}: fast {a} != default {b}")
            for namespace in (SLOW, FAST):
                ok, detail = await counters_match(tenant, PlayScope(sim.ORG, sim.PLAY), namespace)
                if not ok:
                    violations.append(f"{namespace}: {detail}")
    return violations


@settings(max_examples=int(os.environ.get("RUNPLANE_FAST_RERUN_EXAMPLES", "25")), database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(plan=map_plans())
@example(plan=MapPlan(("completed", "completed", "completed", "absent", "completed"),
                      (0, 1, 2, 0, 3, 4), False, None, True, 2, 1))
@example(plan=MapPlan(("completed", "leased_live", "newer_pending", "failed_twice"),
                      (0, 1, 2, 3, 3), False, 2, True, 1, 1))
@example(plan=MapPlan(("stale", "completed", "leased_expired", "pending_ours"),
                      (1, 0, 2, 3), True, None, False, 1))
@example(plan=MapPlan(("completed",) * 6 + ("failed",), (0, 1, 2, 3, 4, 5, 6, 0),
                      False, None, True, 4, 2))
@example(plan=MapPlan(("completed",), (0, 0), False, None, True, 1, 2))  # found: a duplicate
# across two probes of the list's leading rows, inside one admission unit
def test_fast_admission_of_run_map_equals_the_default(dsn, plan):
    violations = trio.run(compare, dsn, plan)
    assert not violations, "\n".join(violations)


CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))


def rows(n: int) -> list[dict]:
    return [{"name": f"r{i}"} for i in range(n)]


async def _upper(row):
    return {"upper": row["name"].upper()}


async def settled_rerun(tenant, n: int, **options):
    """Map `rows(n)` once, then again in a new run through a counting port whose function must
    never be called; returns the rerun's result, its statements, its run id and the probes."""
    async with open_run(tenant, "play") as first:
        await first.map("t", rows(n), _upper, contract=CONTRACT)
    await forget_recorded_lists(tenant)  # else the recorded list answers the rerun whole
    port = CountingPort(tenant)
    calls = []

    async def again(row):
        calls.append(row)
        return {"upper": "changed"}

    async with open_run(port, "play", retire_on_exit=False) as rerun:
        port.reset()
        result = await rerun.map("t", rows(n), again, contract=CONTRACT, **options)
    assert (result.admitted, result.cached, result.executed) == (n, n, 0) and not calls
    sheet_table = layout_for(tenant, PlayScope(tenant.org_id, "play"), "t").qualified
    probes = [sql for sql in port.statements if sheet_table in sql and "AS unsettled" in sql]
    return port.statements, rerun.run_id, sheet_table, probes


async def test_a_settled_rerun_probes_writes_nothing_and_stages_nothing(tenant, monkeypatch):
    from runplane.actors import list_source

    encoded = []
    encode = list_source.ListSource.encode

    async def counted(self):
        encoded.append(self.scope.run_id)
        await encode(self)

    monkeypatch.setattr(list_source.ListSource, "encode", counted)
    statements, run_id, sheet_table, probes = await settled_rerun(tenant, 2500, page_rows=1000)
    assert encoded and run_id not in encoded  # the first run's only: the rerun runs nothing
    recorded = [sql for sql in statements if "sheet_lists" in sql and "ON CONFLICT" in sql]
    # the list-replay statement (it missed: the lists were forgotten) reads the facts and
    # writes only the run's `sheet_reuse` membership when it hits
    replays = [sql for sql in statements if "sheet_lists" in sql and "sheet_reuse" in sql]
    written = [sql for sql in statements
               if ("INSERT" in sql or "UPDATE" in sql)
               and (sheet_table in sql or "work_receipts" in sql)
               and sql not in recorded and sql not in replays]
    assert written == [], written
    assert len(recorded) == 1  # every row a cache hit: the list is recorded (reads the sheet)
    # two: the sentinel [0,100) alone, then (the sheet holds as many rows as the list) the
    # rest of the first chunk and the next as one ([100,1000) and [1000,2500))
    assert len(probes) == 2
    assert await fact_kinds(tenant, run_id) == []  # nothing staged: nothing will run


async def test_a_rerun_whose_sheet_counters_cannot_be_read_still_probes(tenant, monkeypatch):
    """The sheet's row count is only a hint: when it cannot be read, the list is probed as if
    the sheet held other rows (the sentinel alone, then the window chunk by chunk), and
    settles the same."""
    from runplane.actors import list_source
    from runplane.engine.errors import StoreUnavailableError

    async def unreadable(*_args, **_kwargs):
        raise StoreUnavailableError("counters unreadable")

    monkeypatch.setattr(list_source.sheets, "summary", unreadable)  # both maps: unknown
    _, _, _, probes = await settled_rerun(tenant, 2500)
    assert len(probes) == 3  # [0,100) alone, then [100,1000) and [1000,2500)


async def test_a_rerun_changed_mid_list_probes_up_to_the_change_and_admits_from_there(tenant):
    """The leading rows are probed chunk by chunk through the window; the first chunk not
    settled stops the probing (a probe already in flight is dropped) and the list is admitted
    from that chunk on: only the changed row runs."""
    async def fn(row):
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play") as first:
        await first.map("t", rows(3000), fn, contract=CONTRACT, page_rows=500)
    changed = rows(3000)
    changed[1800] = {"name": "changed"}
    calls = []

    async def again(row):
        calls.append(row["name"])
        return {"upper": "again"}

    port = CountingPort(tenant)
    sheet_table = layout_for(tenant, PlayScope(tenant.org_id, "play"), "t").qualified
    with mock.patch.object(mapper_admission, "FIRST_PROBE_ROWS", 200), \
            mock.patch.object(mapper_admission, "LEADING_PROBE_ROWS", 500):
        async with open_run(port, "play") as rerun:
            port.reset()
            result = await rerun.map("t", changed, again, contract=CONTRACT, page_rows=500)
    assert (result.admitted, result.cached, result.executed) == (3000, 2999, 1)
    assert calls == ["changed"]
    probes = [sql for sql in port.statements if sheet_table in sql and "AS unsettled" in sql]
    # Leading probes: the sentinel [0,100) alone, then through the window (the sheet holds as
    # many rows as the list) [100,700) (the chunks [100,200) and [200,700) as one), [700,1200)
    # ... [1700,2200), the first not settled: 5, and [2200,2700) if the window started it
    # before that answer was read (dropped). Then the units from 1700: [1700,2200) admitted
    # without a probe (its chunk was just probed), [2200,2700) probed (the last unit was not
    # all new) and settled, so the rest of its group in one: 2. Probing on past the change
    # would send 2 more.
    assert len(probes) in (5 + 2, 6 + 2), port.statements


async def test_a_list_into_an_empty_sheet_is_encoded_while_its_sheet_is_ensured(tenant,
                                                                                monkeypatch):
    """The count shows the sheet empty, so nothing is probed and every row is admitted: the
    list's encoding starts then, while the sheet is still being ensured (which here waits for
    it: the map would not finish if the encoding waited for the sheet)."""
    from runplane.actors import list_source, mapper

    started = trio.Event()
    encode, ensure_sheet = list_source.ListSource.encode, mapper.sheets.ensure_sheet

    async def encoding(self):
        started.set()
        await encode(self)

    async def ensuring(*args, **kwargs):
        with trio.fail_after(10):
            await started.wait()
        return await ensure_sheet(*args, **kwargs)

    monkeypatch.setattr(list_source.ListSource, "encode", encoding)
    monkeypatch.setattr(mapper.sheets, "ensure_sheet", ensuring)
    port = CountingPort(tenant)
    async with open_run(port, "play") as run:
        result = await run.map("t", rows(1500), _upper, contract=CONTRACT)
    assert (result.admitted, result.completed) == (1500, 1500)
    assert not [sql for sql in port.statements if "AS unsettled" in sql]  # nothing probed


async def test_new_rows_into_a_sheet_of_as_many_probe_only_the_sentinel(tenant):
    """A run of new rows into a sheet that holds as many rows (the shape of a rerun, by count)
    keys and probes only its first `SENTINEL_PROBE_ROWS` rows, not its whole list: not all
    settled, the probing stops and the list is admitted from row 0."""
    async with open_run(tenant, "play") as first:
        await first.map("t", rows(7000), _upper, contract=CONTRACT)
    new = [{"name": f"new{i}"} for i in range(7000)]
    port = CountingPort(tenant)
    sheet_table = layout_for(tenant, PlayScope(tenant.org_id, "play"), "t").qualified
    async with open_run(port, "play") as second:
        port.reset()
        result = await second.map("t", new, _upper, contract=CONTRACT, page_rows=1000)
    assert (result.admitted, result.cached, result.completed) == (7000, 0, 7000)
    probes = [sql for sql in port.statements if sheet_table in sql and "AS unsettled" in sql]
    # the sentinel only; probing the list ([0,6000) and [6000,7000) at once) would send 2
    assert len(probes) == 1, port.statements


async def test_a_wake_after_a_crash_in_a_fast_rerun_finishes_every_row_exactly_once(tenant):
    """A first run leaves rows 2000-2999 failed. A rerun probes pages 0-1 settled, stages the
    list at page 2, runs 100 of its rows (and hangs in others), and is cancelled. The wake finds
    the sealed input, settles pages 0-1 again, and runs exactly the rows not yet finished; each
    failed row finishes once, with the input byte-identical to the list's."""
    source = rows(3000)

    async def first_fn(row):
        if int(row["name"][1:]) >= 2000:
            raise RuntimeError("down")
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play") as first:
        result = await first.map("t", source, first_fn, contract=CONTRACT)
    assert (result.completed, result.failed) == (2000, 1000)

    finished: collections.Counter = collections.Counter()
    seen: list[dict] = []
    run_id = new_run_id()

    async def crashing_fn(row):
        seen.append(row)
        if len(finished) >= 100:
            await trio.sleep_forever()
        finished[row["name"]] += 1
        if len(finished) == 100:
            # The list is staged in the background while rows run: let the seal land (a crash
            # before it is another case: the wake resumes staging), then the process dies.
            while "array_input_seal" not in await fact_kinds(tenant, run_id):
                await trio.sleep(0.01)
            crash.cancel()
        return {"upper": row["name"].upper()}

    with trio.CancelScope() as crash:
        async with open_run(tenant, "play", run_id) as rerun:
            with trio.fail_after(60):
                await rerun.map("t", source, crashing_fn, contract=CONTRACT)
    assert crash.cancelled_caught and len(finished) == 100
    assert "array_input_seal" in await fact_kinds(tenant, run_id)  # staged at page 2

    async def wake_fn(row):
        seen.append(row)
        finished[row["name"]] += 1
        return {"upper": row["name"].upper()}

    async with open_run(tenant, "play", run_id) as woken:
        result = await woken.map("t", source, wake_fn, contract=CONTRACT)
    assert (result.admitted, result.cached, result.completed, result.failed) == (
        3000, 2100, 900, 0)
    assert finished == {f"r{i}": 1 for i in range(2000, 3000)}
    assert all(row == {"name": row["name"]} and int(row["name"][1:]) >= 2000 for row in seen)
    stored = await sheets.read_rows(tenant, PlayScope(tenant.org_id, "play"), "t", limit=5000)
    assert collections.Counter(row["_status"] for row in stored) == {"enriched": 3000}
    assert all(row["upper"] == row["name"].upper() for row in stored)
    ok, detail = await counters_match(tenant, PlayScope(tenant.org_id, "play"), "t")
    assert ok, detail
    assert await fact_kinds(tenant, run_id) == ["array_input_guard"]


def test_list_units_cover_the_source_in_order_and_respect_the_cuts():
    from runplane.actors.list_source import ListSource

    from .sheet_helpers import encode_and_key
    from runplane.engine import MapScope

    items = [{"name": f"n{i}", "pad": "x" * ((i % 7) * 700 if i < 2000 else 0)} for i in range(3500)]
    scope = MapScope("org", "play", "run", "t", "map-0")
    listed = ListSource(None, scope, items)
    listed.encoded, listed.keys = encode_and_key(items, "t")
    pages = listed.encoded.cuts
    assert any(count < 1000 for _, count in pages[:-1])  # cut by bytes too
    for start, cut_at, unit_rows in ((0, frozenset(), 5000), (1000, frozenset({1000, 2500}), 1500),
                                      (1234, frozenset({2000}), 700)):
        units = [unit for group in listed.page_groups(2000, unit_rows, start, cut_at)
                 for unit in group]
        assert units[0].offset == start
        assert [u.offset + len(u.rows) for u in units[:-1]] == [u.offset for u in units[1:]]
        assert units[-1].offset + len(units[-1].rows) == len(items)
        for unit in units:
            assert len(unit.rows) <= max(unit_rows, 1000)
            assert not any(unit.offset < cut < unit.offset + len(unit.rows) for cut in cut_at)
            assert unit.rows == listed.encoded.rows[unit.offset:unit.offset + len(unit.rows)]
            assert unit.keys == [sheets.row_key(row, "t") for row in unit.rows]
            if unit.ordinal is not None:
                assert (unit.offset, len(unit.rows)) == pages[unit.ordinal]


def test_a_lists_units_read_their_rows_and_texts_only_when_first_used(monkeypatch):
    """Cutting a group reads nothing: the first unit goes to admission without the group's
    later units copied, and a unit's texts and rows are read once, together."""
    from runplane.actors.list_source import ListSource
    from runplane.engine import MapScope

    items = rows(5000)
    listed = ListSource(None, MapScope("org", "play", "run", "t", "map-0"), items)
    listed.encoded = A.encode_source(items)
    reads = []
    span = type(listed.encoded).span
    monkeypatch.setattr(type(listed.encoded), "span",
                        lambda self, low, high: reads.append((low, high)) or span(self, low, high))
    group = next(listed.page_groups(10_000, 2000))
    assert [(u.offset, u.size) for u in group][:3] == [(0, 100), (100, 200), (300, 400)]
    assert reads == []
    first = group[0]
    assert first.keys == [sheets.row_key(row, "t") for row in items[:100]]
    assert first.rows == items[:100] and first.texts is not None and reads == [(0, 100)]
    assert sum(u.size for u in group) == 5000 and reads == [(0, 100)]


def test_a_list_ramps_its_first_units_only_while_the_rest_is_more_than_a_unit():
    """The first unit is small so work starts soon; the ramp's further cuts stop once the rest
    of the list fits one unit (each cut is one more admission request), and a one-page list
    (1,000 rows at most) has none: it is one unit, the whole page."""
    from runplane.actors.list_source import FIRST_UNIT_ROWS, ListSource

    from .sheet_helpers import encode_and_key
    from runplane.engine import MapScope

    for rows, unit_rows, expected in ((1001, 5000, [0, FIRST_UNIT_ROWS]),
                                      (1000, 5000, [0]),  # one page: one unit
                                      (80, 5000, [0]),
                                      (200, 200, [0]),  # a unit under 200 rows: no ramp
                                      (12000, 5000, [0, 100, 300, 700, 1500, 3100])):
        items = [{"name": f"n{i}"} for i in range(rows)]
        listed = ListSource(None, MapScope("org", "play", "run", "t", "map-0"), items)
        listed.encoded, listed.keys = encode_and_key(items, "t")
        offsets = [unit.offset for group in listed.page_groups(100_000, unit_rows)
                   for unit in group]
        assert offsets[:len(expected)] == expected, (rows, offsets)
        if rows <= unit_rows:
            assert offsets == expected, (rows, offsets)
        if rows == 1000:  # the whole page: admitted from its staged fact, once sealed
            assert [unit.ordinal for group in listed.page_groups(100_000, unit_rows)
                    for unit in group] == [0]
