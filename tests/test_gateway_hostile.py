"""One org's requests (or an unauthenticated client's) cannot hurt another's: forged runs are
refused, the replay cache answers only the same request, made-up action names cost nothing
lasting and never reach a log line, and a large body is decoded off the event loop."""

from __future__ import annotations

import threading

import httpx
import pytest
import trio

from runplane.engine import PlayScope, RunRef, RunScope, receipts, runs, sheets
from runplane.engine.errors import ConflictError
from runplane.engine.gateway import guards, open_gateway, server as server_module
from runplane.engine.actions import actions

from .gateway_support import FAST_RETRY, count_rows, gateway, server, token_for  # noqa: F401

PLAY = "hostile-play"
CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))


def _post(client, server, name, body, token, request_id=None):
    headers = {"authorization": f"Bearer {token}"}
    if request_id is not None:
        headers["runplane-request-id"] = request_id
    return client.post(f"{server.url}/v1/actions/{name}", json=body, headers=headers)


def _run_body(tenant, run_id, epoch):
    return {"scope": {"org_id": tenant.org_id, "play": PLAY, "run_id": run_id}, "epoch": epoch}


async def test_a_forged_run_is_refused_before_any_write(tenant, gateway, server):
    real = await runs.register(gateway, RunScope(tenant.org_id, PLAY, "real"))
    forged = RunRef(RunScope(tenant.org_id, PLAY, "forged"), 2**63 - 1)
    wrong_epoch = RunRef(real.scope, real.epoch + 1000)
    for ref in (forged, wrong_epoch):
        with pytest.raises(ConflictError, match="not registered|holds epoch"):
            await sheets.admit(gateway, ref, "t", CONTRACT, [{"name": "a"}, {"name": "b"}])
        with pytest.raises(ConflictError):
            await receipts.claim(gateway, ref, "k")
        with pytest.raises(ConflictError):
            await receipts.complete(gateway, ref, "k", {"v": 1})
    assert await count_rows(tenant, "work_receipts") == 0
    assert (await sheets.summary(tenant, PlayScope(tenant.org_id, PLAY), "t")).total == 0
    # The registered run writes as before, and nothing blocks its rows.
    admitted = await sheets.admit(gateway, real, "t", CONTRACT, [{"name": "a"}, {"name": "b"}])
    assert len(admitted.pending) == 2 and admitted.blocked == ()
    assert (await receipts.claim(gateway, real, "k")).disposition == "claimed"
    lookups = server.run_check.lookups
    await receipts.claim(gateway, real, "k2")
    assert server.run_check.lookups == lookups  # a registered run's epoch is remembered


async def test_a_run_registered_through_the_gateway_is_never_looked_up(tenant, gateway, server):
    """Its registration's answer is remembered, by epoch and by scope alone: writing with its
    `RunRef` (a claim) and by its scope (staging's begin fact) reads nothing more."""
    from runplane.engine import array_input

    lookups = server.run_check.lookups
    ref = await runs.register(gateway, RunScope(tenant.org_id, PLAY, "fresh"))
    assert (await receipts.claim(gateway, ref, "k")).disposition == "claimed"
    scope = ref.scope.map("t", "map-0")
    await array_input.begin(gateway, scope, source_fingerprint="a" * 64, source_rows=1,
                            has_source_identities=False)
    assert server.run_check.lookups == lookups


async def test_a_reused_request_id_with_another_token_or_body_is_refused(tenant, server):
    run = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "r"))
    wide = token_for(tenant)
    narrow = token_for(tenant, actions=["receipts.*"])
    body = {"run": _run_body(tenant, "r", run.epoch), "key": "k"}
    async with httpx.AsyncClient() as client:
        first = await _post(client, server, "receipts.claim", body, wide, "id-1")
        assert first.status_code == 200 and first.json()["result"]["disposition"] == "claimed"
        again = await _post(client, server, "receipts.claim", body, wide, "id-1")
        assert again.json() == first.json()  # a retry of the same request: the first answer
        other = await _post(client, server, "receipts.claim", body, narrow, "id-1")
        assert other.status_code == 409 and other.json()["code"] == "conflict"

        r1 = {"run": _run_body(tenant, "r", run.epoch), "key": "r1", "output": {"v": 1}}
        r2 = {"run": _run_body(tenant, "r", run.epoch), "key": "r2", "output": {"v": 2}}
        done = await _post(client, server, "receipts.complete", r1, wide, "id-2")
        assert done.status_code == 200 and done.json()["result"]["key"] == "r1"
        reused = await _post(client, server, "receipts.complete", r2, wide, "id-2")
        assert reused.status_code == 409 and reused.json()["code"] == "conflict"
    assert await receipts.get(tenant, PlayScope(tenant.org_id, PLAY), "r2") is None
    assert server.replay.hits == 1 and server.replay.mismatches == 2


async def test_made_up_action_names_cost_nothing_lasting_and_forge_no_log_line(tenant, server):
    known = set(actions())
    async with httpx.AsyncClient() as client:
        token = token_for(tenant)
        for i in range(2000):
            headers = {"authorization": f"Bearer {token}"} if i % 2 else {}
            answer = await client.post(f"{server.url}/v1/actions/made-up-{i}-{'x' * 200}",
                                       json={}, headers=headers)
            assert answer.status_code in (400, 401)
        forged = await client.post(
            f"{server.url}/v1/actions/x%0Agateway: 1 requests (forged 1)%0A",
            json={}, headers={"authorization": f"Bearer {token}"})
        assert forged.status_code == 400
    assert set(server.requests) - known == {guards.UNKNOWN_ACTION}
    assert server.requests[guards.UNKNOWN_ACTION] == 2001
    line = server.take_period()
    assert line is not None and "\n" not in line and "forged" not in line and len(line) < 500


def test_printable_escapes_what_a_request_put_in_a_log_line():
    assert guards.printable("a\nb\r\x1b[31m") == "a\\nb\\r\\x1b[31m"
    assert len(guards.printable("y" * 10_000)) == guards.LOG_TEXT_CHARS + 3


async def test_a_small_read_completes_while_a_large_admission_is_decoded(tenant, server, monkeypatch):
    """The large body's decoding is held (by events) until the small read has answered: were
    the decoding on the event loop, the read could not answer and the test would hang until
    its fail-safe cancels it."""
    run = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "big"))
    rows = [{"name": f"row-{i}-" + "z" * 100} for i in range(2000)]
    started, release = threading.Event(), threading.Event()
    decode = server_module.decode_body

    def held(spec, raw):
        if spec.name == "sheets.admit":
            started.set()
            assert release.wait(30), "the small read never answered"
        return decode(spec, raw)

    monkeypatch.setattr(server_module, "decode_body", held)
    token = token_for(tenant)
    results = {}

    async def admit_big():
        async with open_gateway(server.url, token, retry=FAST_RETRY) as gw:
            results["admitted"] = await sheets.admit(gw, run, "t", CONTRACT, rows)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admit_big)
            await trio.to_thread.run_sync(started.wait)
            async with open_gateway(server.url, token, retry=FAST_RETRY) as gw:
                results["read"] = await runs.get(gw, run.scope)
            assert "admitted" not in results  # the admission was still being decoded
            release.set()
    assert results["read"].epoch == run.epoch
    assert len(results["admitted"].pending) == 2000


async def test_texts_that_disagree_with_the_rows_are_not_stored(tenant, server):
    """The input cells stored are the rows' own canonical texts, whatever `texts` says."""
    run = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "texts"))
    body = {"run": _run_body(tenant, "texts", run.epoch), "table_namespace": "t",
            "contract": {"inputs": ["name"], "outputs": ["upper"]},
            "rows": [{"name": "a"}, {"name": "b"}, {"name": "a"}], "keys": ["k1", "k2", "k1"],
            "texts": ['{"name":"evil"}', '{"name":"worse"}', '{"name":"evil"}']}
    async with httpx.AsyncClient() as client:
        answer = await _post(client, server, "sheets.admit", body, token_for(tenant))
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"]["skipped"] == 1  # the duplicate key still counts as skipped
    stored = await sheets.read_rows(tenant, PlayScope(tenant.org_id, PLAY), "t")
    assert sorted((row["_key"], row["name"]) for row in stored) == [("k1", "a"), ("k2", "b")]


async def test_reading_a_page_of_an_unsealed_input_is_a_conflict(tenant, gateway):
    from runplane.engine import MapScope, array_input

    from .array_input_support import occurrences, stage

    run = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "unsealed"))
    scope = MapScope(tenant.org_id, PLAY, run.run_id, "t", "map-1")
    await stage(tenant, scope, occurrences(3), seal=False)
    with pytest.raises(ConflictError, match="not sealed"):
        await array_input.read_page(gateway, scope, 0)


@pytest.mark.parametrize("text", [
    "[" * 5000 + "]" * 5000,
    '{"scope": ' * 2000 + "1" + "}" * 2000,
    '{"scope": {"org_id": "org-test", "play": "p"}, "epoch": NaN}',
    '{"scope": {"org_id": "org-test", "play": "p"}, "epoch": 9223372036854775808}',
    '{"scope": {"org_id": "org-test", "play": "p"}, "epoch": 1e999}',
])
async def test_hostile_json_is_a_400(tenant, server, text):
    async with httpx.AsyncClient() as client:
        answer = await client.post(
            f"{server.url}/v1/actions/runs.by_epoch", content=text.encode(),
            headers={"authorization": f"Bearer {token_for(tenant)}"})
    assert answer.status_code == 400 and answer.json()["code"] == "invalid_input", answer.text


async def test_a_write_for_a_run_never_registered_is_refused(tenant, gateway):
    from runplane.engine import array_input
    from runplane.engine.runs import outbox

    ghost = RunScope(tenant.org_id, PLAY, "ghost")
    with pytest.raises(ConflictError, match="not registered"):
        await outbox.record_open(gateway, ghost)
    with pytest.raises(ConflictError, match="not registered"):
        await array_input.begin(gateway, ghost.map("t", "m"), source_fingerprint="f" * 64,
                                source_rows=1, has_source_identities=False)
    assert await count_rows(tenant, "work_receipts") == 0
    assert await count_rows(tenant, "terminal_outbox") == 0
    assert await outbox.get(gateway, ghost) is None  # a read of it is still answered
