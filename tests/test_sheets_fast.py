"""Fast admission: cache hits as a count, probing by keys, admitting from a sealed page fact."""

from __future__ import annotations

import pytest

from runplane.engine import MapScope, array_input
from runplane.engine.array_input.pages import encode_page
from runplane.engine.errors import ConflictError, CorruptFactError, InvalidInputError, RetiredError
from runplane.engine.sheets import (
    CellPolicy,
    RowOutcome,
    SheetContract,
    StagedPage,
    admit,
    complete,
    probe,
)
from runplane.engine.sheets.admission import AdmitBatch, admit_write
from runplane.engine.sheets.sheet_write import SheetWrite
from runplane.simulations import fast_admission
from runplane.simulations.ports import CountingPort

from .array_input_support import stage, tamper_page
from .gateway_support import gateway, server  # noqa: F401  (fixtures)
from .sheet_helpers import PLAY, counters_match, new_run, play_scope, raw_rows

CONTRACT = SheetContract(inputs=("name",), outputs=("score",))
NS = "companies"


def rows(n: int, tag: str = "r") -> list[dict]:
    return [{"name": f"{tag}{i}"} for i in range(n)]


async def finished_sheet(tenant, n: int):
    """A sheet of `n` rows all enriched by run r1; returns r1."""
    first = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, first, NS, CONTRACT, rows(n))
    await complete(tenant, first, NS, CONTRACT,
                   [RowOutcome(r.key, "completed", {"score": i}) for i, r in enumerate(admission.pending)])
    return first


async def test_count_mode_counts_cache_hits_and_lists_the_rest(tenant):
    await finished_sheet(tenant, 5)
    second = await new_run(tenant, PLAY, "r2")
    source = rows(7)  # five finished rows, two new ones
    listed = await admit(tenant, second, NS, CONTRACT, source)
    counted = await admit(tenant, second, NS, CONTRACT, source, cache_hits="count")
    assert listed.cached == len(listed.completed) == 5
    assert counted.cached == 5 and counted.completed == ()
    assert [(r.key, r.input_index, r.row) for r in counted.pending] == [
        (r.key, r.input_index, r.row) for r in listed.pending
    ]
    assert [r.row["name"] for r in counted.pending] == ["r5", "r6"]
    with pytest.raises(InvalidInputError, match="cache_hits"):
        await admit(tenant, second, NS, CONTRACT, source, cache_hits="none")


async def test_probe_settles_a_finished_page_in_one_statement_and_writes_nothing(tenant):
    await finished_sheet(tenant, 50)
    second = await new_run(tenant, PLAY, "r2")
    before = await raw_rows(tenant, play_scope(tenant), NS, ["name", "score"])
    port = CountingPort(tenant)
    settled = await probe(port, second, NS, CONTRACT, rows(50) + rows(3))
    assert port.round_trips == 1
    assert (settled.cached, settled.skipped, settled.inserted) == (50, 3, 0)
    assert settled.pending == () and settled.completed == () and settled.blocked == ()
    assert await raw_rows(tenant, play_scope(tenant), NS, ["name", "score"]) == before


async def test_probe_answers_none_when_a_row_needs_admitting(tenant):
    await finished_sheet(tenant, 3)
    second = await new_run(tenant, PLAY, "r2")
    assert await probe(tenant, second, NS, CONTRACT, rows(4)) is None  # a new row
    stale = {"score": CellPolicy(0)}
    assert await probe(tenant, second, NS, CONTRACT, rows(3), cell_policies=stale) is None
    assert await probe(tenant, second, "no such sheet", CONTRACT, rows(1)) is None
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


async def test_probe_reports_rows_blocked_by_a_newer_run(tenant):
    old = await new_run(tenant, PLAY, "old")
    new = await new_run(tenant, PLAY, "new")
    await admit(tenant, new, NS, CONTRACT, rows(2))
    settled = await probe(tenant, old, NS, CONTRACT, rows(2), input_offset=4)
    assert [(b.input_index, b.reason) for b in settled.blocked] == [(4, "newer_run"), (5, "newer_run")]


async def staged_page(tenant, run, source, map_id="map-0"):
    scope = MapScope(tenant.org_id, PLAY, run.run_id, NS, map_id)
    fingerprint, drafts = await stage(tenant, scope, [array_input.Occurrence(r) for r in source])
    (draft,) = drafts
    digest = encode_page(fingerprint, 0, draft.offset, draft.rows).digest
    return scope, StagedPage(scope, 0, digest)


async def _admit_expecting_new(port, run, source):
    write = SheetWrite(run, NS, CONTRACT, cache_hits="count")
    return await admit_write(port, write, AdmitBatch(source, expect_new=True))


async def test_rows_expected_new_are_inserted_without_on_conflict(tenant):
    first = await new_run(tenant, PLAY, "r1")
    await admit(tenant, first, NS, CONTRACT, rows(1, "seed"))  # the sheet exists
    port = CountingPort(tenant)
    admission = await _admit_expecting_new(port, first, rows(5))
    inserts = [sql for sql in port.statements if "INSERT INTO" in sql and "_input_index" in sql]
    assert len(inserts) == 1 and "ON CONFLICT (_key) DO NOTHING" not in inserts[0]
    assert (admission.inserted, len(admission.pending), admission.cached) == (5, 5, 0)
    assert (await counters_match(tenant, play_scope(tenant), NS))[0]


async def test_a_row_expected_new_that_is_there_is_admitted_as_always(tenant):
    """The insert without `ON CONFLICT` meets an existing row: its transaction rolls back on
    the unique violation and the batch is admitted again the ordinary way, so the outcome,
    the sheet and its counters are what an ordinary admission leaves."""
    await finished_sheet(tenant, 3)  # r0..r2 enriched by r1
    second = await new_run(tenant, PLAY, "r2")
    port = CountingPort(tenant)
    admission = await _admit_expecting_new(port, second, rows(5))  # r0..r2 there, r3, r4 new
    inserts = [sql for sql in port.statements if "INSERT INTO" in sql and "_input_index" in sql]
    assert ["ON CONFLICT (_key) DO NOTHING" in sql for sql in inserts] == [False, True]
    assert (admission.inserted, admission.cached) == (2, 3)
    assert [row.row["name"] for row in admission.pending] == ["r3", "r4"]
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["name"])
    assert sorted(row["name"] for row in stored.values()) == [f"r{i}" for i in range(5)]
    assert (await counters_match(tenant, play_scope(tenant), NS))[0]


async def test_admission_from_a_staged_page_reads_inputs_from_the_fact(tenant):
    await finished_sheet(tenant, 2)
    run = await new_run(tenant, PLAY, "r2")
    source = rows(4) + rows(1)  # two cached, two new, one duplicate
    scope, page = await staged_page(tenant, run, source)
    admission = await admit(tenant, run, NS, CONTRACT, source, staged_page=page, cache_hits="count")
    assert (admission.inserted, admission.cached, admission.skipped) == (2, 2, 1)
    assert [(r.row["name"], r.input_index) for r in admission.pending] == [("r2", 2), ("r3", 3)]
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["name"])
    assert sorted(row["name"] for row in stored.values()) == ["r0", "r1", "r2", "r3"]
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


async def test_staged_input_cells_come_from_the_stored_page_not_the_call(tenant):
    run = await new_run(tenant, PLAY, "r1")
    scope, page = await staged_page(tenant, run, rows(2))
    keys = ["k0", "k1"]
    admission = await admit(tenant, run, NS, CONTRACT, rows(2, tag="sent"), keys=keys,
                            staged_page=page)
    assert [r.row["name"] for r in admission.pending] == ["sent0", "sent1"]
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["name"])
    assert {key: row["name"] for key, row in stored.items()} == {"k0": "r0", "k1": "r1"}


async def test_a_staged_page_that_does_not_match_writes_nothing(tenant):
    run = await new_run(tenant, PLAY, "r1")
    source = rows(3)
    scope, page = await staged_page(tenant, run, source)
    wrong_digest = StagedPage(scope, 0, "0" * 64)
    with pytest.raises(CorruptFactError):
        await admit(tenant, run, NS, CONTRACT, source, staged_page=wrong_digest)
    with pytest.raises(CorruptFactError):  # the page's row count differs
        await admit(tenant, run, NS, CONTRACT, source[:2], staged_page=page)
    await tamper_page(tenant, scope, 0, "jsonb_set(output, '{digest}', '\"x\"')")
    with pytest.raises(CorruptFactError):
        await admit(tenant, run, NS, CONTRACT, source, staged_page=page)
    assert await raw_rows(tenant, play_scope(tenant), NS) == {}


async def test_an_unsealed_or_retired_page_is_refused(tenant):
    run = await new_run(tenant, PLAY, "r1")
    source = rows(3)
    scope = MapScope(tenant.org_id, PLAY, run.run_id, NS, "m")
    fingerprint, drafts = await stage(tenant, scope, [array_input.Occurrence(r) for r in source],
                                      seal=False)
    page = StagedPage(scope, 0, encode_page(fingerprint, 0, 0, drafts[0].rows).digest)
    with pytest.raises(ConflictError, match="not sealed"):
        await admit(tenant, run, NS, CONTRACT, source, staged_page=page)
    await array_input.seal(tenant, scope, source_fingerprint=fingerprint, source_rows=3,
                           page_count=1)
    while not (await array_input.retire(tenant, run.scope)).done:
        pass
    with pytest.raises(RetiredError):
        await admit(tenant, run, NS, CONTRACT, source, staged_page=page)
    assert await raw_rows(tenant, play_scope(tenant), NS) == {}


async def test_a_staged_page_of_another_run_is_refused_before_any_query(tenant):
    run = await new_run(tenant, PLAY, "r1")
    other = await new_run(tenant, PLAY, "r2")
    scope, page = await staged_page(tenant, other, rows(2))
    port = CountingPort(tenant)
    with pytest.raises(InvalidInputError, match="admitting run"):
        await admit(port, run, NS, CONTRACT, rows(2), staged_page=page)
    with pytest.raises(InvalidInputError):
        StagedPage(scope, 0, "not a digest")
    assert port.round_trips == 0


def test_fast_admission_property_ci_sized(dsn):
    report = fast_admission.run(examples=12, seed=20260601, dsn=dsn)
    assert report.examples == 12
    assert report.ok, "\n".join(report.violations[:5])


async def test_fast_admission_through_the_gateway_answers_as_direct(tenant, gateway):
    await finished_sheet(tenant, 4)
    run = await new_run(tenant, PLAY, "r2")
    view = lambda a: (a.inserted, a.skipped, a.cached, a.completed,  # noqa: E731
                      [(r.key, r.input_index, r.row) for r in a.pending], a.blocked)
    settled = await probe(gateway, run, NS, CONTRACT, rows(4))
    assert settled is not None and view(settled) == view(await probe(tenant, run, NS, CONTRACT, rows(4)))
    assert await probe(gateway, run, NS, CONTRACT, rows(5)) is None
    counted = await admit(gateway, run, NS, CONTRACT, rows(3), cache_hits="count")
    assert (counted.cached, counted.completed, counted.pending) == (3, (), ())
    source = rows(6)
    scope, page = await staged_page(tenant, run, source)
    staged = await admit(gateway, run, NS, CONTRACT, source, staged_page=page, cache_hits="count")
    assert (staged.inserted, staged.cached) == (2, 4)
    assert [(r.row["name"], r.input_index) for r in staged.pending] == [("r4", 4), ("r5", 5)]
