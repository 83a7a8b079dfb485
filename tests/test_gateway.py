"""The gateway: actions over HTTP give what direct calls give; tokens are checked before any
query; the registry is one list both sides use."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import time

import httpx
import jwt
import pytest

from runplane import engine
from runplane.engine import PlayScope, RunRef, RunScope, array_input, receipts, runs
from runplane.engine.runs import outbox
from runplane.engine.actions import RemotePort, actions
from runplane.engine.errors import AuthError, InvalidInputError, ScopeError
from runplane.engine.gateway import mint_token, open_gateway, protocol, verify_token

from .gateway_support import FAST_RETRY, SECRET, count_rows, gateway, server, serving, token_for  # noqa: F401

PLAY = "gw-play"


async def test_receipts_through_the_gateway_equal_direct(tenant, gateway):
    direct_run = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "direct"))
    remote_run = await runs.register(gateway, RunScope(tenant.org_id, PLAY, "remote"))
    assert remote_run.epoch > direct_run.epoch
    assert await runs.register(gateway, remote_run.scope) == remote_run  # a wake
    for port, run in ((tenant, direct_run), (gateway, remote_run)):
        key = f"k-{run.run_id}"
        claim = await receipts.claim(port, run, key)
        assert claim.disposition == "claimed"
        assert (await receipts.claim(port, run, key)).disposition == "running"
        done = await receipts.complete(port, run, key, {"n": 1.0, "s": "x\x00"})
        assert done.output == {"n": 1, "s": "x\ufffd"} and done.status == "completed"
        assert (await receipts.claim(port, run, key)).disposition == "reused"
        failed = await receipts.fail(port, run, key, "late")
        assert failed.status == "completed"  # fail never overwrites completed
        skipped = await receipts.skip(port, run, f"s-{run.run_id}")
        assert skipped.status == "skipped" and skipped.output is None
    scope = PlayScope(tenant.org_id, PLAY)
    keys = ["k-direct", "k-remote", "missing", "k-direct"]
    assert await receipts.get_many(gateway, scope, keys) == await receipts.get_many(tenant, scope, keys)
    assert list(await receipts.get_many(gateway, scope, keys)) == ["k-direct", "k-remote", "missing"]
    assert await receipts.get(gateway, scope, "missing") is None
    # The older run is fenced by the newer one's receipt, through the gateway too.
    claim = await receipts.claim(gateway, direct_run, "k-remote")
    assert claim.disposition == "reused"


async def test_the_operators_reads_through_the_gateway_equal_direct(tenant, gateway):
    from runplane.engine.runs import outbox
    from runplane.engine import sheets

    run = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "r1"))
    await outbox.record_open(tenant, run.scope)
    contract = sheets.SheetContract(inputs=("name",), outputs=("score",))
    await sheets.admit(tenant, run, "people", contract, [{"name": "a"}])
    scope = PlayScope(tenant.org_id, PLAY)
    listed = await runs.list_runs(gateway, scope)
    assert listed == await runs.list_runs(tenant, scope) and [i.ref for i in listed] == [run]
    assert await runs.get(gateway, run.scope) == listed[0]
    assert await runs.get(gateway, RunScope(tenant.org_id, PLAY, "missing")) is None
    entries = await outbox.get_many(gateway, scope, ["r1", "missing"])
    assert entries == await outbox.get_many(tenant, scope, ["r1"]) and entries["r1"].state == "open"
    summaries = await sheets.summaries(gateway, scope)
    assert summaries == await sheets.summaries(tenant, scope) and summaries["people"].queued == 1


async def test_bad_input_raises_the_direct_error_and_writes_nothing(tenant, gateway, server):
    run = await runs.register(gateway, RunScope(tenant.org_id, PLAY, "r"))
    for port in (tenant, gateway):
        with pytest.raises(InvalidInputError, match="key must have 1 to 1024"):
            await receipts.claim(port, run, "")
        with pytest.raises(InvalidInputError, match="output"):
            await receipts.complete(port, run, "k", {"when": object()})
        with pytest.raises(ScopeError):
            await receipts.claim(port, RunRef(RunScope("other-org", PLAY, "r"), run.epoch), "k")
    assert await count_rows(tenant, "work_receipts") == 0
    assert server.errors["scope_denied"] == 1  # the other org reached the server, and stopped there


def expired_token(org: str) -> str:
    now = int(time.time())
    return jwt.encode({"org": org, "plays": ["*"], "actions": ["*"], "iat": now - 100,
                       "exp": now - 10, "jti": "j"}, SECRET, algorithm="HS256")


async def test_every_token_refusal_comes_before_any_query(tenant, server):
    scope = RunScope(tenant.org_id, PLAY, "r")
    refusals = [
        (None, AuthError, "missing bearer token"),
        ("not-a-jwt", AuthError, "not a JWT"),
        (mint_token("another-secret-" + "y" * 30, tenant.org_id), AuthError, "invalid token"),
        (expired_token(tenant.org_id), AuthError, "expired"),
        (token_for(tenant, actions=["receipts.*"]), ScopeError, "actions claim"),
        (token_for(tenant, plays=["another-play"]), ScopeError, "plays claim"),
        (mint_token(SECRET, "another-org"), ScopeError, "org claim"),
    ]
    for token, error, message in refusals:
        if token is None:
            async with httpx.AsyncClient() as client:
                answer = await client.post(f"{server.url}/v1/actions/runs.register", json={
                    "scope": {"org_id": scope.org_id, "play": PLAY, "run_id": "r"}})
            assert answer.status_code == 401 and answer.json()["code"] == "unauthenticated"
            continue
        with pytest.raises(error, match=message) as raised:
            async with open_gateway(server.url, token, retry=FAST_RETRY) as gateway:
                await runs.register(gateway, scope)
        assert token not in str(raised.value)
    assert server.errors["unauthenticated"] == 3 and server.errors["scope_denied"] == 3
    assert await count_rows(tenant, "runs") == 0


async def test_a_token_allows_exactly_its_claims(tenant, server):
    token = token_for(tenant, plays=[PLAY], actions=["runs.register", "receipts.claim"])
    claims = verify_token(SECRET, token)
    assert claims.org == tenant.org_id and claims.plays == (PLAY,) and claims.exp > claims.iat
    async with open_gateway(server.url, token, retry=FAST_RETRY) as gateway:
        run = await runs.register(gateway, RunScope(tenant.org_id, PLAY, "r"))
        assert (await receipts.claim(gateway, run, "k")).disposition == "claimed"
        with pytest.raises(ScopeError, match="actions claim does not allow receipts.complete"):
            await receipts.complete(gateway, run, "k", {})
    assert (await receipts.get(tenant, PlayScope(tenant.org_id, PLAY), "k")).status == "running"


async def test_retire_entry_records_the_entry_only_for_a_token_that_may(tenant, server):
    """`retire_entry` with `record_lease_s` also does what `outbox.mark_pending` does: a token
    whose actions claim leaves that out is refused it, before anything is written; one that
    allows it records and retires the run's entry in one request."""
    scope = RunScope(tenant.org_id, PLAY, "closing")
    narrow = token_for(tenant, actions=["runs.register", "array_input.retire_entry"])
    async with open_gateway(server.url, narrow, retry=FAST_RETRY) as gateway:
        await runs.register(gateway, scope)
        with pytest.raises(ScopeError, match="does not allow outbox.mark_pending"):
            await array_input.retire_entry(gateway, scope, "me", record_lease_s=30.0)
        assert (await array_input.retire_entry(gateway, scope, "me")).done  # no entry to settle
    assert (await outbox.get(tenant, scope)).state == "open"
    async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
        result = await array_input.retire_entry(gateway, scope, "me", record_lease_s=30.0)
        assert (result.done, result.settled) == (True, True)
        again = await array_input.retire_entry(gateway, scope, "other", record_lease_s=30.0)
        assert (again.done, again.deleted, again.settled) == (True, 0, True)  # done already
    assert (await outbox.get(tenant, scope)).state == "done"


async def test_unknown_actions_health_and_bodies_over_the_limit(tenant):
    async with serving(tenant, body_limit=20_000) as server:
        headers = {"authorization": f"Bearer {token_for(tenant)}"}
        async with httpx.AsyncClient() as client:
            health = (await client.get(f"{server.url}/v1/health")).json()
            assert health["ok"] is True and health["body_limit"] == 20_000
            assert health["array_actions"] is True
            assert health["features"] == list(protocol.FEATURES + protocol.ARRAY_FEATURES)
            unknown = await client.post(f"{server.url}/v1/actions/nope.nothing", json={},
                                        headers=headers)
            assert unknown.status_code == 400
            assert unknown.json() == {"error": "Unsupported action: nope.nothing",
                                      "code": "unsupported_action", "action": "nope.nothing"}
            big = {"scope": {"org_id": tenant.org_id, "play": PLAY, "run_id": "x" * 30_000}}
            refused = await client.post(f"{server.url}/v1/actions/runs.register", json=big,
                                        headers=headers)
            assert refused.status_code == 413 and refused.json()["code"] == "body_too_large"
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
            run = await runs.register(gateway, RunScope(tenant.org_id, PLAY, "small"))
            with pytest.raises(InvalidInputError, match="at most 20000 bytes"):
                await receipts.complete(gateway, run, "k", {"blob": "x" * 30_000})
        assert 0 < server.max_body_bytes < 20_000
    assert await count_rows(tenant, "runs") == 1
    assert await count_rows(tenant, "work_receipts") == 0


async def test_a_clients_first_action_brings_the_gateways_health_back(tenant):
    """A client's first action, when its body fits any gateway's limit, asks for the health
    answer (`protocol.HEALTH_HEADER`) and the gateway sends it with the action's 200: the client
    never reads `GET /v1/health` (one round trip less for every runner and command). A first
    action larger than that reads it first, so the body limit is checked before sending."""
    async with serving(tenant, body_limit=20_000) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
            run = await runs.register(gateway, RunScope(tenant.org_id, PLAY, "asks"))
            assert gateway.stats.answered_attempts == 1  # the action alone
            health = await gateway.health()
            assert gateway.stats.answered_attempts == 1  # learned from the action's answer
            assert health.body_limit == 20_000 and health.array_actions
            assert health.features == frozenset(protocol.FEATURES + protocol.ARRAY_FEATURES)
        assert (await receipts.claim(tenant, run, "big")).disposition == "claimed"
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
            blob = "x" * protocol.MIN_BODY_LIMIT
            done = await receipts.complete(gateway, run, "big", {"blob": blob})
            assert done.status == "completed"
            assert gateway.stats.answered_attempts == 2  # the health read, then the action


async def test_a_gateways_orgs_after_the_first_open_without_a_statement(tenant, server):
    """The first org's tenant reads the schema's state and the server's identity; the orgs
    after it take what it read (`SharedOpening`) and send no statement as they open, with the
    same lock secret, and map through the gateway as the first does."""
    from runplane.actors import open_run
    from runplane.engine import sheets
    from runplane.engine.observability import metrics

    def sent() -> int:
        return sum(sum(h.counts) for h in metrics.STATEMENT_SECONDS.children.values())

    async def shout(row):
        return {"upper": row["name"].upper()}

    opened, statements = [], []
    for org in ("shared-first", "shared-second", "shared-third"):
        before = sent()
        opened.append(await server.tenants.get(org))
        statements.append(sent() - before)
    assert statements[0] >= 3 and statements[1:] == [0, 0]  # the schema's state, the server's
    assert {t.lock_secret for t in opened} == {tenant.lock_secret}
    assert {t.server_identity for t in opened} == {opened[0].server_identity} != {None}
    contract = sheets.SheetContract(inputs=("name",), outputs=("upper",))
    async with open_gateway(server.url, mint_token(SECRET, "shared-third"),
                            retry=FAST_RETRY) as gateway:
        async with open_run(gateway, PLAY) as run:
            result = await run.map("t", [{"name": f"r{i}"} for i in range(30)], shout,
                                   contract=contract)
    assert result.completed == 30


# Plumbing that takes a port but is no operation of its own: the statement and transaction
# helpers the operations run through.
NOT_OPERATIONS = {
    # DDL an operator runs with the schema owner's login (`runplane index`), no runtime action
    "runplane.engine.sheets.field_index.create_field_index",
    # picks one of two actions (`maps.retry_failed`, `maps.force`) by the retry's kind
    "runplane.engine.runs.retry_spec.retry_spec",
    "runplane.engine.array_input.facts.run_statement",
    "runplane.engine.sheets.sheet_txn.run_sheet_transaction",
    "runplane.engine.sheets.admission.admit_prepared",  # the write modes' shared admission
    "runplane.engine.sheets.probing.probe_keyed",  # `sheets.probe` (an action) and its keys
    "runplane.engine.sheets.admission.admit_write",  # `sheets.admit` (an action) of a SheetWrite
    "runplane.engine.sheets.completion.complete_write",  # `sheets.complete` of a SheetWrite
    # recorded lists: a shortcut of direct ports; through a gateway a rerun probes (the
    # ordinary path), so no capability is missing there
    "runplane.engine.sheets.lists.replay_list",
    "runplane.engine.sheets.lists.record_list",
    "runplane.engine.sheets.lists.fold_deltas",  # before a list is recorded
    # only a `workers=N` coordinator, which needs a direct connection, starts worker processes
    "runplane.engine.shared.leases.release_process",
    # `runplane psql` / `views` / `sql`: views are made in the database psql connects to
    "runplane.engine.sheets.views.read_sheets",
    "runplane.engine.sheets.views.sync_views",
}


def _engine_operations():
    """Every public async function of the engine whose first parameter is a port."""
    found = {}
    for info in pkgutil.walk_packages(engine.__path__, "runplane.engine."):
        # the gateway and the web console serve actions and pages; they are not operations
        if ".gateway" in info.name or ".console" in info.name \
                or info.name.endswith((".pg", ".tenant", ".ports")):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.startswith("_") or not inspect.iscoroutinefunction(value):
                continue
            if getattr(value, "__module__", None) != module.__name__:
                continue
            parameters = list(inspect.signature(value).parameters)
            if parameters and parameters[0] == "port" \
                    and f"{module.__name__}.{name}" not in NOT_OPERATIONS:
                found[f"{module.__name__}.{name}"] = value
    return found


async def test_the_registry_walk_every_operation_is_an_action_on_both_sides(tenant, server):
    registry = actions()
    operations = _engine_operations()
    assert operations, "the walk found no engine operations"
    missing = [name for name, fn in operations.items() if not hasattr(fn, "action")]
    assert missing == [], f"engine operations that are no action: {missing}"
    assert {fn.action.name for fn in operations.values()} == set(registry)

    class Recorder(RemotePort):
        org_id = tenant.org_id

        async def send_action(self, action, args, kwargs):
            return action

    headers = {"authorization": f"Bearer {token_for(tenant)}"}
    async with httpx.AsyncClient() as client:
        for name, action in registry.items():
            # The client side: the routed function hands itself to a remote port ...
            routed = getattr(importlib.import_module(action.function.__module__),
                             action.function.__name__)
            parameters = list(action.signature.parameters.values())[1:]
            args = [None] * sum(1 for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD
                                and p.default is p.empty)
            assert await routed(Recorder(), *args) is action
            # ... and the server dispatches it: an empty input is refused as invalid input,
            # never as an unsupported action.
            answer = await client.post(f"{server.url}/v1/actions/{name}", json={}, headers=headers)
            assert answer.status_code == 400 and answer.json()["code"] == "invalid_input", name
    assert set(server.requests) == set(registry)


async def test_actions_keep_the_connection_open_and_answer_json(tenant, server):
    """Action answers come from the lean handler: JSON with its length, and the runner's
    connection stays open from one action to the next (one local port for every request)."""
    headers = {"authorization": f"Bearer {token_for(tenant)}"}
    scope = {"scope": {"org_id": tenant.org_id, "play": PLAY}, "key": "k"}
    ports = set()
    async with httpx.AsyncClient() as client:
        for _ in range(5):
            answer = await client.post(f"{server.url}/v1/actions/receipts.get", json=scope,
                                       headers=headers)
            assert answer.status_code == 200 and answer.json() == {"result": None}
            assert answer.headers["content-type"] == "application/json"
            assert int(answer.headers["content-length"]) == len(answer.content)
            assert answer.headers.get("connection", "").lower() != "close"
            ports.add(answer.extensions["network_stream"].get_extra_info("client_addr")[1])
        refused = await client.post(f"{server.url}/v1/actions/receipts.get", json=scope)
        assert refused.status_code == 401 and refused.json()["code"] == "unauthenticated"
        ports.add(refused.extensions["network_stream"].get_extra_info("client_addr")[1])
        assert (await client.get(f"{server.url}/v1/actions/receipts.get")).status_code == 405
    assert len(ports) == 1
    assert server.requests["receipts.get"] == 6
