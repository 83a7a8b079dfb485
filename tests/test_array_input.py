"""Array inputs against a real PostgreSQL: staging, seal, read, retirement, refusals, round trips."""

from __future__ import annotations


import pytest

from runplane.engine import MapScope, RunScope, array_input as A, receipts, runs
from runplane.engine.runs import outbox
from runplane.engine.errors import (
    ConflictError, CorruptFactError, InvalidInputError, RetiredError, ScopeError,
)
from runplane.engine.ports import table
from runplane.simulations.ports import CountingPort

from tests.array_input_support import facts, guard_output, occurrences, snapshot, stage, tamper_page

RUN = RunScope("org-test", "play", "run-1")
SCOPE = RUN.map("Companies", "map-1")


async def test_lifecycle_absent_staging_sealed_and_pages_read_back(tenant):
    source = occurrences(2500, identities=True)
    assert await A.get_manifest(tenant, SCOPE) == A.Manifest("absent")
    fingerprint, drafts = await stage(tenant, SCOPE, source, seal=False)
    assert await A.get_manifest(tenant, SCOPE) == A.Manifest("staging", fingerprint, 2500, True)
    await A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=2500, page_count=3)
    assert await A.get_manifest(tenant, SCOPE) == A.Manifest("sealed", fingerprint, 2500, True, 3)
    replayed = []
    for ordinal in range(3):
        page = await A.read_page(tenant, SCOPE, ordinal)
        assert page.offset == len(replayed)
        replayed.extend(page.rows)
    assert replayed == source
    # Namespaces normalize: another spelling is the same map.
    same = RUN.map("  COMPANIES ", "map-1")
    assert (await A.read_page(tenant, same, 2)).rows == tuple(source[2000:])


async def test_stored_facts_have_the_documented_shape(tenant):
    source = [A.Occurrence({"b": 2.0, "a": "x"}, A.SourceIdentity("ds", 4)), A.Occurrence({"c": None})]
    fingerprint, _ = await stage(tenant, SCOPE, source)
    async with tenant.connection("receipts") as conn:
        rows = await conn.fetch(
            f"SELECT status, run_id, epoch, output::text AS output "
            f"FROM {table(tenant, 'work_receipts')} ORDER BY k"
        )
    import json

    outputs = {json.loads(r["output"])["kind"]: json.loads(r["output"]) for r in rows}
    assert {(r["status"], r["run_id"], r["epoch"]) for r in rows} == {(2, "run-1", None)}
    assert set(outputs) == {"array_input_guard", "array_input_begin", "array_input_page",
                            "array_input_seal"}
    assert outputs["array_input_guard"] == {"kind": "array_input_guard", "retired": False}
    page = outputs["array_input_page"]
    assert set(page) == {"kind", "source_fingerprint", "ordinal", "offset", "row_count", "rows",
                         "digest"}
    assert page["rows"] == [
        {"data": {"a": "x", "b": 2}, "source_identity": {"dataset_id": "ds", "row_index": 4}},
        {"data": {"c": None}},
    ]
    assert (page["ordinal"], page["offset"], page["row_count"]) == (0, 0, 2)


async def test_begin_is_idempotent_and_a_changed_source_conflicts(tenant):
    fingerprint = A.source_fingerprint(occurrences(5))
    for _ in range(2):
        await A.begin(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=5,
                      has_source_identities=False)
    before = await snapshot(tenant)
    for changed in ({"source_fingerprint": "b" * 64, "source_rows": 5, "has_source_identities": False},
                    {"source_fingerprint": fingerprint, "source_rows": 6, "has_source_identities": False},
                    {"source_fingerprint": fingerprint, "source_rows": 5, "has_source_identities": True}):
        with pytest.raises(ConflictError):
            await A.begin(tenant, SCOPE, **changed)
    assert await snapshot(tenant) == before


async def test_a_one_page_source_is_begun_put_and_sealed_in_one_call(tenant):
    source = A.encode_source(occurrences(5, identities=True))
    call = dict(source_fingerprint=source.fingerprint, source_rows=5, page=source.page(0))
    for _ in range(2):  # idempotent as a whole: a retried request changes nothing
        manifest = await A.put_and_seal(tenant, SCOPE, **call, has_source_identities=True)
        assert manifest == A.Manifest("sealed", source.fingerprint, 5, True, 1)
    assert (await A.read_page(tenant, SCOPE, 0)).rows == tuple(occurrences(5, identities=True))
    before = await snapshot(tenant)
    with pytest.raises(ConflictError):  # the begin fact written is this source's
        await A.put_and_seal(tenant, SCOPE, **call, has_source_identities=False)
    other = RUN.map("Companies", "map-2")
    with pytest.raises(CorruptFactError):  # without the flag, the caller must have begun
        await A.put_and_seal(tenant, other, **call)
    assert await snapshot(tenant) == before
    counted = CountingPort(tenant)  # the begin, the page, the page read back, the seal
    third = RUN.map("Companies", "map-3")
    assert (await A.put_and_seal(counted, third, **call, has_source_identities=True)).state == "sealed"
    assert counted.round_trips == 4, counted.statements


async def test_put_is_write_once_and_checked_against_begin(tenant):
    source = occurrences(10)
    fingerprint, drafts = await stage(tenant, SCOPE, source, seal=False)
    before = await snapshot(tenant)
    # The identical page again: a no-op.
    await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=0, offset=0, rows=source)
    # A different page at a stored ordinal.
    with pytest.raises(ConflictError):
        await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=0, offset=0,
                         rows=occurrences(10, start=1))
    # Disagreeing with the begin fact: past the end, or another fingerprint.
    with pytest.raises(ConflictError):
        await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=1, offset=5,
                         rows=occurrences(6))
    with pytest.raises(ConflictError):
        await A.put_page(tenant, SCOPE, source_fingerprint="c" * 64, ordinal=1, offset=0,
                         rows=occurrences(1))
    assert await snapshot(tenant) == before


async def test_put_without_begin_is_refused_and_writes_nothing(tenant):
    with pytest.raises(CorruptFactError):
        await A.put_page(tenant, SCOPE, source_fingerprint="a" * 64, ordinal=0, offset=0,
                         rows=occurrences(1))
    assert await snapshot(tenant) == []


async def test_after_the_seal_puts_are_no_ops_or_conflicts(tenant):
    source = occurrences(10)
    fingerprint, _ = await stage(tenant, SCOPE, source)
    before = await snapshot(tenant)
    await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=0, offset=0, rows=source)
    with pytest.raises(ConflictError):
        await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=0, offset=0,
                         rows=occurrences(10, start=3))
    with pytest.raises(ConflictError):  # an ordinal the seal does not cover
        await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=1, offset=0,
                         rows=occurrences(2))
    assert await snapshot(tenant) == before


@pytest.mark.parametrize("batch_size", [1, 4, 8])
async def test_seal_batches_pages_per_checkout_and_reuses_a_completed_seal(tenant, batch_size):
    source = [{"i": i} for i in range(9)]
    fingerprint = A.source_fingerprint(source)
    await A.begin(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=9,
                  has_source_identities=False)
    for i in range(9):  # nine one-row pages
        await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=i, offset=i,
                         rows=source[i:i + 1])
    port = CountingPort(tenant)
    await A.seal(port, SCOPE, source_fingerprint=fingerprint, source_rows=9, page_count=9,
                 batch_size=batch_size)
    # start + ceil(9 / batch) scans + the final write
    scans = -(-9 // batch_size)
    assert port.checkout_count == 2 + scans
    assert all(stats.in_use == 0 for stats in tenant.permits().values())
    port.reset()
    await A.seal(port, SCOPE, source_fingerprint=fingerprint, source_rows=9, page_count=9,
                 batch_size=batch_size)
    assert (port.checkout_count, port.round_trips) == (1, 1)  # the proof is reused


async def test_seal_refuses_missing_pages_wrong_totals_and_identity_mismatch(tenant):
    source = occurrences(2500)
    fingerprint, drafts = await stage(tenant, SCOPE, source, seal=False)
    with pytest.raises(CorruptFactError, match="missing"):
        await A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=2500, page_count=4)
    with pytest.raises(ConflictError):
        await A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=2400, page_count=3)
    assert (await A.get_manifest(tenant, SCOPE)).state == "staging"

    short = RUN.map("companies", "map-short")  # pages that stop 100 rows short of the source
    await A.begin(tenant, short, source_fingerprint=fingerprint, source_rows=2500,
                  has_source_identities=False)
    for ordinal, offset, rows in [(0, 0, source[:1000]), (1, 1000, source[1000:2000]),
                                  (2, 2000, source[2000:2400])]:
        await A.put_page(tenant, short, source_fingerprint=fingerprint, ordinal=ordinal,
                         offset=offset, rows=rows)
    with pytest.raises(CorruptFactError, match="rows"):
        await A.seal(tenant, short, source_fingerprint=fingerprint, source_rows=2500, page_count=3)
    assert (await A.get_manifest(tenant, short)).state == "staging"

    other = RUN.map("companies", "map-identities")
    await A.begin(tenant, other, source_fingerprint=fingerprint, source_rows=2500,
                  has_source_identities=True)
    for draft in drafts:
        await A.put_page(tenant, other, source_fingerprint=fingerprint, ordinal=draft.ordinal,
                         offset=draft.offset, rows=draft.rows)
    with pytest.raises(CorruptFactError, match="identities"):
        await A.seal(tenant, other, source_fingerprint=fingerprint, source_rows=2500, page_count=3)
    assert (await A.get_manifest(tenant, other)).state == "staging"


async def test_empty_source_seals_with_no_pages(tenant):
    fingerprint, drafts = await stage(tenant, SCOPE, [])
    assert drafts == []
    assert await A.get_manifest(tenant, SCOPE) == A.Manifest("sealed", fingerprint, 0, False, 0)
    with pytest.raises(ConflictError):
        await A.read_page(tenant, SCOPE, 0)


async def test_read_page_requires_the_seal_and_a_sealed_ordinal(tenant):
    fingerprint, _ = await stage(tenant, SCOPE, occurrences(3), seal=False)
    with pytest.raises(ConflictError, match="not sealed"):
        await A.read_page(tenant, SCOPE, 0)
    await A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=3, page_count=1)
    with pytest.raises(ConflictError):
        await A.read_page(tenant, SCOPE, 1)


async def test_a_tampered_page_is_caught_by_seal(tenant):
    source = occurrences(2500)
    fingerprint, _ = await stage(tenant, SCOPE, source, seal=False)
    await tamper_page(tenant, SCOPE, 1,
                      "jsonb_set(output, '{rows,5,data,name}', '\"forged\"'::jsonb)")
    with pytest.raises(CorruptFactError, match="digest"):
        await A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=2500, page_count=3)
    assert (await A.get_manifest(tenant, SCOPE)).state == "staging"


@pytest.mark.parametrize("expression", [
    "jsonb_set(output, '{rows,0,data,i}', '999'::jsonb)",            # payload changed
    "jsonb_set(output, '{offset}', '1'::jsonb)",                       # header changed
    "output - 'digest'",                                              # field removed
    "jsonb_set(output, '{rows,0}', '{\"data\": 5}'::jsonb)",          # row shape broken
])
async def test_a_tampered_sealed_page_is_caught_by_read_page(tenant, expression):
    source = occurrences(1500)
    await stage(tenant, SCOPE, source)
    await tamper_page(tenant, SCOPE, 0, expression)
    with pytest.raises(CorruptFactError):
        await A.read_page(tenant, SCOPE, 0)
    assert (await A.read_page(tenant, SCOPE, 1)).rows == tuple(source[1000:])


async def test_retirement_is_bounded_keeps_the_guard_and_touches_nothing_else(tenant):
    # 1 begin + 300 one-row pages + 1 seal = 302 facts, plus the guard.
    source = [{"i": i} for i in range(300)]
    fingerprint = A.source_fingerprint(source)
    await A.begin(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=300,
                  has_source_identities=False)
    for i in range(300):
        await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=i, offset=i,
                         rows=source[i:i + 1])
    await A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=300, page_count=300,
                 batch_size=8)
    # Neighbours that must survive: another run of the same play, and a user receipt.
    neighbour = RunScope("org-test", "play", "run-10").map("companies", "map-1")
    await stage(tenant, neighbour, occurrences(3))
    ref = await runs.register(tenant, RUN)
    await receipts.complete(tenant, ref, "user-key", {"ok": True})
    assert len(await facts(tenant, "run-1")) == 302 + 2  # + the guard and the user receipt

    results = []
    while not results or not results[-1].done:
        results.append(await A.retire(tenant, RUN))
    assert results == [A.RetireResult(False, 128), A.RetireResult(False, 128),
                       A.RetireResult(True, 46)]
    assert sorted(kind for kind, _ in await facts(tenant, "run-1")) == ["array_input_guard", "receipt"]
    assert await guard_output(tenant, SCOPE) == {"kind": "array_input_guard", "retired": True}
    assert len(await facts(tenant, "run-10")) == 4
    assert (await receipts.get(tenant, RUN.play_scope, "user-key")).output == {"ok": True}
    assert await A.retire(tenant, RUN) == A.RetireResult(True, 0)


async def test_after_retirement_every_call_is_refused_and_nothing_regrows(tenant):
    source = occurrences(5)
    fingerprint, _ = await stage(tenant, SCOPE, source)
    assert await A.retire(tenant, RUN) == A.RetireResult(True, 3)
    before = await snapshot(tenant)
    calls = [
        A.get_manifest(tenant, SCOPE),
        A.begin(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=5,
                has_source_identities=False),
        A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=0, offset=0, rows=source),
        A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=5, page_count=1),
        A.read_page(tenant, SCOPE, 0),
        A.get_manifest(tenant, RUN.map("other", "map-2")),
        A.begin(tenant, RUN.map("other", "map-2"), source_fingerprint=fingerprint, source_rows=5,
                has_source_identities=False),
    ]
    for call in calls:
        with pytest.raises(RetiredError):
            await call
    assert await snapshot(tenant) == before


async def test_retiring_a_run_that_never_staged_fences_it(tenant):
    assert await A.retire(tenant, RUN) == A.RetireResult(True, 0)
    assert await guard_output(tenant, SCOPE) == {"kind": "array_input_guard", "retired": True}
    with pytest.raises(RetiredError):
        await A.begin(tenant, SCOPE, source_fingerprint="a" * 64, source_rows=1,
                      has_source_identities=False)
    assert [kind for kind, _ in await facts(tenant)] == ["array_input_guard"]


async def test_round_trips_of_begin_put_and_retire(tenant):
    port = CountingPort(tenant)
    source = occurrences(1200)
    fingerprint = A.source_fingerprint(source)
    drafts = A.paginate(source)
    calls = {
        "begin": lambda: A.begin(port, SCOPE, source_fingerprint=fingerprint, source_rows=1200,
                                 has_source_identities=False),
        "put": lambda: A.put_page(port, SCOPE, source_fingerprint=fingerprint, ordinal=0,
                                  offset=0, rows=drafts[0].rows),
    }
    for name, call in [*calls.items(), *calls.items()]:  # first write, then the replay
        port.reset()
        await call()
        assert port.round_trips <= 3, (name, port.statements)
    await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=1, offset=1000,
                     rows=drafts[1].rows)
    for _ in range(2):
        port.reset()
        await A.retire(port, RUN)
        assert port.round_trips <= 3, port.statements


async def test_a_plain_retirement_builds_no_settlement(tenant, monkeypatch):
    """`retire` (no owner) never settles an outbox entry, so it never builds the settle text."""
    def refuse(*_):
        raise AssertionError("retire built an outbox settlement")

    monkeypatch.setattr(outbox, "settle_done_sql", refuse)
    await stage(tenant, SCOPE, occurrences(10))
    assert await A.retire(tenant, RUN) == A.RetireResult(True, 3, False)


async def test_a_runs_retirement_records_retires_and_settles_on_one_checkout(tenant):
    """`retire_entry` with its lease recorded: the pending mark, the batch and its second look
    on one connection checkout, the entry settled done in the second look's statement (three
    statements); a run that never staged settles after its one batch statement."""
    port = CountingPort(tenant)
    await runs.register(tenant, RUN)
    await stage(tenant, SCOPE, occurrences(1200))
    port.reset()
    result = await A.retire_entry(port, RUN, "closer", record_lease_s=30.0)
    assert result == A.RetireResult(True, 4, True)  # begin, two pages, seal
    assert (port.checkout_count, port.round_trips) == (1, 3), port.statements
    assert await outbox.get(tenant, RUN) == outbox.OutboxEntry(RUN, "done", 0, None)
    assert await A.retire_entry(port, RUN, "closer", record_lease_s=30.0) == \
        A.RetireResult(True, 0, True)  # done already: nothing deleted, settled
    never = RunScope(RUN.org_id, RUN.play, "run-never-staged")
    port.reset()
    assert await A.retire_entry(port, never, "closer", record_lease_s=30.0) == \
        A.RetireResult(True, 0, True)
    assert (port.checkout_count, port.round_trips) == (1, 3), port.statements
    assert (await outbox.get(tenant, never)).state == "done"
    # A lease held by someone else: retired, not settled.
    other = RunScope(RUN.org_id, RUN.play, "run-2")
    await stage(tenant, other.map("Companies", "map-1"), occurrences(10))
    assert await outbox.mark_pending(tenant, other, "someone-else", 30.0)
    assert await A.retire_entry(tenant, other, "closer") == A.RetireResult(True, 3, False)
    assert (await outbox.get(tenant, other)).state == "pending"


BAD_FP = "A" * 64


def _bad_calls(port):
    good_rows = occurrences(2)
    fp = "a" * 64
    other_org = MapScope("org-other", "play", "run-1", "companies", "map-1")
    return [
        (ScopeError, A.get_manifest(port, other_org)),
        (ScopeError, A.begin(port, other_org, source_fingerprint=fp, source_rows=1,
                             has_source_identities=False)),
        (ScopeError, A.retire(port, RunScope("org-other", "play", "run-1"))),
        (ScopeError, A.retire(port, SCOPE)),
        (ScopeError, A.read_page(port, RUN, 0)),
        (InvalidInputError, A.begin(port, SCOPE, source_fingerprint=BAD_FP, source_rows=1,
                                    has_source_identities=False)),
        (InvalidInputError, A.begin(port, SCOPE, source_fingerprint=fp[:-1], source_rows=1,
                                    has_source_identities=False)),
        (InvalidInputError, A.begin(port, SCOPE, source_fingerprint=fp, source_rows=-1,
                                    has_source_identities=False)),
        (InvalidInputError, A.begin(port, SCOPE, source_fingerprint=fp, source_rows=2**53,
                                    has_source_identities=False)),
        (InvalidInputError, A.begin(port, SCOPE, source_fingerprint=fp, source_rows=1.0,
                                    has_source_identities=False)),
        (InvalidInputError, A.begin(port, SCOPE, source_fingerprint=fp, source_rows=1,
                                    has_source_identities=1)),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=-1, offset=0,
                                       rows=good_rows)),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=0, offset=2**53,
                                       rows=good_rows)),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=True, offset=0,
                                       rows=good_rows)),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=0, offset=0,
                                       rows=[])),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=0, offset=0,
                                       rows=[{"i": i} for i in range(1001)])),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=0, offset=0,
                                       rows=[{"big": "x" * A.MAX_PAGE_BYTES}])),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=0, offset=0,
                                       rows=[["not", "an", "object"]])),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=0, offset=0,
                                       rows=[{"x": float("inf")}])),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=BAD_FP, ordinal=0,
                                       offset=0, rows=good_rows)),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=0, offset=0,
                                       rows=[{"a": {1: "non-string key"}}])),
        (InvalidInputError, A.put_page(port, SCOPE, source_fingerprint=fp, ordinal=0, offset=0,
                                       rows="not a list")),
        (InvalidInputError, A.seal(port, SCOPE, source_fingerprint=fp, source_rows=5,
                                   page_count=6)),
        (InvalidInputError, A.seal(port, SCOPE, source_fingerprint=fp, source_rows=2001,
                                   page_count=2)),
        (InvalidInputError, A.seal(port, SCOPE, source_fingerprint=fp, source_rows=5,
                                   page_count=1, batch_size=3)),
        (InvalidInputError, A.seal(port, SCOPE, source_fingerprint=BAD_FP, source_rows=5,
                                   page_count=1)),
        (InvalidInputError, A.read_page(port, SCOPE, -1)),
    ]


async def test_bad_input_is_refused_before_any_query_and_writes_nothing(tenant):
    fingerprint, _ = await stage(tenant, RUN.map("other", "map-9"), occurrences(3))
    before = await snapshot(tenant)
    port = CountingPort(tenant)
    for error, call in _bad_calls(port):
        with pytest.raises(error):
            await call
    assert (port.checkout_count, port.round_trips) == (0, 0)
    assert await snapshot(tenant) == before


def test_corrupt_source_identities_are_refused_at_construction():
    for dataset_id, row_index in [("", 0), (None, 0), ("d", -1), ("d", "3"), ("d", 2**53)]:
        with pytest.raises(InvalidInputError):
            A.SourceIdentity(dataset_id, row_index)
    with pytest.raises(InvalidInputError):
        A.Occurrence({"a": 1}, {"dataset_id": "d"})


async def test_under_an_execution_role_everything_works_within_the_round_trip_budget(role_tenant):
    assert role_tenant.outer_transaction
    port = CountingPort(role_tenant)
    source = occurrences(1500, identities=True)
    fingerprint = A.source_fingerprint(source)
    drafts = A.paginate(source)
    port.reset()
    await A.begin(port, SCOPE, source_fingerprint=fingerprint, source_rows=1500,
                  has_source_identities=True)
    assert port.round_trips <= 5
    for draft in drafts:
        port.reset()
        await A.put_page(port, SCOPE, source_fingerprint=fingerprint,
                         ordinal=draft.ordinal, offset=draft.offset, rows=draft.rows)
        assert port.round_trips <= 5
    await A.seal(port, SCOPE, source_fingerprint=fingerprint, source_rows=1500,
                 page_count=2, batch_size=1)
    assert (await A.read_page(port, SCOPE, 1)).rows == tuple(source[1000:])
    port.reset()
    assert await A.retire(port, RUN) == A.RetireResult(True, 4)
    assert port.round_trips <= 5
    with pytest.raises(RetiredError):
        await A.read_page(port, SCOPE, 0)


@pytest.mark.parametrize("guard", [
    '{"kind": "array_input_guard", "retired": "no"}',
    '{"kind": "array_input_seal", "retired": false}',
    '{"kind": "array_input_guard"}',
])
async def test_a_malformed_guard_is_a_corrupt_fact_and_nothing_is_written(tenant, guard):
    from runplane.engine.array_input.facts import guard_key

    source = occurrences(3)
    fingerprint, _ = await stage(tenant, SCOPE, source, seal=False)
    async with tenant.connection("receipts") as conn:
        await conn.execute(f"UPDATE {table(tenant, 'work_receipts')} SET output = $2::jsonb "
                           "WHERE k = $1", guard_key(SCOPE), guard)
    before = await snapshot(tenant)
    calls = [
        A.get_manifest(tenant, SCOPE),
        A.begin(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=3,
                has_source_identities=False),
        A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=0, offset=0, rows=source),
        A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=3, page_count=1),
        A.read_page(tenant, SCOPE, 0),
        A.retire(tenant, RUN),
    ]
    for call in calls:
        with pytest.raises(CorruptFactError):
            await call
    assert await snapshot(tenant) == before


async def test_a_malformed_begin_fact_is_a_corrupt_fact(tenant):
    from runplane.engine.array_input.facts import begin_key

    fingerprint, _ = await stage(tenant, SCOPE, occurrences(3), seal=False)
    async with tenant.connection("receipts") as conn:
        await conn.execute(f"UPDATE {table(tenant, 'work_receipts')} "
                           "SET output = output || '{\"source_rows\": \"3\"}'::jsonb WHERE k = $1",
                           begin_key(SCOPE))
    with pytest.raises(CorruptFactError):
        await A.get_manifest(tenant, SCOPE)
    with pytest.raises(CorruptFactError):
        await A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=3, page_count=1)
