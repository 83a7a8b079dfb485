"""Every malformed body is a 4xx, never a 500, and writes nothing: a deterministic walk of every
registered action with hostile values in every field.

The walk starts from real bodies: a map, the operators' reads and the runners' steps go through
a gateway once while the server keeps the first body of each action (a few actions no workload
sends are written out below). Then every value in every body (every field; of a list, its
first two items) is replaced, one at a time, by each hostile value:
- `ALWAYS_REFUSED` (raw NaN and Infinity, a number past a float, nesting past the decoder,
  integers past int64, a lone surrogate, 1e308): no field takes them outside user data, so each
  must answer 4xx, and the tenant's tables (their contents hashed) and the database's roles are
  the same after the whole walk as before it;
- `EDGES` (past int32, NUL, an empty string, a wrong type): a field may take them, so each must
  answer anything but a 5xx (user data gets these only).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
import uuid

import httpx
import trio

from runplane.actors import open_run
from runplane.actors.shared.worker import WorkerOptions, serve_play

from runplane.engine import PlayScope, RunScope, array_input, receipts, runs, sheets
from runplane.engine.runs import cancel, history, outages, outbox, retry_spec, row_calls
from runplane.engine.limits import rates as rate_limits
from runplane.engine.shared import leases as shared_leases, maps as shared_maps
from runplane.engine.actions import actions
from runplane.engine.gateway import open_gateway, server as server_module

from .gateway_support import FAST_RETRY, server, token_for  # noqa: F401
from .plays.scale_play import noop

PLAY = "fuzz-play"
CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("upper",))
MAX_PATHS = 60
NESTED = "[" * 1200 + "]" * 1200
ALWAYS_REFUSED = ("NaN", "Infinity", "-Infinity", "1e400", NESTED, str(2**63),
                  str(-(2**63) - 1), str(2**64), json.dumps("x\ud800"), "1e308")
EDGES = (str(2**31), str(-(2**31) - 1), json.dumps("a\x00b"), json.dumps(""), "true", "{}", "[]")
# Fields holding user data (rows, outputs, pages, a runner's public key): anything JSON is
# theirs, so they only get the edges.
USER_DATA = ("rows", "output", "outputs", "config", "outcomes.*.data", "outcomes.*.cell_meta", "page", "public_key")
SHARED_PLAY = str(Path(__file__).parent / "plays" / "scale_play.py")
HANDWRITTEN = {  # actions no workload below sends
    "db_sessions.create": {"play": PLAY, "table_namespace": "things",
                           "operations": ["rows.read"], "ttl_s": 60.0,
                           "limits": {"max_rows": 10_000}},
}


async def _workload(tenant, gw) -> None:
    scope = PlayScope(tenant.org_id, PLAY)

    async def enrich(row):
        if row["n"] % 5 == 2:
            raise ValueError("no")
        return {"upper": row["name"].upper()}

    async with open_run(gw, PLAY) as run:
        await run.map("things", [{"name": f"r{i}", "n": i} for i in range(30)], enrich,
                      contract=CONTRACT, concurrency=4)
    ref = await runs.register(gw, RunScope(tenant.org_id, PLAY, "manual"))
    await runs.get(gw, ref.scope)
    await runs.by_epoch(gw, scope, ref.epoch)
    await runs.list_runs(gw, scope, limit=5)
    await row_calls.report(gw, ref.scope, "map-0", "host:1:ab", "things", 2)
    await row_calls.running(gw, scope)
    await runs.record_command(gw, ref.scope, "runplane run x")
    await cancel.cancel_requested(gw, ref.scope)
    await cancel.request_cancel(gw, ref.scope)
    await retry_spec.retry_spec(gw, scope, "things")
    await retry_spec.retry_spec(gw, scope, "things", force=True)
    await outages.record_outages(gw, ref.scope, [outages.Outage(
        datetime.datetime.now(datetime.timezone.utc), 1.5)])
    await receipts.claim(gw, ref, "k1")
    await receipts.complete(gw, ref, "k1", {"v": 1})
    await receipts.skip(gw, ref, "k2", {"v": 2})
    await receipts.fail(gw, ref, "k3", "boom")
    await receipts.get(gw, scope, "k1")
    await receipts.get_many(gw, scope, ["k1", "k2"])
    admitted = await sheets.admit(gw, ref, "manual", CONTRACT, [{"name": "a", "n": 1}],
                                  give_up_after=3, input_indexes=[0],
                                  attempt=sheets.Attempt("att", 1, 30.0))
    await sheets.probe(gw, ref, "manual", CONTRACT, [{"name": "a", "n": 1}])
    await sheets.complete(gw, ref, "manual", CONTRACT, [
        sheets.RowOutcome(row.key, "failed", None, row.input_index, None, "bad", 1)
        for row in admitted.pending], attempt=sheets.Attempt("att", 1, 30.0))
    await sheets.read_rows(gw, scope, "things", limit=5)
    await sheets.summary(gw, scope, "things")
    await sheets.summaries(gw, scope)
    await sheets.failed_rows(gw, scope, "things", limit=5)
    await sheets.error_counts(gw, scope, "things", limit=5)
    await sheets.run_rows(gw, scope, "things", [ref.run_id])
    await sheets.ensure_sheet(gw, scope, "things", CONTRACT)
    await outbox.record_open(gw, ref.scope)
    await outbox.mark_pending(gw, ref.scope, "me", 30.0)
    await outbox.claim_due(gw, "me", limit=5, lease_s=30.0, abandon_after_s=60.0)
    await outbox.renew(gw, ref.scope, "me", 30.0)
    await outbox.retry_later(gw, ref.scope, "me", "later", 1.0)
    await outbox.release(gw, ref.scope, "me")
    await outbox.mark_done(gw, ref.scope, "me")
    await outbox.get(gw, ref.scope)
    await outbox.get_many(gw, scope, [ref.run_id])
    await rate_limits.lease(gw, tenant.org_id, "bucket", per_second=1.0, burst=5.0, want=1)
    await receipts.complete_many(gw, ref, {"k4": {"v": 4}})
    await receipts.claim(gw, ref, "k5")
    await receipts.release(gw, ref, ["k5"])
    await sheets.append_rows(gw, ref, "appended", CONTRACT, [{"name": "a", "n": 1}],
                             idempotency_key="i1")
    await sheets.replace_rows(gw, ref, "replaced", CONTRACT, [{"name": "b", "n": 2}])
    await sheets.count(gw, scope, "things", status="failed", run_id=ref.run_id)
    await sheets.field_kinds(gw, scope, "things", fields=["upper"])
    page = await sheets.read_page(gw, scope, "things", limit=5, fields=["upper"])
    await sheets.read_page(gw, scope, "things", after=page.after, limit=5, status="enriched")
    await sheets.record_reuse(gw, ref, "things", [admitted.pending[0].key])
    await history.list_maps(gw, scope, [ref.run_id])
    await history.live_maps(gw, scope)
    # A shared map served by a worker through the gateway: the unit-lease actions.
    async with open_run(gw, PLAY) as run:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_play(gw, PLAY, SHARED_PLAY, WorkerOptions(
                exit_when_idle=True, poll_s=0.05)))
            await run.map("shared", [{"name": f"s{i}", "n": i} for i in range(20)], noop,
                          contract=CONTRACT, shared=True)
        await shared_maps.live_maps(gw, PLAY)
        await shared_maps.workers(gw, PLAY)
        await shared_maps.units_remaining(gw, PLAY)
        await shared_maps.workers_joined(gw, run.ref, "map-0")
        await shared_maps.map_status(gw, run.ref, "map-0", counters=True)
        await shared_leases.renew(gw, run.ref, "map-0", "gone-worker", [])
    await array_input.retire(gw, ref.scope)  # a run's own close uses `retire_entry`


def _paths(value, prefix=()):
    """Every position in a JSON value (containers too), outermost first."""
    yield prefix
    if type(value) is dict:
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif type(value) is list:
        for i, item in enumerate(value[:2]):
            yield from _paths(item, prefix + (i,))


def _is_user_data(path) -> bool:
    shape = ".".join("*" if type(part) is int else str(part) for part in path)
    return any(shape == field or shape.startswith(field + ".") for field in USER_DATA)


def _with(body, path, marker):
    if not path:
        return marker
    copy = json.loads(json.dumps(body))
    target = copy
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = marker
    return copy


def _cases(bodies):
    """(action, body text, must be refused) for every hostile value at every position."""
    marker = "@@HOSTILE@@"
    for name in sorted(bodies):
        body = bodies[name]
        paths = list(_paths(body))[1:]
        assert len(paths) <= MAX_PATHS, f"{name}: raise MAX_PATHS to walk all {len(paths)} fields"
        for path in paths:
            text = json.dumps(_with(body, path, marker))
            user = _is_user_data(path)
            for value in ALWAYS_REFUSED + EDGES:
                refused = value in ALWAYS_REFUSED and not user
                if user and value in ALWAYS_REFUSED and value not in (NESTED, "NaN", "Infinity"):
                    continue  # user data may hold any JSON number or string
                yield name, text.replace(json.dumps(marker), value), refused


async def _state(tenant) -> list:
    async with tenant.connection("receipts") as conn:
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY 1", tenant.schema)
        state = [await conn.fetchval("SELECT count(*) FROM pg_roles")]
        for row in tables:
            name = f'"{tenant.schema}"."{row["tablename"]}"'
            state.append((row["tablename"], await conn.fetchval(
                f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM {name} t")))
    return state


async def test_every_action_with_hostile_values_in_every_field_is_a_4xx(tenant, server, monkeypatch):
    bodies: dict[str, dict] = dict(HANDWRITTEN)
    decode = server_module.decode_body

    def keep(spec, raw):
        if spec.name not in bodies and len(raw) < 20_000:
            bodies[spec.name] = json.loads(raw)
        return decode(spec, raw)

    monkeypatch.setattr(server_module, "decode_body", keep)
    async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
        await _workload(tenant, gw)
    monkeypatch.setattr(server_module, "decode_body", decode)
    # the map staged its one-page list in one call (begun, put and sealed): the others are alike
    one_page = bodies["array_input.put_and_seal"]
    assert one_page["has_source_identities"] is False
    bodies.setdefault("array_input.begin", {
        "scope": one_page["scope"], "source_fingerprint": one_page["source_fingerprint"],
        "source_rows": one_page["source_rows"], "has_source_identities": False})
    bodies.setdefault("array_input.read_page", {"scope": one_page["scope"], "ordinal": 0})
    bodies.setdefault("array_input.put_page", {
        "scope": one_page["scope"], "source_fingerprint": one_page["source_fingerprint"],
        "ordinal": 0, "offset": 0, "rows": [{"data": {"name": "r0", "n": 0}}]})
    bodies.setdefault("array_input.put_encoded_page", {
        "scope": one_page["scope"], "source_fingerprint": one_page["source_fingerprint"],
        "ordinal": 0, "offset": 0, "page": one_page["page"]})
    bodies.setdefault("array_input.seal", {
        "scope": one_page["scope"], "source_fingerprint": one_page["source_fingerprint"],
        "source_rows": one_page["source_rows"], "page_count": 1, "batch_size": 1})
    assert set(bodies) == set(actions()), sorted(set(actions()) - set(bodies))

    cases = list(_cases(bodies))
    assert len(cases) > 3000
    headers = {"authorization": f"Bearer {token_for(tenant)}", "content-type": "application/json"}
    before = await _state(tenant)
    failures = []
    async with httpx.AsyncClient(timeout=60) as client:
        for refused_only in (True, False):
            for name, text, refused in cases:
                if refused != refused_only:
                    continue
                answer = await client.post(
                    f"{server.url}/v1/actions/{name}", content=text.encode("utf-8", "surrogatepass"),
                    headers={**headers, "runplane-request-id": uuid.uuid4().hex})
                if answer.status_code >= 500 or (refused and not 400 <= answer.status_code < 500):
                    failures.append((name, answer.status_code, text[:160], answer.text[:200]))
            if refused_only:
                assert await _state(tenant) == before, "a refused request wrote something"
    assert failures == [], f"{len(failures)} bad answers, e.g. {failures[:15]}"
