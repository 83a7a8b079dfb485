"""The client's retry budgets against real network faults (a TCP proxy) and stub servers."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from runplane.engine import PlayScope, RunRef, RunScope, receipts, runs, sheets
from runplane.engine.errors import (
    GatewayUnavailableError, InvalidInputError, StoreUnavailableError, TransactionStateUnknownError,
)
from runplane.engine.gateway import RetryPolicy, open_gateway
from runplane.engine.gateway.retry import answered_wait
from runplane.engine.gateway.protocol import retry_after_s
from runplane.simulations.network import open_proxy

from .gateway_support import FAST_RETRY, gateway, server, token_for  # noqa: F401
from .sheet_helpers import counters_match

PLAY = "retries"
CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))


async def wait_until(predicate) -> None:
    with trio.fail_after(30):
        while not predicate():
            await trio.sleep(0.01)


async def test_a_network_cut_waits_and_then_succeeds_spending_no_answered_attempt(tenant, server):
    async with open_proxy(server.url) as proxy:
        async with open_gateway(proxy.url, token_for(tenant), retry=FAST_RETRY) as gw:
            run = await runs.register(gw, RunScope(tenant.org_id, PLAY, "r"))
            answered = gw.stats.answered_attempts
            proxy.cut()
            result = {}

            async def claim():
                result["claim"] = await receipts.claim(gw, run, "k")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(claim)
                await wait_until(lambda: gw.stats.unanswered_attempts >= 3)
                assert "claim" not in result
                proxy.restore()
            assert result["claim"].disposition == "claimed"
            assert gw.stats.answered_attempts == answered + 1
            assert proxy.fired["cut"] >= 2  # the first attempt lost its live connection


async def test_replies_lost_after_the_commit_apply_nothing_twice(tenant, server):
    async with open_proxy(server.url) as proxy:
        async with open_gateway(proxy.url, token_for(tenant), retry=FAST_RETRY) as gw:
            run = await runs.register(gw, RunScope(tenant.org_id, PLAY, "r"))
            proxy.plan[:] = ["drop_reply"]
            claim = await receipts.claim(gw, run, "k")
            assert claim.disposition == "claimed"  # the retry got the first answer, not "running"
            proxy.plan[:] = ["drop_reply"]
            done = await receipts.complete(gw, run, "k", {"v": 1})
            assert done.status == "completed" and done.output == {"v": 1}
            admitted = await sheets.admit(gw, run, "t", CONTRACT, [{"name": f"n{i}"} for i in range(50)])
            outcomes = [sheets.RowOutcome(row.key, "completed", {"upper": row.row["name"].upper()})
                        for row in admitted.pending]
            proxy.plan[:] = ["drop_reply"]
            completion = await sheets.complete(gw, run, "t", CONTRACT, outcomes)
            assert completion.updated == 50 and len(completion.committed_keys) == 50
            assert proxy.fired["drop_reply"] == 3
    assert server.replay.hits == 3
    scope = PlayScope(tenant.org_id, PLAY)
    summary = await sheets.summary(tenant, scope, "t")
    assert (summary.total, summary.completed, summary.queued) == (50, 50, 0)
    assert (await counters_match(tenant, scope, "t"))[0]


async def test_an_outage_past_the_unreachable_budget_names_the_budget_and_url(tenant, server):
    policy = RetryPolicy(answered_delays_s=(0.05,), unreachable_budget_s=0.5, min_answered_wait_s=0.0)
    token = token_for(tenant)
    async with open_proxy(server.url) as proxy:
        async with open_gateway(proxy.url, token, retry=policy) as gw:
            proxy.cut()
            with pytest.raises(GatewayUnavailableError) as raised:
                await runs.register(gw, RunScope(tenant.org_id, PLAY, "r"))
            assert gw.stats.answered_attempts == 0 and gw.stats.unanswered_attempts >= 2
    message = str(raised.value)
    assert "unreachable budget" in message and proxy.url in message and token not in message
    assert server.requests["runs.register"] == 0


@contextlib.asynccontextmanager
async def stub_gateway(status: int, payload: dict, headers=()):
    """A server whose health is fine and whose every action answers `status` with `payload`."""
    hits = {"actions": 0}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]  # startup / shutdown
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/v1/health":
            code, body = 200, {"ok": True, "version": "stub", "body_limit": 100_000,
                               "array_actions": True}
        else:
            hits["actions"] += 1
            code, body = status, payload
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.loglevel = "WARNING"
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, app, config))
        yield binds[0], hits
        nursery.cancel_scope.cancel()


LADDER = RetryPolicy(answered_delays_s=(0.01, 0.01, 0.01), unreachable_budget_s=5.0, min_answered_wait_s=0.0)


async def test_a_stub_answering_503_gets_exactly_the_ladder_plus_one_attempts(tenant):
    async with stub_gateway(503, {"error": "down", "code": "store_unavailable"}) as (url, hits):
        async with open_gateway(url, token_for(tenant), retry=LADDER) as gw:
            with pytest.raises(StoreUnavailableError) as raised:
                await runs.register(gw, RunScope(tenant.org_id, PLAY, "r"))
    assert hits["actions"] == 4
    assert "answered-attempt budget ran out after 4 attempts" in str(raised.value)
    assert url in str(raised.value)


@pytest.mark.parametrize("status, payload, error, attempts", [
    (400, {"error": "key must be a string", "code": "invalid_input"}, InvalidInputError, 1),
    (500, {"error": "rollback failed", "code": "transaction_state_unknown"},
     TransactionStateUnknownError, 1),
    (500, {"error": "connection reset by peer", "code": "internal"}, GatewayUnavailableError, 4),
    (502, {"error": "bad gateway"}, GatewayUnavailableError, 4),
])
async def test_what_a_stub_answer_is_retried_and_raised_as(tenant, status, payload, error, attempts):
    async with stub_gateway(status, payload) as (url, hits):
        async with open_gateway(url, token_for(tenant), retry=LADDER) as gw:
            with pytest.raises(error):
                await runs.register(gw, RunScope(tenant.org_id, PLAY, "r"))
    assert hits["actions"] == attempts


async def test_a_completion_stops_at_its_total_deadline(tenant):
    policy = RetryPolicy(answered_delays_s=(5.0, 5.0), completion_total_s=0.5)
    async with stub_gateway(503, {"error": "busy", "code": "store_unavailable"}) as (url, hits):
        async with open_gateway(url, token_for(tenant), retry=policy) as gw:
            run = RunRef(RunScope(tenant.org_id, PLAY, "r"), 1)
            outcome = sheets.RowOutcome("k", "completed", {"upper": "K"})
            with pytest.raises(GatewayUnavailableError, match="completion deadline of 0.5 s"):
                await sheets.complete(gw, run, "t", CONTRACT, [outcome])
    assert hits["actions"] == 1


def test_the_server_chosen_wait_is_read_from_the_body_or_the_header():
    assert retry_after_s({"retry_after_ms": 1500}, {}) == 1.5
    assert retry_after_s({}, {"retry-after": "2"}) == 2.0
    assert retry_after_s({}, {}) == 0.0


def test_an_answer_naming_no_wait_is_retried_after_at_least_the_floor():
    policy = RetryPolicy()  # ladder 0.25, 0.5, ... 8 s; floor 2 s
    assert answered_wait(policy, 1, None) == 2.0  # no retry_after: the floor, not the 0.25 step
    assert answered_wait(policy, 1, 0.5) == 0.5  # the server named a wait: its word
    assert answered_wait(policy, 1, 0.0) == 0.25  # ... never below the ladder's step
    assert answered_wait(policy, 6, None) == 8.0  # a longer step wins over the floor
    assert answered_wait(policy, 1, 3.0) == 3.0
    assert answered_wait(RetryPolicy(min_answered_wait_s=0.0), 1, None) == 0.25
    assert retry_after_s({}, {}, None) is None and retry_after_s({"retry_after_ms": 0}, {}, None) == 0.0
    with pytest.raises(InvalidInputError, match="min_answered_wait_s"):
        RetryPolicy(min_answered_wait_s=-1)


@pytest.mark.parametrize("floor,hits,error,message", [
    (2.0, 1, GatewayUnavailableError, "completion deadline"),
    (0.0, 2, StoreUnavailableError, "answered-attempt budget")])
async def test_the_client_waits_the_floor_after_an_answer_naming_no_wait(tenant, floor, hits, error,
                                                                           message):
    # a 1 s completion deadline: a 2 s wait cannot fit in it, a 0.01 s one can (then the
    # one-step ladder is spent)
    policy = RetryPolicy(answered_delays_s=(0.01,), completion_total_s=1.0, min_answered_wait_s=floor)
    async with stub_gateway(503, {"error": "busy", "code": "store_unavailable"}) as (url, seen):
        async with open_gateway(url, token_for(tenant), retry=policy) as gw:
            run = RunRef(RunScope(tenant.org_id, PLAY, "r"), 1)
            outcome = sheets.RowOutcome("k", "completed", {"upper": "K"})
            with pytest.raises(error, match=message):
                await sheets.complete(gw, run, "t", CONTRACT, [outcome])
    assert seen["actions"] == hits
