"""A server's connection budget (SPEC §35): one fair line across orgs, idle connections given
back, waits within the caller's deadline; a connect refused for too many clients (53300) is an
outage to ride; a gateway 503 naming a wait is ridden outside the answered-attempt ladder."""

from __future__ import annotations

import socket
import types
import urllib.parse
import uuid

import pytest
import trio

from runplane.engine import RunScope, open_tenant, runs
from runplane.engine.opening import open_reader
from runplane.engine.errors import (
    GatewayUnavailableError, InvalidInputError, StoreUnavailableError, TenantUnreachableError,
)
from runplane.engine.gateway import RetryPolicy, ServerOptions, open_gateway
from runplane.engine.gateway.retry import Attempted, RetryState, decide
from runplane.engine.limits.connections import ServerBudget, hosting
from runplane.engine.limits.server_share import (
    PER_CORE, ServerConnections, default_size, local_cores, read_server_connections, server_budget,
)
from runplane.engine.pg import reached_locally
from runplane.engine.sessions.limits import SESSION_CONNECTION_LIMIT, sessions_per_server

from .gateway_support import FAST_RETRY, serving, token_for
from .test_gateway_retries import stub_gateway


async def wait_until(predicate) -> None:
    with trio.fail_after(30):
        while not predicate():
            await trio.sleep(0.01)


# -- the line, without a database ------------------------------------------------------------
async def test_an_org_holding_none_goes_before_orgs_that_hold_some(autojump_clock):
    budget = ServerBudget(2)
    a, b, c = budget.account("a"), budget.account("b"), budget.account("c")
    await a.acquire()
    await a.acquire()  # a holds the whole budget
    order = []

    async def take(account, name):
        await account.acquire()
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, a, "a3")  # a asks first, but holds two already
        await trio.sleep(1)
        nursery.start_soon(take, b, "b1")
        await trio.sleep(1)
        nursery.start_soon(take, c, "c1")
        await trio.sleep(1)
        stats = budget.stats()
        assert (stats.in_use, stats.size, stats.orgs_waiting, stats.waiting) == (2, 2, 3, 3)
        assert stats.longest_wait_s == pytest.approx(3.0)  # a3, in line from the start
        assert "connections 2/2, 3 orgs waiting (longest 3.0 s)" == stats.line()
        a.release()
        await trio.sleep(1)
        a.release()
        await trio.sleep(1)
        assert order == ["b1", "c1"]  # the orgs holding none, in the order they came
        b.release()
    assert order == ["b1", "c1", "a3"]
    assert (a.held, b.held, c.held) == (1, 0, 1)


async def test_orgs_that_keep_asking_take_turns(autojump_clock):
    budget = ServerBudget(1)
    a, b = budget.account("a"), budget.account("b")
    order = []

    async def work(account, name):
        await account.acquire()
        order.append(name)
        await trio.sleep(1)
        account.release()

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(work, a, "a")
        await trio.sleep(0.1)
        for _ in range(3):
            nursery.start_soon(work, b, "b")
    assert order == ["a", "b", "a", "b", "a", "b"]  # not a, a, a, b, b, b


async def test_a_wait_ends_at_the_callers_deadline_and_a_late_grant_is_passed_on(autojump_clock):
    budget = ServerBudget(1)
    a, b, c = budget.account("a"), budget.account("b"), budget.account("c")
    await a.acquire()
    with trio.move_on_after(5) as deadline:
        await b.acquire()
    assert deadline.cancelled_caught and b.held == 0 and budget.stats().waiting == 0
    assert budget.stats(new_period=True).longest_wait_s == pytest.approx(5.0)
    assert budget.stats().longest_wait_s == 0.0  # a new period
    got = trio.Event()
    b_scope = trio.CancelScope()

    async def b_waits():
        with b_scope:
            await b.acquire()

    async def wait_for_c():
        await c.acquire()
        got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(b_waits)
        await trio.sleep(1)
        nursery.start_soon(wait_for_c)
        await trio.sleep(1)
        b_scope.cancel()  # b's cancellation is on its way ...
        a.release()  # ... when the freed slot is granted to it: b passes it on to c
        await got.wait()
    assert b_scope.cancelled_caught and b.held == 0
    assert c.held == 1 and budget.stats().in_use == 1  # nothing lost, nothing doubled


async def test_a_look_for_an_idle_connection_walks_only_the_orgs_holding_one(autojump_clock):
    """A gateway keeps an account for every org it has seen; a caller at a full budget looks
    for an idle connection among the accounts that hold a slot only (at most the budget's
    size), not among the thousand that hold none."""
    class Pool:
        def __init__(self, idle=()):
            self.idle, self.asked, self.discarded = list(idle), 0, []

        def take_idle(self, idle_since=None):  # its connections are all long idle
            self.asked += 1
            return self.idle.pop(0) if self.idle else None

        def discard(self, raw):
            self.discarded.append(raw)

    budget = ServerBudget(2)
    idle = [budget.account(f"idle-{i}", key="k") for i in range(1_000)]
    for account in idle:
        account.pool = Pool()
    holder, busy = budget.account("holder", key="k"), budget.account("busy", key="other")
    holder.pool, busy.pool = Pool(["conn-1"]), Pool()
    await holder.acquire()
    await busy.acquire()  # the budget is full
    newcomer = budget.account("newcomer", key="k")
    newcomer.pool = Pool()
    assert await newcomer.acquire() == "conn-1"  # the holder's idle connection, and its slot
    assert (holder.held, newcomer.held, budget.stats().in_use) == (0, 1, 2)
    assert sum(account.pool.asked for account in idle) == 0
    # one of another key waits: the holders (not the thousand) are asked to close an idle one
    busy.pool.idle.append("conn-2")
    other = budget.account("other-key", key="x")
    with trio.move_on_after(1):
        await other.acquire()
    assert busy.pool.discarded == ["conn-2"] and sum(a.pool.asked for a in idle) == 0


class _ClosingPool:
    """An idle pool as `engine.pool.ConnectionPool` keeps it: a closed idle connection found by
    `take_idle` is dropped and its slot released (the account may leave the budget's holders
    in the middle of the budget's look)."""

    def __init__(self, account, idle):
        self.account, self.idle, self.discarded = account, list(idle), []
        account.pool = self

    def take_idle(self, idle_since=None):  # its connections are all long idle
        while self.idle:
            raw = self.idle.pop(0)
            if not raw.startswith("closed"):
                return raw
            self.account.release()
        return None

    def discard(self, raw):
        self.discarded.append(raw)


async def test_a_closed_idle_connection_found_in_a_look_frees_its_slot_for_the_caller(
        autojump_clock):
    """A caller at a full budget looks for an idle connection of its key; the one it finds is
    closed, so the look frees that slot (and its holder leaves the walk's dict): the caller
    takes the slot at once rather than waiting in line for a release that may never come."""
    budget = ServerBudget(2)
    holder, busy = budget.account("holder", key="k"), budget.account("busy", key="other")
    _ClosingPool(holder, ["closed-1"])
    _ClosingPool(busy, [])
    await holder.acquire()
    await busy.acquire()  # the budget is full
    newcomer = budget.account("newcomer", key="k")
    _ClosingPool(newcomer, [])
    with trio.fail_after(1):
        assert await newcomer.acquire() is None  # a fresh slot: open a connection
    assert (holder.held, newcomer.held, budget.stats().in_use) == (0, 1, 2)


async def test_a_closed_idle_connection_found_when_asking_serves_the_waiter(autojump_clock):
    """A caller of another key waits and asks the holders to close an idle connection; the
    first it asks finds only a closed one, whose freed slot goes to the caller: no other
    holder's open idle connection is closed for nothing."""
    budget = ServerBudget(2)
    stale, keeper = budget.account("stale", key="k"), budget.account("keeper", key="k")
    _ClosingPool(stale, ["closed-1"])
    _ClosingPool(keeper, ["conn-2"])
    await stale.acquire()
    await keeper.acquire()
    other = budget.account("other-key", key="x")
    _ClosingPool(other, [])
    with trio.fail_after(1):
        assert await other.acquire() is None
    assert (stale.held, other.held, budget.stats().in_use) == (0, 1, 2)
    assert keeper.pool.discarded == [] and keeper.pool.idle == ["conn-2"]


async def test_a_caller_cancelled_on_arrival_takes_nothing(autojump_clock):
    """Cancelled before it asks, a caller at a full budget leaves with no slot and no idle
    connection taken from another account."""
    budget = ServerBudget(1)
    holder = budget.account("holder", key="k")
    _ClosingPool(holder, ["conn-1"])
    await holder.acquire()
    late = budget.account("late", key="k")
    _ClosingPool(late, [])
    with trio.CancelScope() as scope:
        scope.cancel()
        await late.acquire()
    assert scope.cancelled_caught
    assert (holder.held, late.held, holder.pool.idle) == (1, 0, ["conn-1"])


def test_the_default_size_is_half_of_what_the_reserve_and_sessions_leave():
    # the embedded server: 238 = 10 reserved + 16 sessions x 8 + 100
    assert default_size(ServerConnections(238, 10), 128)[0] == 50
    assert default_size(ServerConnections(500, 3, 2), 128)[0] == (500 - 5 - 128) // 2
    size, why = default_size(ServerConnections(100, 3), 128)  # too small for the sessions
    assert size == 24 and "raise max_connections" in why
    with pytest.raises(InvalidInputError):
        ServerBudget(0)
    with pytest.raises(InvalidInputError, match="max_connections"):
        ServerOptions(max_connections=0)


def test_a_local_server_s_default_is_at_most_six_connections_a_core():
    local = ServerConnections(238, 10, local=True)
    size, why = default_size(local, 128, cores=2)
    assert size == 2 * PER_CORE == 12 and "on this machine, 2 cores" in why
    assert default_size(local, 128, cores=16)[0] == 50  # the share is the smaller
    assert default_size(local, 128)[0] == 50  # cores unknown: the share
    assert default_size(ServerConnections(238, 10), 128, cores=2)[0] == 50  # remote: the share
    size, why = default_size(ServerConnections(100, 3, local=True), 128, cores=1)
    assert size == PER_CORE and "raise max_connections" in why  # below the quarter as well


def _connection_on(sock: socket.socket) -> object:
    """What `reached_locally` reads of a driver connection: its transport's socket."""
    return types.SimpleNamespace(_transport=types.SimpleNamespace(
        get_extra_info=lambda name: sock if name == "socket" else None))


def test_only_a_unix_socket_or_a_loopback_peer_is_local():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as remote, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as loopback, \
            socket.socket(socket.AF_UNIX) as unix:
        remote.connect(("192.0.2.1", 5432))  # a datagram socket connects without a peer
        loopback.connect(("127.0.0.1", 5432))
        assert not reached_locally(_connection_on(remote))
        assert reached_locally(_connection_on(loopback))
        assert reached_locally(_connection_on(unix))
    assert not reached_locally(types.SimpleNamespace())  # no socket to read


async def test_a_server_reached_over_a_unix_socket_is_sized_by_this_machine_s_cores(dsn):
    server = await read_server_connections(dsn)
    if "host=/" not in dsn:  # RUNPLANE_TEST_DSN over TCP: where the server is, unknown here
        pytest.skip("the test server is reached over TCP; the embedded one tests this")
    assert server.local
    remote = ServerConnections(server.max_connections, server.superuser_reserved, server.reserved)
    share = default_size(remote, sessions_per_server() * SESSION_CONNECTION_LIMIT)[0]
    budget = await server_budget(dsn)
    assert budget.size == min(share, PER_CORE * local_cores())


# -- tenants drawing on one budget -------------------------------------------------------------
async def _backends(tenant, pids) -> int:
    async with tenant.connection("receipts") as conn:
        return await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])", sorted(pids))


async def test_tenants_share_the_budget_and_pass_connections_on(dsn, tenant):
    budget = ServerBudget(2, spare_idle_s=3600)  # below the budget, nothing idle is spare
    with hosting(budget):
        async with open_tenant("org-a", dsn, schema=tenant.schema) as a, \
                open_tenant("org-b", dsn, schema=tenant.schema) as b:
            assert budget.stats().in_use == 2  # each keeps its opening's connection pooled
            b_idle = b._idle[0][1].get_server_pid()
            async with a.connection("sheet") as one, a.connection("receipts") as two:
                # the budget is full: b's idle connection moved to a, with its slot
                assert b._idle == [] and b_idle in {one.backend_pid, two.backend_pid}
                assert (a._pool.account.held, b._pool.account.held) == (2, 0)
                pids = {one.backend_pid, two.backend_pid}
            assert len(a._idle) == 2 and budget.stats().in_use == 2
            async with b.connection("sheet") as conn:  # a's oldest idle one moves to b
                assert conn.backend_pid in pids and len(a._idle) == 1
            held, done = trio.Event(), trio.Event()
            got = {}

            async def b_works():
                async with b.connection("sheet") as conn:
                    got["pid"] = conn.backend_pid
                    held.set()
                    await done.wait()

            async with trio.open_nursery() as nursery:
                async with a.connection("sheet") as first:  # a holds both slots
                    async with a.connection("receipts") as second:
                        handed = second.backend_pid
                        nursery.start_soon(b_works)
                        await wait_until(lambda: budget.stats().orgs_waiting == 1)
                    # a's checkout ended while b waits: its connection goes to b, not the pool
                    await held.wait()
                    assert got["pid"] == handed and a._idle == []
                    assert budget.stats().in_use == 2
                    assert await first.fetchval("SELECT 1") == 1
                done.set()
    assert budget.stats().in_use == 0 and budget.stats().overdrawn == 0


async def test_below_the_budget_a_spare_idle_connection_moves_before_a_new_one_opens(
        dsn, tenant):
    """Below the budget a tenant that needs a connection takes another tenant's connection
    idle `spare_idle_s` or longer (a backend running, its caches warm) rather than start a
    backend; one idle less long stays with its tenant, which is about to reuse it."""
    budget = ServerBudget(10, spare_idle_s=3600)
    with hosting(budget):
        async with open_tenant("org-a", dsn, schema=tenant.schema) as a, \
                open_tenant("org-b", dsn, schema=tenant.schema) as b:
            b_pid = b._idle[0][1].get_server_pid()
            async with a.connection("sheet") as one, a.connection("receipts") as two:
                # b's connection is idle, but not spare: a opens a connection of its own
                assert b_pid not in {one.backend_pid, two.backend_pid}
                a_pids = {one.backend_pid, two.backend_pid}
            assert budget.stats().in_use == 3 and len(b._idle) == 1
            budget.spare_idle_s = 0.2
            await trio.sleep(0.3)  # a's two connections are spare now, and b's one
            async with b.connection("sheet") as first, b.connection("receipts") as second:
                assert first.backend_pid == b_pid  # its own first
                assert second.backend_pid in a_pids  # then a's oldest, with its slot
                assert (a._pool.account.held, b._pool.account.held) == (1, 2)
                assert budget.stats().in_use == 3
    assert budget.stats().in_use == 0


async def test_an_idle_connection_another_tenant_cannot_use_is_closed_for_it(dsn, tenant):
    budget = ServerBudget(1)
    with hosting(budget):
        async with open_tenant("org-a", dsn, schema=tenant.schema) as a:
            pid = a._idle[0][1].get_server_pid()
            async with open_reader("org-b", dsn, schema=tenant.schema) as b:  # other settings
                assert await b.server_version()
                assert a._idle == [] and budget.stats().in_use == 1
            with trio.fail_after(10):
                while await _backends(tenant, {pid}):
                    await trio.sleep(0.01)


# -- too many clients ---------------------------------------------------------------------------
async def test_too_many_clients_at_connect_is_an_outage_to_ride(admin_dsn, tenant):
    role = f"rp_crowded_{uuid.uuid4().hex[:8]}"
    async with tenant.login_connection() as conn:
        await conn.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1")
    url = urllib.parse.urlsplit(admin_dsn)
    as_role = urllib.parse.urlunsplit(url._replace(
        netloc=f"{role}@{url.hostname or ''}" + (f":{url.port}" if url.port else "")))
    try:
        async with open_tenant("org-a", as_role, bootstrap=False) as holder, \
                open_tenant("org-b", as_role, bootstrap=False) as late:
            async with holder.login_connection() as held:  # the role's one connection
                await held.fetchval("SELECT 1")
                with pytest.raises(TenantUnreachableError) as raised:  # after its connect ladder
                    await late.server_version()
            assert isinstance(raised.value, StoreUnavailableError)  # an outage: runs ride it
            assert "too many connections" in str(raised.value)
            await holder.aclose()  # its pooled connection goes: the next connect gets in
            assert await late.server_version()
    finally:
        async with tenant.login_connection() as conn:
            await conn.execute(f"DROP ROLE {role}")


# -- the gateway ------------------------------------------------------------------------------
def test_a_503_naming_a_wait_spends_no_answered_attempt():
    policy = RetryPolicy(answered_delays_s=(1.0,), unreachable_budget_s=10.0)
    busy = Attempted(503, {"error": "busy", "code": "store_unavailable", "retry_after_ms": 1000})
    state, now = RetryState(0.0), 0.0
    for _ in range(5):  # more than the ladder's 2 answered attempts
        d = decide(policy, state, busy, now, now + 0.5, "x", "here")
        assert (d.kind, d.wait_s, d.state.answered) == ("retry", 1.0, 0)
        state, now = d.state, now + 1.5
    d = decide(policy, state, Attempted(200, {"result": 1}), now, now, "x", "here")
    assert d.kind == "answer"
    d = decide(policy, RetryState(0.0), busy, 9.0, 9.5, "x", "here")  # 1 s does not fit in 0.5
    assert d.kind == "stop" and isinstance(d.error, GatewayUnavailableError)
    assert "unreachable budget of 10 s" in str(d.error)


async def test_a_client_rides_503s_past_its_ladder_within_its_budget(tenant):
    policy = RetryPolicy(answered_delays_s=(0.01,), unreachable_budget_s=0.5,
                         min_answered_wait_s=0.0)
    body = {"error": "busy", "code": "store_unavailable", "retry_after_ms": 20}
    async with stub_gateway(503, body) as (url, hits):
        async with open_gateway(url, token_for(tenant), retry=policy) as gw:
            with pytest.raises(GatewayUnavailableError, match="answered 503 until the unreachable"):
                await runs.register(gw, RunScope(tenant.org_id, "p", "r"))
    assert hits["actions"] > 2  # past the 2 answered attempts the ladder allows


async def test_the_gateway_queues_orgs_past_its_budget(tenant):
    async with serving(tenant, max_connections=1) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            await runs.register(gw, RunScope(tenant.org_id, "p", "r1"))
            budget = server.tenants.budget
            assert budget is not None and budget.size == 1
            hosted = await server.tenants.get(tenant.org_id)
            line = server.take_period()
            assert line is not None and "connections 1/1, 0 orgs waiting" in line
            holding, release = trio.Event(), trio.Event()

            async def hold_the_only_slot():
                async with hosted.connection("sheet"):
                    holding.set()
                    await release.wait()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold_the_only_slot)
                await holding.wait()
                nursery.start_soon(runs.register, gw, RunScope(tenant.org_id, "p", "r2"))
                await wait_until(lambda: budget.stats().waiting == 1)  # in line, not refused
                release.set()
            assert gw.stats.retries == 0  # the queued request waited, it was not refused
    assert budget.stats().in_use == 0 and "store_unavailable" not in server.errors
