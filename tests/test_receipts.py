"""Runs and work receipts against the real server, with the races forced."""

from __future__ import annotations

import contextlib
import math

import pytest
import trio

from runplane.engine import PlayScope, RunScope, receipts, runs
from runplane.engine.errors import InvalidInputError, RowNotVisibleError, ScopeError
from runplane.engine.values.keys import receipt_key
from runplane.engine.ports import PortDefaults
from runplane.engine.runs.reissue import MAX_VISIBILITY_ATTEMPTS


class NoQueryPort(PortDefaults):
    """A port that fails the test if anything checks out a connection."""

    def __init__(self, tenant):
        self.org_id, self.schema, self.outer_transaction = tenant.org_id, tenant.schema, False

    @contextlib.asynccontextmanager
    async def connection(self, lane):
        raise AssertionError("bad input reached the database")
        yield

    async def repair_schema(self):
        raise AssertionError("bad input reached the database")


def scope(run_id="r1"):
    return RunScope("org-test", "play", run_id)


async def count_receipts(tenant) -> int:
    async with tenant.connection("receipts") as conn:
        return await conn.fetchval(f'SELECT count(*) FROM "{tenant.schema}".work_receipts')


def test_receipt_statuses_are_the_stored_values_of_spec_5():
    assert {status.name.lower(): int(status) for status in receipts.ReceiptStatus} == {
        "pending": 0, "running": 1, "completed": 2, "failed": 3, "skipped": 4}
    assert receipts.STATUS_NAMES == {0: "pending", 1: "running", 2: "completed", 3: "failed",
                                     4: "skipped"}


async def test_register_is_idempotent_and_later_runs_get_larger_epochs(tenant):
    first = await runs.register(tenant, scope("a"))
    again = await runs.register(tenant, scope("a"))
    later = await runs.register(tenant, scope("b"))
    assert first == again
    assert later.epoch > first.epoch


async def test_get_and_list_runs_read_the_registry_newest_first(tenant):
    a = await runs.register(tenant, scope("a"))
    b = await runs.register(tenant, scope("b"))
    c = await runs.register(tenant, scope("c"))
    await runs.register(tenant, RunScope("org-test", "other-play", "x"))
    found = await runs.get(tenant, scope("a"))
    assert (found.ref, found.run_id) == (a, "a") and found.created_at is not None
    assert await runs.get(tenant, scope("missing")) is None
    assert [info.ref for info in await runs.list_runs(tenant, PlayScope("org-test", "play"))] == [c, b, a]
    assert [info.run_id for info in await runs.list_runs(tenant, PlayScope("org-test", "play"), limit=2)] == ["c", "b"]
    assert await runs.list_runs(tenant, PlayScope("org-test", "no-runs")) == []


async def test_concurrent_registration_of_one_run_yields_one_epoch(tenant):
    refs = []

    async def register():
        refs.append(await runs.register(tenant, scope("same")))

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(register)
    assert len({ref.epoch for ref in refs}) == 1


async def test_eight_concurrent_claimers_yield_exactly_one_claim(tenant):
    run = await runs.register(tenant, scope())
    claims = []

    async def claim():
        claims.append(await receipts.claim(tenant, run, "contended"))

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(claim)
    dispositions = sorted(c.disposition for c in claims)
    assert dispositions == ["claimed"] + ["running"] * 7


async def test_claim_dispositions(tenant):
    old = await runs.register(tenant, scope("old"))
    new = await runs.register(tenant, scope("new"))
    assert (await receipts.claim(tenant, old, "k")).disposition == "claimed"
    assert (await receipts.claim(tenant, old, "k")).disposition == "running"
    assert (await receipts.claim(tenant, old, "k", reclaim_running=True)).disposition == "claimed"
    # A newer run may take over a running receipt only when asked to.
    assert (await receipts.claim(tenant, new, "k")).disposition == "running"
    taken = await receipts.claim(tenant, new, "k", reclaim_running=True)
    assert (taken.disposition, taken.receipt.run_id) == ("claimed", "new")
    # The older run is now fenced, for claims and for writes.
    assert (await receipts.claim(tenant, old, "k", reclaim_running=True)).disposition == "fenced"
    late = await receipts.complete(tenant, old, "k", {"from": "old"})
    assert (late.run_id, late.status, late.output) == ("new", "running", None)
    done = await receipts.complete(tenant, new, "k", {"from": "new"})
    assert done.status == "completed"
    reused = await receipts.claim(tenant, old, "k")
    assert (reused.disposition, reused.receipt.output) == ("reused", {"from": "new"})


async def test_an_older_epoch_cannot_complete_over_or_claim_a_newer_runs_receipt(tenant):
    old = await runs.register(tenant, scope("old"))
    new = await runs.register(tenant, scope("new"))
    await receipts.claim(tenant, new, "k")
    await receipts.fail(tenant, new, "k", "boom")
    claim = await receipts.claim(tenant, old, "k")
    assert claim.disposition == "fenced" and claim.receipt.run_id == "new"
    stored = await receipts.complete(tenant, old, "k", 1)
    assert (stored.status, stored.run_id, stored.error) == ("failed", "new", "boom")
    stored = await receipts.skip(tenant, old, "k")
    assert stored.status == "failed"


async def test_failed_receipts_are_reclaimed_and_fail_never_overwrites_completed(tenant):
    run = await runs.register(tenant, scope())
    await receipts.claim(tenant, run, "k")
    assert (await receipts.fail(tenant, run, "k", "first try")).status == "failed"
    assert (await receipts.claim(tenant, run, "k")).disposition == "claimed"
    await receipts.complete(tenant, run, "k", [1, 2])
    stored = await receipts.fail(tenant, run, "k", "late failure")
    assert (stored.status, stored.output, stored.error) == ("completed", [1, 2], None)


async def test_replays_are_idempotent(tenant):
    run = await runs.register(tenant, scope())
    first = await receipts.complete(tenant, run, "k", {"a": 1.0})
    async with tenant.connection("receipts") as conn:
        before = await conn.fetchval(f'SELECT xmin::text FROM "{tenant.schema}".work_receipts')
    again = await receipts.complete(tenant, run, "k", {"a": 1})
    async with tenant.connection("receipts") as conn:
        after = await conn.fetchval(f'SELECT xmin::text FROM "{tenant.schema}".work_receipts')
    assert first == again and before == after  # no physical change
    skipped = await receipts.skip(tenant, run, "s", {"why": "cached upstream"})
    assert skipped == await receipts.skip(tenant, run, "s", {"why": "cached upstream"})
    assert (await receipts.claim(tenant, run, "s")).disposition == "reused"


async def test_get_many_returns_one_entry_per_distinct_key_in_first_seen_order(tenant):
    run = await runs.register(tenant, scope())
    await receipts.complete(tenant, run, "b", "B")
    await receipts.complete(tenant, run, "a", "A")
    found = await receipts.get_many(tenant, PlayScope("org-test", "play"), ["b", "zz", "a", "b"])
    assert list(found) == ["b", "zz", "a"]
    assert found["zz"] is None and found["a"].output == "A"
    assert await receipts.get(tenant, PlayScope("org-test", "other-play"), "a") is None


async def test_bad_input_raises_before_any_query_and_writes_nothing(tenant):
    run = await runs.register(tenant, scope())
    port = NoQueryPort(tenant)
    with pytest.raises(ScopeError):
        RunScope("org-test", " ", "r")
    with pytest.raises(InvalidInputError, match="1024"):
        await receipts.claim(port, run, "k" * 1025)
    with pytest.raises(InvalidInputError, match="1024"):
        await receipts.complete(port, run, "", 1)
    with pytest.raises(InvalidInputError, match=r"output\.score"):
        await receipts.complete(port, run, "k", {"score": math.nan})
    with pytest.raises(InvalidInputError):
        await receipts.fail(port, run, "k", "")
    with pytest.raises(ScopeError, match="outside the execution scope"):
        await receipts.get(port, PlayScope("other-org", "play"), "k")
    with pytest.raises(ScopeError, match="outside the execution scope"):
        await runs.register(port, RunScope("other-org", "play", "r"))
    with pytest.raises(ScopeError, match="outside the execution scope"):
        await runs.get(port, RunScope("other-org", "play", "r"))
    with pytest.raises(InvalidInputError, match="limit"):
        await runs.list_runs(port, PlayScope("org-test", "play"), limit=-1)
    assert await count_receipts(tenant) == 0


class RacingPeer:
    """Before each of the first `races` claim statements of one key, a peer inserts that key's
    receipt in an open transaction, lets our statement block on it, commits, and deletes the row
    again once our statement answered: our statement meets the conflict but its snapshot
    predates the row, so it returns no row (the READ COMMITTED case the re-issue covers)."""

    def __init__(self, tenant, run, key, races):
        self.tenant, self.races, self.statements = tenant, races, 0
        self.k = receipt_key(run.scope, key)
        self.t = f'"{tenant.schema}".work_receipts'

    async def hook(self, sql, send):
        if not sql.lstrip().startswith("WITH claimed"):
            return await send()
        self.statements += 1
        if self.statements > self.races:
            return await send()
        answer = []
        async with self.tenant.connection("sheet") as peer, self.tenant.connection("retirement") as watch:
            await peer.execute("BEGIN")
            await peer.execute(f"INSERT INTO {self.t} (k, status, output) VALUES ($1, 2, 'null')", self.k)

            async def ours():
                answer.append(await send())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ours)
                while not await watch.fetchval(
                    "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                ):
                    await trio.sleep(0.005)
                await peer.execute("COMMIT")
            await peer.execute(f"DELETE FROM {self.t} WHERE k = $1", self.k)
        return answer[0]


@contextlib.asynccontextmanager
async def racing(tenant, peer):
    """The tenant, as a port whose receipts checkouts run `peer.hook` around every statement."""

    class Port(PortDefaults):
        org_id, schema, outer_transaction = tenant.org_id, tenant.schema, False

        @contextlib.asynccontextmanager
        async def connection(self, lane):
            async with tenant.connection(lane) as conn:
                conn.statement_hook = peer.hook
                try:
                    yield conn
                finally:
                    conn.statement_hook = None

        async def repair_schema(self):
            await tenant.repair_schema()

    yield Port()


async def test_a_claim_reissues_while_a_peers_row_is_invisible_then_claims(tenant):
    run = await runs.register(tenant, scope())
    peer = RacingPeer(tenant, run, "k", races=3)
    async with racing(tenant, peer) as port:
        with trio.fail_after(30):
            claim = await receipts.claim(port, run, "k")
    assert claim.disposition == "claimed" and peer.statements == 4
    assert (await receipts.get(tenant, run.scope.play_scope, "k")).status == "running"


async def test_a_row_that_never_becomes_visible_stops_at_the_bound_with_a_typed_error(tenant):
    run = await runs.register(tenant, scope())
    peer = RacingPeer(tenant, run, "k", races=MAX_VISIBILITY_ATTEMPTS)
    async with racing(tenant, peer) as port:
        with trio.fail_after(60), pytest.raises(RowNotVisibleError, match="receipt 'k' kept changing"):
            await receipts.claim(port, run, "k")
    assert peer.statements == MAX_VISIBILITY_ATTEMPTS
    assert await count_receipts(tenant) == 0
