"""Work-receipt leases, batch completion and release, against the real server."""

from __future__ import annotations

import pytest
import trio

from runplane.engine import RunScope, receipts, runs
from runplane.engine.actions import actions
from runplane.engine.errors import InvalidInputError
from runplane.engine.values.keys import receipt_key

from .test_receipts import NoQueryPort


def scope(run_id="r1"):
    return RunScope("org-test", "play", run_id)


async def lease_left(tenant, run, key):
    async with tenant.connection("receipts") as conn:
        return await conn.fetchval(
            f'SELECT extract(epoch FROM lease_expires_at - now())'
            f' FROM "{tenant.schema}".work_receipts WHERE k = $1', receipt_key(run.scope, key))


async def test_a_running_receipt_whose_lease_expired_is_claimable_again(tenant):
    old = await runs.register(tenant, scope("old"))
    new = await runs.register(tenant, scope("new"))
    assert (await receipts.claim(tenant, old, "k", lease_s=0.2)).disposition == "claimed"
    assert (await receipts.claim(tenant, new, "k")).disposition == "running"  # lease alive
    await trio.sleep(0.3)
    taken = await receipts.claim(tenant, new, "k", lease_s=60)
    assert taken.disposition == "claimed" and taken.receipt.run_id == "new"
    assert 50 < await lease_left(tenant, new, "k") <= 60
    # An expired lease never lets an older run take the key back.
    async with tenant.connection("receipts") as conn:
        await conn.execute(f'UPDATE "{tenant.schema}".work_receipts'
                           " SET lease_expires_at = now() - interval '1 s'")
    assert (await receipts.claim(tenant, old, "k")).disposition == "fenced"
    assert (await receipts.claim(tenant, new, "k")).disposition == "claimed"  # the same run
    assert 290 < await lease_left(tenant, new, "k") <= 300  # the default lease
    done = await receipts.complete(tenant, new, "k", {"v": 1})
    assert done.status == "completed" and await lease_left(tenant, new, "k") is None


async def test_lease_must_be_a_positive_number_of_seconds(tenant):
    run = await runs.register(tenant, scope())
    for bad in (0, -1, True, "5", float("nan"), 10**9):
        with pytest.raises(InvalidInputError, match="lease_s"):
            await receipts.claim(NoQueryPort(tenant), run, "k", lease_s=bad)


async def test_complete_many_settles_every_key_in_one_statement(tenant):
    old = await runs.register(tenant, scope("old"))
    new = await runs.register(tenant, scope("new"))
    await receipts.claim(tenant, old, "a")
    await receipts.complete(tenant, new, "c", {"theirs": True})
    got = await receipts.complete_many(tenant, old, {"a": {"n": 1}, "b": None, "c": {"n": 3}})
    assert list(got) == ["a", "b", "c"]
    assert (got["a"].status, got["a"].output, got["a"].run_id) == ("completed", {"n": 1}, "old")
    assert (got["b"].status, got["b"].output) == ("completed", None)
    assert (got["c"].output, got["c"].run_id) == ({"theirs": True}, "new")  # fenced: the newer one
    again = await receipts.complete_many(tenant, old, {"a": {"n": 1}, "b": None})
    assert again == {"a": got["a"], "b": got["b"]}  # an identical replay
    assert await receipts.complete_many(tenant, old, {}) == {}
    stored = await receipts.get_many(tenant, old.scope.play_scope, ["a", "b", "c"])
    assert {k: r.output for k, r in stored.items()} == {"a": {"n": 1}, "b": None,
                                                        "c": {"theirs": True}}
    with pytest.raises(InvalidInputError):
        await receipts.complete_many(NoQueryPort(tenant), old, {"": 1})


async def test_complete_many_is_one_statement(tenant, monkeypatch):
    from runplane.engine import pg

    run = await runs.register(tenant, scope())
    sent = []
    original = pg.Connection.fetch

    async def fetch(self, sql, *args, **kwargs):
        sent.append(sql)
        return await original(self, sql, *args, **kwargs)

    monkeypatch.setattr(pg.Connection, "fetch", fetch)
    got = await receipts.complete_many(tenant, run, {f"k{i}": i for i in range(500)})
    assert len(got) == 500 and len(sent) == 1


async def test_release_returns_the_runs_running_receipts_to_pending(tenant):
    run = await runs.register(tenant, scope("r1"))
    other = await runs.register(tenant, scope("r2"))
    for key in ("a", "b", "done"):
        await receipts.claim(tenant, run, key)
    await receipts.complete(tenant, run, "done", 1)
    await receipts.claim(tenant, other, "theirs")
    released = await receipts.release(tenant, run, ["b", "a", "done", "theirs", "absent", "a"])
    assert released == ["b", "a"]
    stored = await receipts.get_many(tenant, run.scope.play_scope, ["a", "b", "done", "theirs"])
    assert {k: r.status for k, r in stored.items()} == {
        "a": "pending", "b": "pending", "done": "completed", "theirs": "running"}
    assert (await receipts.claim(tenant, other, "a")).disposition == "claimed"
    assert await receipts.release(tenant, run, []) == []
    assert "receipts.release" in actions() and "receipts.complete_many" in actions()
