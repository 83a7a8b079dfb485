"""Sheets against a real server: admission dispositions, fenced completion, counters."""

from __future__ import annotations

import pytest
import trio

from runplane.engine.sheets import (
    Attempt,
    CellPolicy,
    RowOutcome,
    SheetContract,
    admit,
    complete,
    ensure_sheet,
    read_rows,
    row_key,
    summaries,
    summary,
)
from tests.sheet_helpers import PLAY, counters_match, new_run, play_scope, raw_rows

CONTRACT = SheetContract(inputs=("name",), outputs=("score", "tag"))


@pytest.fixture(autouse=True, params=["returning_old", "snapshot_join"])
def completion_path(request, monkeypatch):
    """Run every test on both exact-key statements: PostgreSQL >= 18 `RETURNING old` and the
    snapshot join used on older servers."""
    from runplane.engine.sheets import completion

    if request.param == "snapshot_join":
        monkeypatch.setattr(completion, "RETURNING_OLD_SINCE", 10**9)
    return request.param


NS = "Companies"


def done(key: str, score=1, tag="t", **extra) -> RowOutcome:
    return RowOutcome(key, "completed", {"score": score, "tag": tag, **extra})


async def assert_counters(tenant, namespace=NS):
    ok, detail = await counters_match(tenant, play_scope(tenant), namespace)
    assert ok, detail


async def test_ensure_sheet_is_idempotent_and_counts_zero(tenant):
    await ensure_sheet(tenant, play_scope(tenant), NS, CONTRACT)
    await ensure_sheet(tenant, play_scope(tenant), "companies", CONTRACT)
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.total, s.queued, s.running, s.completed, s.failed) == (0, 0, 0, 0, 0)
    assert set(s.columns) == {"score", "tag"}
    assert await read_rows(tenant, play_scope(tenant), NS) == []


async def test_summaries_read_every_sheet_of_the_play_as_summary_does(tenant):
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    a, b = (r.key for r in admission.pending)
    await complete(tenant, run, NS, CONTRACT, [done(a), RowOutcome(b, "failed", error="boom")])
    await admit(tenant, run, "people", CONTRACT, [{"name": "c"}])
    await ensure_sheet(tenant, play_scope(tenant, "other"), "elsewhere", CONTRACT)
    found = await summaries(tenant, play_scope(tenant))
    assert list(found) == ["companies", "people"]
    assert found == {ns: await summary(tenant, play_scope(tenant), ns) for ns in found}
    assert (found["companies"].completed, found["companies"].failed) == (1, 1)
    assert found["companies"].columns["score"].completed == 1
    assert await summaries(tenant, play_scope(tenant, "nothing")) == {}


async def test_admit_inserts_dedups_and_indexes(tenant):
    run = await new_run(tenant, PLAY, "r1")
    rows = [{"name": "a"}, {"name": "b"}, {"name": "a"}, {"name": "c"}]
    admission = await admit(tenant, run, NS, CONTRACT, rows, input_offset=10)
    assert admission.inserted == 3
    assert admission.skipped == 1
    assert admission.write_version == run.epoch
    assert [(r.row["name"], r.input_index) for r in admission.pending] == [
        ("a", 10), ("b", 11), ("c", 13)
    ]
    assert admission.pending[0].key == row_key({"name": "a"}, NS)
    assert admission.completed == () and admission.blocked == ()
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["name"])
    assert {row["name"]: row["_status"] for row in stored.values()} == {
        "a": "pending", "b": "pending", "c": "pending"
    }
    await assert_counters(tenant)


async def test_rerun_returns_cache_hits_merged_with_stored_outputs(tenant):
    first = await new_run(tenant, PLAY, "r1")
    rows = [{"name": "a", "extra": 1}, {"name": "b"}, {"name": "c"}]
    admission = await admit(tenant, first, NS, CONTRACT, rows)
    a, b, c = (r.key for r in admission.pending)
    await complete(tenant, first, NS, CONTRACT, [
        done(a, 7, "x"),
        RowOutcome(b, "failed", {"score": 3}, error="boom"),
        RowOutcome(c, "completed", {"score": 9, "tag": ""}),  # an empty output is no cache hit
    ])
    second = await new_run(tenant, PLAY, "r2")
    rerun = await admit(tenant, second, NS, CONTRACT, rows)
    assert [(r.key, r.row) for r in rerun.completed] == [
        (a, {"name": "a", "extra": 1, "score": 7, "tag": "x"})
    ]
    assert [r.key for r in rerun.pending] == [b, c]
    assert rerun.inserted == 0
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["score"])
    assert stored[a]["_run_id"] == "r1" and stored[a]["_write_version"] == first.epoch
    assert stored[b]["_status"] == "pending" and stored[b]["_write_version"] == second.epoch
    assert stored[b]["score"] == 3 and stored[b]["_error"] is None  # completed cells kept
    await assert_counters(tenant)


async def test_stale_run_late_completion_is_fenced_and_changes_nothing(tenant):
    old = await new_run(tenant, PLAY, "old")
    admission = await admit(tenant, old, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    a, b = (r.key for r in admission.pending)
    new = await new_run(tenant, PLAY, "new")
    await admit(tenant, new, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    await complete(tenant, new, NS, CONTRACT, [done(a, 100, "new")])
    before = await raw_rows(tenant, play_scope(tenant), NS, ["score", "tag"])
    counters_before = await summary(tenant, play_scope(tenant), NS)

    late = await complete(tenant, old, NS, CONTRACT, [
        done(a, 1, "old"), RowOutcome(b, "failed", error="late"),
    ])
    assert late.updated == 0
    assert late.committed_keys == ()
    assert [(f.key, f.reason, f.row_write_version) for f in late.fenced] == [
        (a, "stale_write_version", new.epoch), (b, "stale_write_version", new.epoch),
    ]
    assert await raw_rows(tenant, play_scope(tenant), NS, ["score", "tag"]) == before
    assert await summary(tenant, play_scope(tenant), NS) == counters_before
    await assert_counters(tenant)


async def test_newer_run_blocks_older_admission(tenant):
    old = await new_run(tenant, PLAY, "old")
    new = await new_run(tenant, PLAY, "new")
    await admit(tenant, new, NS, CONTRACT, [{"name": "a"}])
    blocked = await admit(tenant, old, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    assert [(r.row, r.input_index) for r in blocked.pending] == [({"name": "b"}, 1)]
    assert [(r.key, r.input_index, r.reason) for r in blocked.blocked] == [
        (row_key({"name": "a"}, NS), 0, "newer_run")
    ]
    # The older run's completion of a row it never admitted is fenced as unadmitted... by
    # version: the row belongs to the newer run.
    fenced = await complete(tenant, old, NS, CONTRACT, [done(row_key({"name": "a"}, NS))])
    assert fenced.fenced[0].reason == "stale_write_version"
    await assert_counters(tenant)


async def test_older_version_row_is_unadmitted_for_newer_run_until_admitted(tenant):
    old = await new_run(tenant, PLAY, "old")
    admission = await admit(tenant, old, NS, CONTRACT, [{"name": "a"}])
    key = admission.pending[0].key
    new = await new_run(tenant, PLAY, "new")
    result = await complete(tenant, new, NS, CONTRACT, [done(key)])
    assert [(f.reason, f.row_write_version) for f in result.fenced] == [("unadmitted", old.epoch)]
    readmitted = await admit(tenant, new, NS, CONTRACT, [{"name": "a"}])
    assert [r.key for r in readmitted.pending] == [key] and readmitted.inserted == 0
    result = await complete(tenant, new, NS, CONTRACT, [done(key)])
    assert result.committed_keys == (key,) and result.updated == 1
    await assert_counters(tenant)


async def test_attempt_lease_taken_over_is_fenced_attempt_superseded(tenant):
    run = await new_run(tenant, PLAY, "r1")
    first = Attempt("attempt-1", 1, lease_s=0.0)  # admitted already expired
    second = Attempt("attempt-2", 2)
    admitted = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}], attempt=first)
    key = admitted.pending[0].key
    stored = await raw_rows(tenant, play_scope(tenant), NS)
    assert stored[key]["_status"] == "running" and stored[key]["_attempt_id"] == "attempt-1"

    taken = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}], attempt=second)
    assert [r.key for r in taken.pending] == [key]
    before = await raw_rows(tenant, play_scope(tenant), NS, ["score"])
    late = await complete(tenant, run, NS, CONTRACT, [done(key)], attempt=first)
    assert [(f.key, f.reason, f.row_write_version) for f in late.fenced] == [
        (key, "attempt_superseded", run.epoch)
    ]
    assert late.updated == 0
    assert await raw_rows(tenant, play_scope(tenant), NS, ["score"]) == before

    # A third attempt cannot take the row while the second one's lease runs.
    third = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}], attempt=Attempt("attempt-3", 3))
    assert [(r.key, r.reason) for r in third.blocked] == [(key, "attempt_active")]
    ok = await complete(tenant, run, NS, CONTRACT, [done(key)], attempt=second)
    assert ok.committed_keys == (key,)
    await assert_counters(tenant)


async def test_own_expired_lease_still_counts_as_ours(tenant):
    run = await new_run(tenant, PLAY, "r1")
    mine = Attempt("mine", 1, lease_s=0.0)
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}], attempt=mine)).pending[0].key
    result = await complete(tenant, run, NS, CONTRACT, [done(key)], attempt=mine)
    assert result.committed_keys == (key,) and result.fenced == ()


async def test_failed_outcome_for_enriched_row_is_already_completed(tenant):
    run = await new_run(tenant, PLAY, "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    await complete(tenant, run, NS, CONTRACT, [done(key)])
    result = await complete(tenant, run, NS, CONTRACT, [RowOutcome(key, "failed", error="x")])
    assert [(f.key, f.reason) for f in result.fenced] == [(key, "already_completed")]
    await assert_counters(tenant)


async def test_missing_rows_repair_by_input_index_insert_or_fence(tenant):
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    b = admission.pending[1].key
    result = await complete(tenant, run, NS, CONTRACT, [
        RowOutcome("renamed-a", "completed", {"score": 5, "tag": "r"}, input_index=0),
        RowOutcome("brand-new", "completed", {"score": 6, "tag": "n"}, input_index=99),
        RowOutcome("ghost", "failed", error="never admitted"),
        done(b),
    ])
    assert set(result.committed_keys) == {"renamed-a", "brand-new", b}
    assert [(f.key, f.reason, f.row_write_version) for f in result.fenced] == [
        ("ghost", "missing", None)
    ]
    assert result.updated == 3
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["score"])
    assert stored[admission.pending[0].key]["score"] == 5  # repaired in place
    assert stored["brand-new"]["_status"] == "enriched"
    assert stored["brand-new"]["_input_index"] == 99
    assert "renamed-a" not in stored and "ghost" not in stored
    await assert_counters(tenant)


async def test_identical_replay_is_committed_without_physical_change(tenant):
    run = await new_run(tenant, PLAY, "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    first = await complete(tenant, run, NS, CONTRACT, [done(key, 3, "z")])
    assert first.updated == 1
    before = await raw_rows(tenant, play_scope(tenant), NS, ["score", "tag"])
    replay = await complete(tenant, run, NS, CONTRACT, [done(key, 3, "z")])
    assert replay.updated == 0 and replay.committed_keys == (key,) and replay.fenced == ()
    assert await raw_rows(tenant, play_scope(tenant), NS, ["score", "tag"]) == before
    failed_key = (await admit(tenant, run, NS, CONTRACT, [{"name": "b"}])).pending[0].key
    await complete(tenant, run, NS, CONTRACT, [RowOutcome(failed_key, "failed", error="e")])
    before = await raw_rows(tenant, play_scope(tenant), NS)
    again = await complete(tenant, run, NS, CONTRACT, [RowOutcome(failed_key, "failed", error="e")])
    assert again.updated == 0 and again.committed_keys == (failed_key,)
    assert await raw_rows(tenant, play_scope(tenant), NS) == before


async def test_duplicate_outcomes_last_wins(tenant):
    run = await new_run(tenant, PLAY, "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    result = await complete(tenant, run, NS, CONTRACT, [
        done(key, 1), RowOutcome(key, "failed", error="x"), done(key, 2, "last"),
    ])
    assert result.committed_keys == (key,)
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["score", "tag"])
    assert (stored[key]["score"], stored[key]["tag"], stored[key]["_status"]) == (2, "last", "enriched")


async def test_cell_meta_and_failed_cells_and_error_default(tenant):
    run = await new_run(tenant, PLAY, "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    await complete(tenant, run, NS, CONTRACT, [
        RowOutcome(key, "failed", {"score": 4}, cell_meta={"tag": {"status": "failed"}}, error="  ")
    ])
    stored = (await raw_rows(tenant, play_scope(tenant), NS, ["score"]))[key]
    assert stored["_status"] == "failed" and stored["_error"] == "Row execution failed."
    # Every output the row did not complete records the failure (merged with the outcome's
    # own meta), so the column counters count the row's cells as failed.
    failed_cell = {"status": "failed", "run_id": "r1"}
    assert stored["score"] == 4 and stored["_cell_meta"] == {"score": failed_cell,
                                                            "tag": failed_cell}
    s = await summary(tenant, play_scope(tenant), NS)
    assert s.failed == 1 and s.columns["tag"].failed == 1 and s.columns["score"].failed == 1
    rerun = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])
    assert [r.key for r in rerun.pending] == [key]
    await complete(tenant, run, NS, CONTRACT, [done(key, 5, "ok")])
    stored = (await raw_rows(tenant, play_scope(tenant), NS))[key]
    assert stored["_cell_meta"]["tag"]["status"] == "completed"
    assert stored["_cell_meta"]["score"]["run_id"] == "r1"
    s = await summary(tenant, play_scope(tenant), NS)
    assert s.columns["tag"] == type(s.columns["tag"])(1, 0)
    assert s.columns["score"] == type(s.columns["score"])(1, 0)
    await assert_counters(tenant)


async def test_a_failed_row_counts_failed_cells_only_for_outputs_it_did_not_complete(tenant):
    run = await new_run(tenant, PLAY, "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    await complete(tenant, run, NS, CONTRACT, [done(key, 2, "x")])
    # A new output makes the enriched row run again; it fails: the new output's cell is failed,
    # the cells it had completed stay completed.
    wider = SheetContract(inputs=("name",), outputs=("score", "tag", "region"))
    again = await new_run(tenant, PLAY, "r2")
    assert [r.key for r in (await admit(tenant, again, NS, wider, [{"name": "a"}])).pending] == [key]
    await complete(tenant, again, NS, wider, [RowOutcome(key, "failed", error="no region")])
    meta = (await raw_rows(tenant, play_scope(tenant), NS))[key]["_cell_meta"]
    assert meta["region"] == {"status": "failed", "run_id": "r2"}
    assert meta["score"]["status"] == meta["tag"]["status"] == "completed"
    s = await summary(tenant, play_scope(tenant), NS)
    assert s.failed == 1 and s.completed == 0
    assert {f: (c.completed, c.failed) for f, c in s.columns.items()} == {
        "score": (1, 0), "tag": (1, 0), "region": (0, 1)}
    await assert_counters(tenant)
    await complete(tenant, again, NS, wider, [done(key, 2, "x", region="emea")])
    s = await summary(tenant, play_scope(tenant), NS)
    assert s.columns["region"] == type(s.columns["region"])(1, 0)
    await assert_counters(tenant)


async def test_cell_policy_makes_old_cells_stale(tenant):
    run = await new_run(tenant, PLAY, "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    await complete(tenant, run, NS, CONTRACT, [done(key)])
    fresh = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}],
                        cell_policies={"score": CellPolicy(3600)})
    assert [r.key for r in fresh.completed] == [key]
    stale = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}],
                        cell_policies={"score": CellPolicy(0)})
    assert [r.key for r in stale.pending] == [key]
    await assert_counters(tenant)


async def test_new_output_field_extends_the_sheet(tenant):
    run = await new_run(tenant, PLAY, "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    odd = "ü" * 40 + " weird \"name\""  # over 63 bytes, quotes
    result = await complete(tenant, run, NS, CONTRACT, [done(key, extra=None, **{odd: {"x": [1]}})])
    assert result.diagnostics.column_retries == 1
    rows = await read_rows(tenant, play_scope(tenant), NS)
    assert rows[0][odd] == {"x": [1]} and rows[0]["name"] == "a"
    assert rows[0]["_status"] == "enriched"
    s = await summary(tenant, play_scope(tenant), NS)
    assert s.columns[odd].completed == 1
    await assert_counters(tenant)


async def test_read_rows_by_run_prefers_enriched_then_failed(tenant):
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": n} for n in "abc"])
    a, b, c = (r.key for r in admission.pending)
    rows = await read_rows(tenant, play_scope(tenant), NS, run_id="r1")
    assert [r["_key"] for r in rows] == [a, b, c]
    await complete(tenant, run, NS, CONTRACT, [RowOutcome(b, "failed", error="e")])
    assert [r["_key"] for r in await read_rows(tenant, play_scope(tenant), NS, run_id="r1")] == [b]
    await complete(tenant, run, NS, CONTRACT, [done(c)])
    assert [r["_key"] for r in await read_rows(tenant, play_scope(tenant), NS, run_id="r1")] == [c]
    page = await read_rows(tenant, play_scope(tenant), NS, limit=1, offset=1)
    assert [r["_key"] for r in page] == [b]
    assert await read_rows(tenant, play_scope(tenant), NS, run_id="other") == []


async def test_counters_equal_count_after_concurrent_completers_with_overlapping_keys(tenant):
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": str(i)} for i in range(300)])
    keys = [r.key for r in admission.pending]

    async def completer(worker: int) -> None:
        for round_ in range(3):
            batch = keys[worker * 40: worker * 40 + 150]
            outcomes = [
                done(k, worker, f"w{worker}") if (i + round_ + worker) % 3 else
                RowOutcome(k, "failed", {"score": -1}, cell_meta={"tag": {"status": "failed"}})
                for i, k in enumerate(batch)
            ]
            await complete(tenant, run, NS, CONTRACT, outcomes)

    async def readmitter() -> None:
        for _ in range(3):
            await admit(tenant, run, NS, CONTRACT, [{"name": str(i)} for i in range(0, 300, 7)])

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for worker in range(5):
                nursery.start_soon(completer, worker)
            nursery.start_soon(readmitter)
    await assert_counters(tenant)
    s = await summary(tenant, play_scope(tenant), NS)
    assert s.total == 300 and s.completed + s.failed + s.queued + s.running == 300


async def test_large_admission_and_completion_in_one_call_each(tenant):
    run = await new_run(tenant, PLAY, "big")
    rows = [{"name": f"company-{i}", "size": i} for i in range(25_000)]
    with trio.fail_after(120):
        admission = await admit(tenant, run, NS, CONTRACT, rows)
        assert admission.inserted == 25_000 and len(admission.pending) == 25_000
        outcomes = [done(r.key, r.input_index, "x" * 50) for r in admission.pending]
        completion = await complete(tenant, run, NS, CONTRACT, outcomes)
    assert completion.updated == 25_000 and len(completion.committed_keys) == 25_000
    assert completion.diagnostics.chunks == 3
    s = await summary(tenant, play_scope(tenant), NS)
    assert (s.total, s.completed, s.queued) == (25_000, 25_000, 0)
    assert s.columns["score"].completed == 25_000
    await assert_counters(tenant)


async def test_diagnostics_sink_failures_never_change_the_result(tenant, caplog):
    run = await new_run(tenant, PLAY, "r1")
    key = (await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])).pending[0].key
    seen = []

    def broken_sink(diagnostics):
        seen.append(diagnostics)
        raise RuntimeError("telemetry is down")

    result = await complete(tenant, run, NS, CONTRACT, [done(key)], on_diagnostics=broken_sink)
    assert result.committed_keys == (key,)
    await tenant.diagnostics.wait_idle()  # delivered by the tenant's background task
    assert seen == [result.diagnostics]
    assert seen[0].outcome == "succeeded" and seen[0].updated_rows == 1
    assert "diagnostics sink failed" in caplog.text

    async def async_sink(diagnostics):
        await trio.sleep(0)
        raise ValueError("nope")

    again = await complete(tenant, run, NS, CONTRACT, [done(key)], on_diagnostics=async_sink)
    assert again.committed_keys == (key,)
    await tenant.diagnostics.wait_idle()


async def test_explicit_keys_refresh_inputs_and_order_puts_missing_indexes_last(tenant):
    run = await new_run(tenant, PLAY, "r1")
    await admit(tenant, run, NS, CONTRACT, [{"name": "first"}, {"name": "x"}], keys=["k1", "k2"],
                input_offset=5)
    again = await admit(tenant, run, NS, CONTRACT, [{"name": "second"}], keys=["k1"])
    assert [(r.key, r.input_index) for r in again.pending] == [("k1", 0)]
    await complete(tenant, run, NS, CONTRACT, [done("no-index")])  # inserted, no input index
    rows = await read_rows(tenant, play_scope(tenant), NS)
    assert [(r["_key"], r["name"], r["_input_index"]) for r in rows] == [
        ("k1", "second", 0), ("k2", "x", 6), ("no-index", None, None)
    ]


async def test_a_live_lease_blocks_a_plain_admission_of_the_same_run(tenant):
    run = await new_run(tenant, PLAY, "r1")
    held = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}], attempt=Attempt("a1", 1))
    plain = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}, {"name": "b"}])
    assert [(r.key, r.reason) for r in plain.blocked] == [(held.pending[0].key, "attempt_active")]
    assert [r.row for r in plain.pending] == [{"name": "b"}]
    newer = await new_run(tenant, PLAY, "r2")
    taken = await admit(tenant, newer, NS, CONTRACT, [{"name": "a"}])  # a newer run takes over
    assert [r.key for r in taken.pending] == [held.pending[0].key]
    late = await complete(tenant, run, NS, CONTRACT, [done(held.pending[0].key)],
                          attempt=Attempt("a1", 1))
    assert [f.reason for f in late.fenced] == ["stale_write_version"]
    await assert_counters(tenant)
