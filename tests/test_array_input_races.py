"""The named seal/put/retire races, each forced deterministically with gated ports."""

from __future__ import annotations

import contextlib

import pytest
import trio

from runplane.engine import RunScope, array_input as A
from runplane.engine.errors import ConflictError, RetiredError
from runplane.engine.ports import PortDefaults
from runplane.simulations.ports import CountingPort, GatedPort

from tests.array_input_support import facts, occurrences, snapshot, stage

RUN = RunScope("org-test", "play", "run-1")
SCOPE = RUN.map("companies", "map-1")
ROWS = 2500  # three pages: 1000, 1000, 500


async def _retire_until_done(port) -> list[A.RetireResult]:
    results = []
    while not results or not results[-1].done:
        results.append(await A.retire(port, RUN))
    return results


async def _only_the_retired_guard_is_left(tenant) -> None:
    assert [kind for kind, _ in await facts(tenant, "run-1")] == ["array_input_guard"]
    with pytest.raises(RetiredError):
        await A.get_manifest(tenant, SCOPE)


async def _seal_expecting(error, port, fingerprint, *, batch_size, outcome: list) -> None:
    try:
        await A.seal(port, SCOPE, source_fingerprint=fingerprint, source_rows=ROWS, page_count=3,
                     batch_size=batch_size)
        outcome.append(None)
    except error as exc:
        outcome.append(exc)


async def test_retirement_between_two_seal_batches_fails_the_seal_and_nothing_regrows(tenant):
    fingerprint, _ = await stage(tenant, SCOPE, occurrences(ROWS), seal=False)
    sealer = GatedPort(tenant)
    gate = sealer.gate_checkout(3)  # 1: start, 2: batch of page 0, 3: batch of page 1
    outcome: list = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _seal_expecting(RetiredError, sealer, fingerprint,
                                                       batch_size=1, outcome=outcome))
            await gate.wait_reached()
            assert [r.done for r in await _retire_until_done(tenant)][-1]
            gate.release()
    assert isinstance(outcome[0], RetiredError)
    await _only_the_retired_guard_is_left(tenant)


async def test_retirement_after_the_scan_but_before_the_final_fence(tenant):
    fingerprint, _ = await stage(tenant, SCOPE, occurrences(ROWS), seal=False)
    sealer = GatedPort(CountingPort(tenant))
    gate = sealer.gate_checkout(3)  # 1: start, 2: the one batch of all three pages, 3: the seal
    outcome: list = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _seal_expecting(RetiredError, sealer, fingerprint,
                                                       batch_size=4, outcome=outcome))
            await gate.wait_reached()
            # The whole scan is verified: every page was fetched, then the permit released.
            assert sealer.inner.checkout_count == 2
            assert all(stats.in_use == 0 for stats in tenant.permits().values())
            await _retire_until_done(tenant)
            gate.release()
    assert isinstance(outcome[0], RetiredError)
    await _only_the_retired_guard_is_left(tenant)


async def test_a_peer_finishing_the_seal_mid_scan_makes_the_other_sealer_return_without_writing(tenant):
    fingerprint, _ = await stage(tenant, SCOPE, occurrences(ROWS), seal=False)
    counter = CountingPort(tenant)
    slow = GatedPort(counter)
    gate = slow.gate_checkout(3)  # mid-scan, before the batch of page 1
    outcome: list = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _seal_expecting(Exception, slow, fingerprint, batch_size=1,
                                                       outcome=outcome))
            await gate.wait_reached()
            await A.seal(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=ROWS,
                         page_count=3)  # the peer
            sealed = await snapshot(tenant)
            gate.release()
    assert outcome == [None]
    # The slow sealer saw the peer's seal in its next checkout and wrote nothing.
    assert counter.checkout_count == 3
    assert not any("INSERT" in sql for sql in counter.statements)
    assert await snapshot(tenant) == sealed
    assert (await A.get_manifest(tenant, SCOPE)).state == "sealed"


async def test_a_different_page_put_racing_the_seal_conflicts_and_the_seal_keeps_the_original(tenant):
    source = occurrences(ROWS)
    fingerprint, drafts = await stage(tenant, SCOPE, source, seal=False)
    sealer = GatedPort(tenant)
    gate = sealer.gate_checkout(3)  # page 0 verified, pages 1 and 2 not yet fetched
    outcome: list = []
    forged = occurrences(1000, start=1000, width=21)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _seal_expecting(Exception, sealer, fingerprint,
                                                       batch_size=1, outcome=outcome))
            await gate.wait_reached()
            for ordinal in (0, 1):  # one already verified, one still to be scanned
                with pytest.raises(ConflictError):
                    await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint,
                                     ordinal=ordinal, offset=1000 * ordinal, rows=forged)
            gate.release()
    assert outcome == [None]
    replay = [row for n in range(3) for row in (await A.read_page(tenant, SCOPE, n)).rows]
    assert replay == source


async def test_a_missing_page_put_during_the_scan_is_verified_before_the_seal(tenant):
    source = occurrences(ROWS)
    fingerprint = A.source_fingerprint(source)
    drafts = A.paginate(source)
    await A.begin(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=ROWS,
                  has_source_identities=False)
    for draft in drafts[:2]:
        await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=draft.ordinal,
                         offset=draft.offset, rows=draft.rows)
    sealer = GatedPort(tenant)
    gate = sealer.gate_checkout(3)
    outcome: list = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _seal_expecting(Exception, sealer, fingerprint,
                                                       batch_size=1, outcome=outcome))
            await gate.wait_reached()
            last = drafts[2]
            await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=last.ordinal,
                             offset=last.offset, rows=last.rows)
            gate.release()
    assert outcome == [None]
    assert (await A.get_manifest(tenant, SCOPE)).page_count == 3


class _HeldTransactionPort(PortDefaults):
    """Forwards to `tenant`, but runs its `hold`-th checkout inside BEGIN … COMMIT: `written` is
    set once the caller's work is done, and COMMIT waits for `commit` (locks stay held)."""

    def __init__(self, tenant, hold: int) -> None:
        self.org_id, self.schema, self.outer_transaction = tenant.org_id, tenant.schema, False
        self._tenant, self._hold, self._checkouts = tenant, hold, 0
        self.written, self.commit = trio.Event(), trio.Event()

    @contextlib.asynccontextmanager
    async def connection(self, lane):
        self._checkouts += 1
        async with self._tenant.connection(lane) as conn:
            if self._checkouts != self._hold:
                yield conn
                return
            async with conn.transaction():
                yield conn
                self.written.set()
                await self.commit.wait()

    async def repair_schema(self):
        await self._tenant.repair_schema()


async def _wait_for_a_lock_waiter(tenant) -> None:
    while True:
        async with tenant.connection("sheet") as conn:
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        if waiting:
            return
        await trio.sleep(0.01)


@pytest.mark.parametrize("writer", ["put", "seal"])
async def test_a_writer_that_commits_while_retirement_waits_for_the_guard_is_still_retired(tenant, writer):
    """READ COMMITTED: the retiring statement's snapshot predates the writer's commit; the
    retirement must still delete what the writer wrote before it answers done."""
    source = occurrences(ROWS)
    fingerprint = A.source_fingerprint(source)
    drafts = A.paginate(source)
    await A.begin(tenant, SCOPE, source_fingerprint=fingerprint, source_rows=ROWS,
                  has_source_identities=False)
    for draft in drafts[: 2 if writer == "put" else 3]:
        await A.put_page(tenant, SCOPE, source_fingerprint=fingerprint, ordinal=draft.ordinal,
                         offset=draft.offset, rows=draft.rows)
    # put: its one checkout; seal: 1 start, 2 the scan, 3 the final write under the guard.
    held = _HeldTransactionPort(tenant, hold=1 if writer == "put" else 3)
    results: list = []

    async def write():
        if writer == "put":
            last = drafts[2]
            await A.put_page(held, SCOPE, source_fingerprint=fingerprint, ordinal=last.ordinal,
                             offset=last.offset, rows=last.rows)
        else:
            await A.seal(held, SCOPE, source_fingerprint=fingerprint, source_rows=ROWS,
                         page_count=3)

    async def retire():
        results.append(await A.retire(tenant, RUN))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await held.written.wait()  # written, guard locked, not committed
            nursery.start_soon(retire)
            await _wait_for_a_lock_waiter(tenant)
            held.commit.set()
    # begin + 3 pages (+ the seal): all deleted by the one call that waited, which says done.
    assert results == [A.RetireResult(True, 4 if writer == "put" else 5)]
    await _only_the_retired_guard_is_left(tenant)
