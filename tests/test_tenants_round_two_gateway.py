"""Tenants alone, round two (§28), the gateway's part: request ids are bounded and the replay
cache counts them; run-scoped tokens are scoped on every action that names or lists runs, and
lease lengths are bounded; a completion never writes over a stored input cell, nor over the
rows of a shared-map unit leased to another holder; token times allow a clock-skew leeway for
`iat`/`nbf`, never for `exp`."""

from __future__ import annotations

import datetime
import time
import uuid

import httpx
import jwt
import pytest
import trio

from runplane.engine import PlayScope, RunScope, receipts, runs, sheets
from runplane.engine.runs import history, outbox
from runplane.engine.shared import (
    leases as shared_leases, maps as shared_maps, units as shared_units,
)
from runplane.engine.errors import AuthError, InvalidInputError, ScopeError
from runplane.engine.gateway import guards, mint_token, open_gateway, verify_token
from runplane.engine.tokens import VerifiedTokens
from runplane.engine.sheets import completion
from runplane.engine.sheets.layout import layout_for
from runplane.simulations.counters import counters_match

from .gateway_support import FAST_RETRY, SECRET, count_rows, serving, token_for  # noqa: F401

PLAY = "round-two"


def _post(client, server, name, body, token, request_id=None):
    headers = {"authorization": f"Bearer {token}"}
    if request_id is not None:
        headers["runplane-request-id"] = request_id
    return client.post(f"{server.url}/v1/actions/{name}", json=body, headers=headers)


def _run_body(ref):
    scope = ref.scope
    return {"scope": {"org_id": scope.org_id, "play": scope.play, "run_id": scope.run_id},
            "epoch": ref.epoch}


# -- 3. request ids ------------------------------------------------------------------------------

async def test_a_request_id_past_128_characters_or_outside_its_alphabet_is_refused(tenant):
    run = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "r"))
    token = token_for(tenant)
    async with serving(tenant) as server, httpx.AsyncClient() as client:
        for i, bad in enumerate(["x" * 15_000, "y" * 129, "has space", "a/b", "é".encode(),
                                   "semi;colon", "quote'", ""]):
            body = {"run": _run_body(run), "key": f"bad-{i}", "output": {"v": i}}
            answer = await _post(client, server, "receipts.complete", body, token, bad)
            if bad == "":
                assert answer.status_code == 200  # no id: nothing to replay, nothing refused
                continue
            assert answer.status_code == 400, (bad[:20], answer.text)
            assert answer.json()["code"] == "invalid_input"
            assert "request id" in answer.json()["error"]
        assert await count_rows(tenant, "work_receipts") == 1  # only the request without an id
        assert len(server.replay._done) == 0
        longest = "A-z0.9_:" + "k" * 120
        assert len(longest) == 128
        body = {"run": _run_body(run), "key": "good", "output": {"v": 1}}
        answer = await _post(client, server, "receipts.complete", body, token, longest)
        assert answer.status_code == 200
        assert (await _post(client, server, "receipts.complete", body, token, longest)).json() \
            == answer.json()
        assert server.replay.hits == 1
        # what the client generates passes, and is remembered for its retries
        async with open_gateway(server.url, token, retry=FAST_RETRY) as gw:
            await receipts.complete(gw, run, "client", {"v": 2})
        assert len(server.replay._done) == 2


async def test_the_replay_cache_budget_counts_keys_and_answers():
    """3,000 answers of a few bytes under 128-character ids: a budget counting answers only
    kept every one of them (the ids' bytes went uncounted); counting keys, it keeps what fits."""
    cache = guards.ReplayCache(max_bytes=100_000)

    async def answer() -> bytes:
        return b"{}"

    for i in range(3000):
        request_id = f"{i:08d}".ljust(128, "x")
        await cache.run(("org", "play", "receipts.complete", request_id), b"d" * 32, answer)
    kept = len(cache._done)
    assert 0 < kept < 3000
    assert kept * (128 + 2) <= 100_000
    assert cache._bytes <= cache.max_bytes
    assert cache._bytes == sum(guards.replay_entry_bytes(key, entry[1], entry[2])
                               for key, entry in cache._done.items())


# -- 15. clock skew --------------------------------------------------------------------------------

def _token_with(**times) -> str:
    now = int(time.time())
    claims = {"org": "o", "plays": ["*"], "actions": ["*"], "iat": now, "exp": now + 600,
              "jti": uuid.uuid4().hex, **times}
    return jwt.encode(claims, SECRET, algorithm="HS256")


def test_a_token_from_a_clock_ahead_is_accepted_within_the_leeway_and_exp_has_none(monkeypatch):
    monkeypatch.delenv("RUNPLANE_TOKEN_LEEWAY_S", raising=False)
    now = int(time.time())
    ahead = [_token_with(iat=now + 20), _token_with(nbf=now + 20),
             _token_with(iat=now + 20, nbf=now + 20, exp=now + 620)]
    for token in ahead:  # a host whose clock runs 20 s ahead: within the default 30 s
        assert verify_token(SECRET, token).org == "o"
        assert VerifiedTokens(SECRET).verify(token).org == "o"
    for token in (_token_with(iat=now + 90), _token_with(nbf=now + 90)):
        with pytest.raises(AuthError, match="invalid token"):
            verify_token(SECRET, token)
    expired = _token_with(iat=now - 600, exp=now - 5)  # never any leeway for exp
    with pytest.raises(AuthError, match="expired"):
        verify_token(SECRET, expired)
    with pytest.raises(AuthError, match="expired"):
        verify_token(SECRET, expired, leeway_s=3600)
    with pytest.raises(AuthError, match="expired"):
        VerifiedTokens(SECRET, leeway_s=3600).verify(expired)
    # the leeway is configurable: the environment's, or an explicit one
    assert verify_token(SECRET, _token_with(iat=now + 90), leeway_s=120).org == "o"
    monkeypatch.setenv("RUNPLANE_TOKEN_LEEWAY_S", "0")
    with pytest.raises(AuthError):
        verify_token(SECRET, ahead[0])
    with pytest.raises(AuthError):
        VerifiedTokens(SECRET).verify(ahead[0])
    monkeypatch.setenv("RUNPLANE_TOKEN_LEEWAY_S", "120")
    assert verify_token(SECRET, _token_with(iat=now + 90)).org == "o"
    monkeypatch.setenv("RUNPLANE_TOKEN_LEEWAY_S", "soon")
    with pytest.raises(Exception, match="RUNPLANE_TOKEN_LEEWAY_S"):
        VerifiedTokens(SECRET)


async def test_the_gateway_accepts_a_token_minted_by_a_host_whose_clock_runs_ahead(tenant,
                                                                                 monkeypatch):
    monkeypatch.delenv("RUNPLANE_TOKEN_LEEWAY_S", raising=False)
    now = int(time.time())
    claims = {"org": tenant.org_id, "plays": ["*"], "actions": ["*"], "iat": now + 25,
              "nbf": now + 25, "exp": now + 625, "jti": uuid.uuid4().hex}
    token = jwt.encode(claims, SECRET, algorithm="HS256")
    async with serving(tenant) as server:
        async with open_gateway(server.url, token, retry=FAST_RETRY) as gw:
            ref = await runs.register(gw, RunScope(tenant.org_id, PLAY, "skewed"))
    assert (await runs.get(tenant, ref.scope)).epoch == ref.epoch


# -- 7. run-scoped tokens ----------------------------------------------------------------------

async def _runs_with_due_entries(tenant, run_ids):
    """Registered runs of PLAY whose outbox entries are due (pending, no lease)."""
    refs = {}
    for run_id in run_ids:
        scope = RunScope(tenant.org_id, PLAY, run_id)
        refs[run_id] = await runs.register(tenant, scope)
        assert await outbox.mark_pending(tenant, scope, "guard", 30.0)
        await outbox.release(tenant, scope, "guard")
    return refs


async def test_a_run_scoped_token_drains_only_its_own_runs_outbox(tenant):
    refs = await _runs_with_due_entries(tenant, ["mine", "other-1", "other-2"])
    token = token_for(tenant, plays=[PLAY], runs=["mine"])
    async with serving(tenant) as server, open_gateway(server.url, token, retry=FAST_RETRY) as gw:
        with pytest.raises(InvalidInputError, match="lease_s"):  # until the year 33715: no
            await outbox.claim_due(gw, "prober", limit=10, lease_s=1e12, plays=[PLAY])
        claimed = await outbox.claim_due(gw, "prober", limit=10, lease_s=30.0, plays=[PLAY])
        assert [entry.scope.run_id for entry in claimed] == ["mine"]
    # the real supervisor still finds the other runs' entries due
    drained = await outbox.claim_due(tenant, "supervisor", limit=10, lease_s=30.0)
    assert sorted(entry.scope.run_id for entry in drained) == ["other-1", "other-2"]
    assert refs["mine"].scope.run_id == "mine"


async def test_a_run_scoped_token_names_and_lists_only_its_runs(tenant):
    scope = PlayScope(tenant.org_id, PLAY)
    refs = {run_id: await runs.register(tenant, RunScope(tenant.org_id, PLAY, run_id))
            for run_id in ("mine", "other")}
    started = datetime.datetime.now(datetime.timezone.utc)
    for run_id, ref in refs.items():
        await outbox.record_open(tenant, ref.scope)
        await history.record_map(tenant, ref.scope, history.MapRecord(
            "map-0", "t", "running", started, admitted=3))
        await shared_maps.publish(tenant, ref, "map-0", "t", config={}, function="f",
                                  play_digest="d", units=[(0, 0, 10)])
        await shared_maps.set_state(tenant, ref, "map-0", "open", ["waiting"])
    token = token_for(tenant, plays=[PLAY], runs=["mine"])
    async with serving(tenant) as server, open_gateway(server.url, token, retry=FAST_RETRY) as gw:
        assert (await runs.by_epoch(gw, scope, refs["mine"].epoch)).run_id == "mine"
        assert await runs.by_epoch(gw, scope, refs["other"].epoch) is None
        assert [info.run_id for info in await runs.list_runs(gw, scope)] == ["mine"]
        assert [m.run_id for m in await history.live_maps(gw, scope)] == ["mine"]
        assert [m.run_id for m in await history.list_maps(gw, scope, ["mine"])] == ["mine"]
        assert list(await outbox.get_many(gw, scope, ["mine"])) == ["mine"]
        assert [m.ref.run_id for m in await shared_maps.live_maps(gw, PLAY)] == ["mine"]
        assert await shared_maps.units_remaining(gw, PLAY) == 1
        denied = server.errors["scope_denied"]
        refusals = [
            lambda: history.list_maps(gw, scope, ["mine", "other"]),
            lambda: outbox.get_many(gw, scope, ["other"]),
            lambda: sheets.run_rows(gw, scope, "t", ["other"]),
        ]
        for call in refusals:
            with pytest.raises(ScopeError, match="runs claim does not allow run 'other'"):
                await call()
        assert server.errors["scope_denied"] == denied + len(refusals)
    # a token for every run (and a direct call) still sees them all
    async with serving(tenant) as server, \
            open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
        assert await runs.by_epoch(gw, scope, refs["other"].epoch) is not None
        assert len(await runs.list_runs(gw, scope)) == 2
        assert len(await history.live_maps(gw, scope)) == 2
        assert len(await shared_maps.live_maps(gw, PLAY)) == 2
        assert await shared_maps.units_remaining(gw, PLAY) == 2
    assert len(await runs.list_runs(tenant, scope)) == 2


async def test_lease_lengths_are_bounded(tenant):
    ref = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "r"))
    with pytest.raises(InvalidInputError, match="lease_s"):
        await outbox.mark_pending(tenant, ref.scope, "guard", 1e12)
    assert await outbox.mark_pending(tenant, ref.scope, "guard", 30.0)
    with pytest.raises(InvalidInputError, match="lease_s"):
        await outbox.renew(tenant, ref.scope, "guard", 1e12)
    with pytest.raises(InvalidInputError, match="delay_s"):
        await outbox.retry_later(tenant, ref.scope, "guard", "boom", 1e12)
    with pytest.raises(InvalidInputError, match="lease_s"):
        await outbox.claim_due(tenant, "o", limit=1, lease_s=1e12)
    with pytest.raises(InvalidInputError, match="lease_s"):
        await shared_maps.publish(tenant, ref, "map-0", "t", config={}, function="f",
                                  play_digest="d", units=[(0, 0, 10)], lease_s=1e12)
    async with tenant.connection("receipts") as conn:
        far = await conn.fetchval(
            f'SELECT count(*) FROM "{tenant.schema}".terminal_outbox'
            " WHERE lease_expires_at > now() + interval '8 days'")
    assert far == 0


# -- 11. inputs are not outputs, whatever contract the request sends ----------------------------

STORED = sheets.SheetContract(inputs=("name", "x"), outputs=("score",))
FORGED = sheets.SheetContract(inputs=("name",), outputs=("score", "x"))  # omits input x


@pytest.fixture(params=["returning_old", "snapshot"])
def statement_kind(request, monkeypatch):
    """Both forms of the completion statement (PostgreSQL >= 18's, and the older one)."""
    if request.param == "snapshot":
        monkeypatch.setattr(completion, "RETURNING_OLD_SINCE", 10**9)
    return request.param


async def test_a_completion_naming_a_stored_input_as_an_output_is_refused_for_that_row(
        tenant, statement_kind):
    run = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "r"))
    scope = PlayScope(tenant.org_id, PLAY)
    rows = [{"name": f"n{i}", "x": f"original{i}"} for i in range(4)]
    pending = (await sheets.admit(tenant, run, "t", STORED, rows)).pending
    keys = [row.key for row in pending]
    async with serving(tenant) as server, \
            open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
        done = await sheets.complete(gw, run, "t", FORGED, [
            sheets.RowOutcome(keys[0], "completed", data={"score": 1}),
            sheets.RowOutcome(keys[1], "completed", data={"score": 2, "x": "OVERWRITTEN1"}),
            sheets.RowOutcome(keys[2], "failed", data={"x": "OVERWRITTEN2"}, error="boom"),
        ])
    assert done.committed_keys == (keys[0],)
    assert {(f.key, f.reason) for f in done.fenced} == {
        (keys[1], "input_field"), (keys[2], "input_field")}
    assert done.updated == 1
    # a direct call with the forged contract is refused the same way
    direct = await sheets.complete(tenant, run, "t", FORGED, [
        sheets.RowOutcome(keys[3], "completed", data={"score": 4, "x": "OVERWRITTEN3"})])
    assert [f.reason for f in direct.fenced] == ["input_field"] and direct.updated == 0
    stored = {r["name"]: r for r in await sheets.read_rows(tenant, scope, "t")}
    assert [stored[f"n{i}"]["x"] for i in range(4)] == [f"original{i}" for i in range(4)]
    assert [stored[f"n{i}"]["_status"] for i in range(4)] == [
        "enriched", "pending", "pending", "pending"]
    ok, detail = await counters_match(tenant, scope, "t")
    assert ok, detail
    # an output the row stores (a completed cell) may be written again, also when the
    # request's contract calls a field an output that the row never stored
    again = await sheets.complete(tenant, run, "t", FORGED, [
        sheets.RowOutcome(keys[0], "completed", data={"score": 5}),
        sheets.RowOutcome(keys[1], "completed", data={"score": 6, "extra": "new"})])
    assert again.fenced == () and again.updated == 2


# -- 12. unit leases bind every write to a shared map's rows ---------------------------------

NUMS = sheets.SheetContract(inputs=("n",), outputs=("double",))


async def _units_leased(tenant):
    """A run sharing a map of 15 rows in three units: "holder/1" leases units 0 and 1 (rows
    0-9) and admitted unit 0's rows; unit 2 (rows 10-14) is free."""
    ref = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "shared"))
    rows = [{"n": i} for i in range(15)]
    mid = shared_maps.map_id_for("map-0", "Nums")
    await shared_maps.publish(tenant, ref, mid, "Nums", config={}, function="f", play_digest="d",
                              units=[(0, 0, 5), (0, 5, 5), (0, 10, 5)])
    await shared_maps.set_state(tenant, ref, mid, shared_maps.OPEN, [shared_maps.WAITING])
    leases = await shared_leases.claim_units(tenant, ref, mid, "holder/1", limit=2)
    assert [lease.unit for lease in leases] == [0, 1]  # unit 2 (rows 10-14) stays free
    admitted = await shared_units.admit_units(tenant, ref, mid, leases[:1], "nums", NUMS,
                                              rows[:5], list(range(5)))
    return ref, rows, mid, leases, admitted


async def test_a_plain_completion_is_fenced_on_rows_of_a_unit_leased_to_another_holder(
        tenant, statement_kind):
    scope = PlayScope(tenant.org_id, PLAY)
    ref, rows, mid, leases, admitted = await _units_leased(tenant)
    keys = {row.input_index: row.key for row in admitted.pending}
    free = await sheets.admit(tenant, ref, "nums", NUMS, rows[10:], input_offset=10)
    keys.update({row.input_index: row.key for row in free.pending})

    def outcomes(indexes, value):
        return [sheets.RowOutcome(keys[i], "completed", {"double": value}, input_index=i)
                for i in indexes]

    async with serving(tenant) as server, \
            open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
        done = await sheets.complete(gw, ref, "nums", NUMS, outcomes(range(5), -1))
        assert done.updated == 0 and done.committed_keys == ()
        assert {f.reason for f in done.fenced} == {"attempt_superseded"}
        assert len(done.fenced) == 5
        # a row of a leased unit not admitted yet cannot be inserted either
        ghost = await sheets.complete(gw, ref, "nums", NUMS, [
            sheets.RowOutcome("ghost", "completed", {"double": -1}, input_index=7)])
        assert [(f.key, f.reason) for f in ghost.fenced] == [("ghost", "attempt_superseded")]
        # rows of a unit nobody holds are written as before
        plain = await sheets.complete(gw, ref, "nums", NUMS, outcomes(range(10, 15), 1))
        assert plain.updated == 5 and plain.fenced == ()
    stored = {r["n"]: r for r in await sheets.read_rows(tenant, scope, "nums")}
    assert sorted(stored) == [*range(5), *range(10, 15)]  # no ghost row
    assert all(stored[i]["_status"] == "running" for i in range(5))
    # the holder writes its own rows
    settlement = shared_leases.Settlement(leases[0], "", "1f", True, {})
    held = await shared_units.complete_units(
        tenant, ref, mid, "holder", [settlement], "nums", NUMS,
        [sheets.RowOutcome(keys[i], "completed", {"double": 2 * i}, input_index=i)
         for i in range(5)])
    assert held.updated == 5 and held.fenced == ()
    stored = {r["n"]: r for r in await sheets.read_rows(tenant, scope, "nums")}
    assert [stored[i]["double"] for i in range(5)] == [0, 2, 4, 6, 8]
    # once the map is no longer open its leases bind nothing: a plain write goes through
    await shared_maps.set_state(tenant, ref, mid, shared_maps.DONE, shared_maps.LIVE)
    late = await sheets.complete(tenant, ref, "nums", NUMS, outcomes(range(3), 3))
    assert late.fenced == () and late.updated == 3
    ok, detail = await counters_match(tenant, scope, "nums")
    assert ok, detail


async def test_a_plain_admission_with_explicit_keys_leaves_the_rows_of_a_leased_unit_alone(tenant):
    """Admission is fenced like completion: a plain admission of the run (no unit guard),
    with the holder's own keys, neither re-admits a leased unit's rows (even once their row
    leases lapsed: only the unit's lease is renewed) nor inserts its missing rows."""
    scope = PlayScope(tenant.org_id, PLAY)
    ref, rows, mid, leases, admitted = await _units_leased(tenant)
    keys = [row.key for row in admitted.pending]
    sheet = layout_for(tenant, scope, "nums").qualified
    async with tenant.connection("sheet") as conn:  # the rows' own leases lapse
        await conn.execute(f"UPDATE {sheet} SET _attempt_expires_at = now() - interval '1 s'")
    taker = sheets.Attempt("taker/1", 1, 30.0)

    async with serving(tenant) as server, \
            open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
        for port, attempt in ((gw, None), (tenant, taker)):
            taken = await sheets.admit(port, ref, "nums", NUMS, [*rows[:5], rows[7]],
                                       keys=[*keys, "ghost"], input_indexes=[*range(5), 7],
                                       attempt=attempt)
            assert taken.pending == () and taken.inserted == 0
            assert [(b.key, b.reason) for b in taken.blocked] == [
                *((key, "attempt_active") for key in keys), ("ghost", "attempt_active")]
        free = await sheets.admit(gw, ref, "nums", NUMS, rows[10:], input_offset=10)
        assert len(free.pending) == 5 and free.blocked == ()
    stored = {r["n"]: r for r in await sheets.read_rows(tenant, scope, "nums")}
    assert sorted(stored) == [*range(5), *range(10, 15)]  # no ghost row
    async with tenant.connection("sheet") as conn:
        holders = await conn.fetch(f"SELECT DISTINCT _attempt_id FROM {sheet} WHERE _input_index < 5")
    assert [r["_attempt_id"] for r in holders] == ["holder/1"]
    # the holder writes its own rows
    settlement = shared_leases.Settlement(leases[0], "", "1f", True, {})
    held = await shared_units.complete_units(
        tenant, ref, mid, "holder", [settlement], "nums", NUMS,
        [sheets.RowOutcome(key, "completed", {"double": 2 * i}, input_index=i)
         for i, key in enumerate(keys)])
    assert held.updated == 5 and held.fenced == ()
    # once the map is no longer open its leases bind nothing: a plain admission goes through
    await shared_maps.set_state(tenant, ref, mid, shared_maps.DONE, shared_maps.LIVE)
    late = await sheets.admit(tenant, ref, "nums", NUMS, [rows[7]], input_indexes=[7])
    assert late.inserted == 1 and late.blocked == ()
    ok, detail = await counters_match(tenant, scope, "nums")
    assert ok, detail
