"""Hot statements keep index plans once PostgreSQL has statistics on a big sheet.

Every statement a map sends — admission (payload and page sources), the probe, completion (the
exact path, the repair and the insertion of missing rows, with their counter updates), the lock
statement, array-input fact reads, retirement, work receipts — is explained as it is sent
(`PlanPort`): its custom plan with the real binds and the generic plan a prepared statement
switches to after five executions. After `ANALYZE` of every table of the schema (at the default
statistics target, at 1 and at 1000), none of them may reach the sheet or `work_receipts` by a
sequential or bitmap scan, or walk a whole index: each must look rows up through an index from
the batch's side, whatever the estimates say.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import MapScope, array_input, receipts, sheets
from runplane.engine.array_input.pages import encode_page
from runplane.engine.sheets import RowOutcome, SheetContract, StagedPage

from runplane.actors.shared.worker import WorkerOptions, serve_play

from .array_input_support import stage
from .plays.scale_play import noop
from .plan_support import PlanPort, scans_off_index

CONTRACT = SheetContract(inputs=("name", "n"), outputs=("ok",))
NS = "analyzed"
SHEET_ROWS = 200_000
FILLER_RECEIPTS = 200_000
SHARED_PLAY = str(Path(__file__).parent / "plays" / "scale_play.py")


def rows(tag: str, start: int, stop: int) -> list[dict]:
    return [{"name": f"{tag}{i}", "n": i} for i in range(start, stop)]


async def fail_tenths(row):
    if row["n"] % 10 == 0:
        raise ValueError("a tenth of the rows fail")
    return {"ok": True}


async def streamed(items):
    for item in items:
        yield item


def watched(relation: str) -> bool:
    """The big tables: work receipts and the sheets (not the per-sheet bookkeeping tables,
    a few rows per sheet each, which a small test reads by scanning)."""
    return relation == "work_receipts" or (
        relation.startswith("sheet_")
        and relation not in ("sheet_summary", "sheet_columns", "sheet_column_summary",
                             "sheet_counter_deltas", "sheet_column_deltas", "sheet_lists"))


async def analyze(tenant, target: int | None) -> None:
    async with tenant.connection("sheet") as conn:
        if target is not None:
            await conn.execute(f"SET default_statistics_target = {target}")
        tables = await conn.fetch(
            "SELECT quote_ident(schemaname) || '.' || quote_ident(relname) AS t"
            " FROM pg_stat_user_tables WHERE schemaname = $1", tenant.schema)
        for row in tables:
            await conn.execute(f"ANALYZE {row['t']}")
        await conn.execute("RESET default_statistics_target")


async def hot_paths(port, round_no: int) -> None:
    """One of each hot path through `port`: new rows from a list and a stream, a rerun that
    finds cache hits and failed rows, a forced map, appends, a replace (last round), a
    completion that repairs and one that inserts, reads, receipts, retirement as the runs
    end, and a shared map served by a worker."""
    base = SHEET_ROWS + round_no * 20_000
    async with open_run(port, "play") as run:
        await run.map(NS, rows("c", base, base + 10_000), fail_tenths, contract=CONTRACT)
        await run.map(NS, streamed(rows("c", base + 10_000, base + 15_000)), fail_tenths,
                      contract=CONTRACT)
    async with open_run(port, "play") as run:
        await run.map(NS, rows("c", 0, 10_000), fail_tenths, contract=CONTRACT)
        # A forced map: the probe and admission re-admit rows earlier runs enriched.
        await run.map(NS, rows("c", 10_000, 11_000), fail_tenths, contract=CONTRACT, force=True)
        ref = run.ref
        forced = await sheets.complete(port, ref, NS, CONTRACT, [RowOutcome(
            sheets.row_key(rows("c", 10_001, 10_002)[0], NS), "failed", error="x")],
            force_failed=True)
        assert forced.updated == 1, forced
        claim = await receipts.claim(port, ref, f"receipt-{round_no}")
        assert claim.disposition == "claimed", claim
        await receipts.complete(port, ref, f"receipt-{round_no}", {"done": True})
        # Completion of keys no row has: one repaired by its input index, one inserted.
        extra = rows("x", base + 15_000, base + 15_002)
        admission = await sheets.admit(port, ref, NS, CONTRACT, extra[:1],
                                       input_offset=base + 15_000)
        assert len(admission.pending) == 1
        outcome = await sheets.complete(port, ref, NS, CONTRACT, [
            RowOutcome("not-a-key", "completed", {"ok": True}, input_index=base + 15_000),
            RowOutcome(sheets.row_key(extra[1], NS), "completed", {"ok": True}),
        ])
        assert outcome.updated == 2
        await sheets.read_rows(port, ref.scope.play_scope, NS, limit=100)
        # Admission from a sealed page fact (a woken run's path), of a page of new rows.
        source = rows("p", base + 16_000, base + 16_500)
        scope = MapScope(port.org_id, "play", ref.run_id, NS, "staged-map")
        fingerprint, (draft,) = await stage(port, scope, [array_input.Occurrence(r) for r in source])
        page = StagedPage(scope, 0, encode_page(fingerprint, 0, draft.offset, draft.rows).digest)
        staged = await sheets.admit(port, ref, NS, CONTRACT, source, staged_page=page,
                                    cache_hits="count")
        assert staged.inserted == len(source)
        # Appends: input indexes continue from the sheet's largest; a retry finds its rows.
        appended = rows("a", base + 17_000, base + 17_100)
        for _ in range(2):
            await sheets.append_rows(port, ref, NS, CONTRACT, appended,
                                     idempotency_key=f"append-{round_no}")
        if round_no == 2:  # the last round: the sheet's rows replaced (emptied, then admitted)
            replaced = await sheets.replace_rows(port, ref, NS, CONTRACT, rows("r", 0, 1_000))
            assert replaced.inserted == 1_000
    # A shared map: its units admitted and completed by a worker, with the lease check in the
    # admission and the done mark in the completion.
    async with open_run(port, "play") as run:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_play(port, "play", SHARED_PLAY, WorkerOptions(
                exit_when_idle=True, poll_s=0.05)))
            shared = await run.map(NS, rows("s", base + 17_000, base + 18_000), noop,
                                   contract=CONTRACT, shared=True)
    assert shared.completed == 1_000, shared


@pytest.fixture(params=["returning_old", "snapshot_join"])
def completion_path(request, monkeypatch):
    """Both exact-key completion statements: PostgreSQL >= 18 `RETURNING old` and the snapshot
    join of older servers."""
    from runplane.engine.sheets import completion

    if request.param == "snapshot_join":
        monkeypatch.setattr(completion, "RETURNING_OLD_SINCE", 10**9)
    return request.param


async def test_hot_statements_reach_big_tables_through_their_indexes(tenant, completion_path):
    async with open_run(tenant, "play") as run:
        first = await run.map(NS, rows("c", 0, SHEET_ROWS), fail_tenths, contract=CONTRACT)
    assert first.completed + first.failed == SHEET_ROWS
    async with tenant.connection("receipts") as conn:  # other plays' receipts: a big table
        await conn.execute(
            f'INSERT INTO "{tenant.schema}".work_receipts (k, status, output, run_id)'
            " SELECT convert_to('[\"org-test\",\"other\",\"receipt\",\"' || i || '\"]', 'UTF8'),"
            "        2, '{}'::jsonb, 'old-run'"
            f"  FROM generate_series(1, {FILLER_RECEIPTS}) AS i")

    offenders: dict[str, set[str]] = {}
    for round_no, target in enumerate((None, 1, 1000)):
        await analyze(tenant, target)
        port = PlanPort(tenant)
        with trio.fail_after(300):
            await hot_paths(port, round_no)
        assert len(port.explained) > 20
        for explained in port.explained:
            head = " ".join(explained.sql.split())[:90]
            bad = scans_off_index(explained.custom, watched)
            if explained.generic is not None:
                bad += [f"generic: {b}" for b in scans_off_index(explained.generic, watched)]
            else:
                bad.append(f"generic plan not explained: {explained.generic_error}")
            for b in bad:
                offenders.setdefault(f"[target {target}] {head}", set()).add(b[:160])
    assert not offenders, "\n".join(
        f"{head}\n    " + "\n    ".join(sorted(bad)) for head, bad in offenders.items())
