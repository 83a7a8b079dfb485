"""Many servers (docs/guide/operations.md, "Moving an org"): a tenants file, the control table,
a gateway routing each org to its server, and an org moved between two real embedded servers
in the middle of a run while another org keeps running."""

from __future__ import annotations

import uuid

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import PlayScope, RunScope, open_tenant, runs, sheets
from runplane.engine.sheets import views
from runplane.engine.errors import (
    ConflictError, InvalidInputError, ScopeError, StoreUnavailableError,
)
from runplane.engine.gateway import ServerOptions, mint_token, open_gateway, open_server
from runplane.engine.placement import copying, fence, load_tenants_file, parse_tenants
from runplane.engine.placement.control import MoveStep, control_connection
from runplane.engine.placement.move import MoveRequest, move_org
from runplane.engine.placement.router import load_router, open_router
from runplane.simulations.routing import org_rows

from .conftest import fresh_schema
from .gateway_support import FAST_RETRY, SECRET
from .many_servers_support import assert_moved_rows, tenants_toml

CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("upper",))


def test_the_tenants_file_is_checked_before_anything_connects():
    servers = {"one": {"dsn": "postgresql://a@h/db"}, "two": {"dsn": "postgresql://b@h/db"}}
    parsed = parse_tenants({"servers": servers, "orgs": {"acme": {"server": "two"},
                                                         "default": {"server": "one"}}})
    assert parsed.orgs["acme"].server == "two" and parsed.orgs["acme"].schema == "runplane"
    assert parsed.default is not None and parsed.default.server == "one"
    assert parsed.control_dsn == "postgresql://a@h/db"  # the first server holds the control table
    with_control = parse_tenants({"servers": servers, "control": {"dsn": "postgresql://c@h/db"}})
    assert with_control.control_dsn == "postgresql://c@h/db" and with_control.default is None
    for bad in ({"servers": {}}, {"servers": servers, "orgs": {"x": {"server": "three"}}},
                {"servers": servers, "orgs": {"x": {"server": "one", "shard": 2}}},
                {"servers": {"one": {"dsn": 5}}}, {"servers": servers, "extra": {}}):
        with pytest.raises(InvalidInputError):
            parse_tenants(bad)


def test_the_verification_names_the_first_table_whose_copy_differs():
    copies = [copying.TableCopy("s", name, ("a",)) for name in ("runs", "sheet_x")]
    assert copying.compare(copies, [(3, 7), (5, 9)], [(3, 7), (5, 9)]) == {"runs": 3,
                                                                           "sheet_x": 5}
    for theirs in ([(3, 7), (4, 9)], [(3, 7), (5, 8)]):  # a row missing; a row changed
        with pytest.raises(ConflictError, match="copy of sheet_x differs"):
            copying.compare(copies, [(3, 7), (5, 9)], theirs)


async def test_the_control_table_routes_and_the_file_only_seeds_it(dsn, second_dsn, tmp_path):
    schema, org = fresh_schema(), f"o{uuid.uuid4().hex[:10]}"
    path = tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn}, {org: "s1"}, schema)
    router = await load_router(path)
    assert router.resolve(org).server == "s1"
    with pytest.raises(ScopeError):  # no [orgs.default]: an unnamed org is refused
        router.resolve(f"{org}-unnamed")
    async with control_connection(dsn) as conn:  # as a move would: the table wins over the file
        await conn.execute("UPDATE runplane_control.placements SET server = 's2'"
                           " WHERE org_id = $1", org)
    async with open_router(path, poll_s=0.05) as polled:
        assert polled.resolve(org).server == "s2"  # seeding never undoes the table
        async with control_connection(dsn) as conn:
            await conn.execute("UPDATE runplane_control.placements SET fenced = true"
                               " WHERE org_id = $1", org)
        await polled.wait_for_poll()
        await polled.wait_for_poll()
        assert polled.resolve(org).fenced  # followed without a signal
        newcomer = f"{org}-new"  # SIGHUP's reload: the file's new orgs are seeded
        tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn},
                     {org: "s1", newcomer: "s2"}, schema)
        await polled.reload()
        assert polled.resolve(newcomer).server == "s2" and polled.resolve(org).server == "s2"
    async with control_connection(dsn) as conn:
        await conn.execute("DELETE FROM runplane_control.placements WHERE org_id = ANY($1)",
                           [org, f"{org}-new"])


async def _check_moved(dsn: str, schema: str, org: str, run_id: str, late_epoch: int) -> None:
    """The moved org's run on its new server: every row once, completed, counters exact, and
    the run registered during the fence there with an epoch past the first run's."""
    async with open_tenant(org, dsn, schema=schema) as moved:
        await assert_moved_rows(moved, org)
        first = await runs.get(moved, RunScope(org, "p", run_id))
        registered_late = await runs.get(moved, RunScope(org, "late", "r"))
        assert first is not None and registered_late is not None
        assert registered_late.epoch == late_epoch > first.epoch  # epochs still increase


async def test_an_org_moves_to_another_server_in_the_middle_of_a_run(dsn, second_dsn, tmp_path):
    schema, tag = fresh_schema(), uuid.uuid4().hex[:8]
    org_a, org_b = f"a{tag}", f"b{tag}"
    path = tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn},
                        {org_a: "s1", org_b: "s1"}, schema)
    midway = {org_a: trio.Event(), org_b: trio.Event()}
    moved = trio.Event()
    results = {}

    def row_function(org: str):
        async def enrich(row: dict) -> dict:
            if row["n"] == 150:  # one row of each org is in a call across the whole move
                midway[org].set()
                await moved.wait()
            return {"upper": row["name"].upper()}
        return enrich

    async def run_org(url: str, org: str, n: int, gateways: dict) -> None:
        async with open_gateway(url, mint_token(SECRET, org), retry=FAST_RETRY) as gateway:
            gateways[org] = gateway
            async with open_run(gateway, "p") as run:
                results[org] = (run.run_id, await run.map(
                    "things", [{"name": f"r{i}", "n": i} for i in range(n)], row_function(org),
                    contract=CONTRACT, concurrency=8))

    async with open_router(path, poll_s=0.1) as router:
        async with open_server(secret=SECRET, options=ServerOptions(), router=router) as server:
            async with open_tenant(org_a, dsn, schema=schema) as a_on_s1:

                async def at_step(step: MoveStep) -> None:
                    if step is MoveStep.COPY:  # fenced: the gateway and the database refuse A
                        await router.wait_for_poll()
                        await router.wait_for_poll()
                        with pytest.raises(StoreUnavailableError):
                            await server.tenants.get(org_a)
                        with pytest.raises(StoreUnavailableError):
                            await runs.register(a_on_s1, RunScope(org_a, "direct", "r"))
                        assert (await server.tenants.get(org_b)).org_id == org_b
                        # a request of A now meets 503s with retry_after, rides them, and
                        # lands on server 2 once the route switched
                        tasks.start_soon(register_late)

                async def register_late() -> None:
                    async with open_gateway(server.url, mint_token(SECRET, org_a),
                                            retry=FAST_RETRY) as gateway:
                        late.append(await runs.register(gateway, RunScope(org_a, "late", "r")))
                        late.append(gateway.stats.retries)

                gateways: dict = {}
                late: list = []
                async with trio.open_nursery() as tasks:
                    tasks.start_soon(run_org, server.url, org_a, 300, gateways)
                    tasks.start_soon(run_org, server.url, org_b, 400, gateways)
                    await midway[org_a].wait()
                    await midway[org_b].wait()
                    report = await move_org(router.file, MoveRequest(org_a, to="s2"),
                                            on_step=at_step)
                    await router.wait_for_poll()
                    moved.set()
                assert report.rows["runs"] == 1 and report.fenced_s > 0
                assert late[1] > 0  # A's request rode the fence's 503s
                assert server.tenants.server_of(org_a) == "s2"
                assert gateways[org_b].stats.retries == 0  # B never saw a 503
                async with a_on_s1.connection("receipts") as conn:
                    assert await org_rows(conn, schema, org_a) > 0  # kept until --drop-source
    run_a, result_a = results[org_a]
    _, result_b = results[org_b]
    assert (result_a.admitted, result_a.completed, result_a.failed) == (300, 300, 0)
    assert (result_b.admitted, result_b.completed, result_b.failed) == (400, 400, 0)
    await _check_moved(second_dsn, schema, org_a, run_a, late[0].epoch)
    dropped = await move_org(load_tenants_file(path), MoveRequest(  # its router polled at 0.1 s
        org_a, drop_source=True, drop_grace_s=0.3))
    assert dropped.dropped
    async with control_connection(dsn) as conn:
        assert await org_rows(conn, schema, org_a) == 0  # server 1 holds no A rows
        assert await org_rows(conn, schema, org_b) > 0
        assert not await fence.is_fenced(conn, schema, org_a)


class Crash(Exception):
    """The mover dies at a step (as a killed process would, between two statements)."""


async def test_an_interrupted_move_resumes_or_rolls_back(dsn, second_dsn, tmp_path):
    schema, org = fresh_schema(), f"c{uuid.uuid4().hex[:10]}"
    path = tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn}, {org: "s1"}, schema)
    file = load_tenants_file(path)
    async with open_tenant(org, dsn, schema=schema) as on_s1:
        run = await runs.register(on_s1, RunScope(org, "p", "r1"))
        await sheets.ensure_sheet(on_s1, PlayScope(org, "p"), "t", CONTRACT)
        await sheets.admit(on_s1, run, "t", CONTRACT,
                           [{"name": f"x{i}", "n": i} for i in range(50)])
        await views.sync_views(on_s1)  # `runplane views`: the move takes the org's view along

    def crash_at(where: MoveStep):
        async def hook(step: MoveStep) -> None:
            if step is where:
                raise Crash(step.value)
        return hook

    with pytest.raises(Crash):  # dies after fencing, before the copy
        await move_org(file, MoveRequest(org, to="s2"), on_step=crash_at(MoveStep.COPY))
    with pytest.raises(ConflictError):  # a new move while one is recorded: resume or abort
        await move_org(file, MoveRequest(org, to="s2"))
    aborted = await move_org(file, MoveRequest(org, abort=True))
    assert aborted.aborted
    async with control_connection(dsn) as conn:
        assert not await fence.is_fenced(conn, schema, org)
        assert (await load_router(path)).resolve(org).server == "s1"
    async with open_tenant(org, dsn, schema=schema) as on_s1:
        assert (await runs.register(on_s1, RunScope(org, "p", "r2"))).epoch > run.epoch
    with pytest.raises(Crash):  # dies after the verified copy, before the route switched
        await move_org(file, MoveRequest(org, to="s2"), on_step=crash_at(MoveStep.SWITCH))
    resumed = await move_org(file, MoveRequest(org, resume=True))
    assert resumed.rows["runs"] == 2 and resumed.rows["sheet_summary"] == 1
    assert (await load_router(path)).resolve(org).server == "s2"
    with pytest.raises(ConflictError):  # server 1 still holds the rows: drop them first
        await move_org(file, MoveRequest(org, to="s1"))
    view = f'"{schema}_views"."{org}/p/t"'
    assert (await move_org(file, MoveRequest(org, drop_source=True, drop_grace_s=0))).dropped
    async with control_connection(dsn) as conn:
        assert await org_rows(conn, schema, org) == 0
        assert await conn.fetchval("SELECT to_regclass($1)", view) is None  # dropped with it
    async with open_tenant(org, second_dsn, schema=schema) as on_s2:
        summary = await sheets.summary(on_s2, PlayScope(org, "p"), "t")
        assert summary.total == 50 and summary.queued + summary.running == 50
        async with on_s2.connection("receipts") as conn:  # the view, recreated on server 2
            assert await conn.fetchval(f"SELECT count(*) FROM {view}") == 50


def test_the_command_line_follows_the_tenants_file(dsn, second_dsn, tmp_path, capsys):
    from runplane.cli.main import main

    schema, org = fresh_schema(), f"d{uuid.uuid4().hex[:10]}"
    path = tenants_toml(tmp_path / "t.toml", {"s1": dsn, "s2": second_dsn}, {org: "s2"}, schema)
    demo = ["demo", "--rows", "120", "--fail-rate", "0", "--tenants", path, "--org", org]
    assert main(demo) == 0
    assert "admitted 120" in capsys.readouterr().out
    assert main(["move-org", org, "--to", "s1", "--tenants", path]) == 0
    assert f"moved org {org} from s2 to s1" in capsys.readouterr().out
    assert main(demo) == 0  # the rerun reads its cache on server 1
    assert "cached 120" in capsys.readouterr().out
    assert main(["move-org", org, "--drop-source", "--tenants", path]) == 0
    assert main(["move-org", org, "--resume", "--tenants", path]) == 1  # nothing to resume
    assert main(["move-org", org, "--tenants", path]) == 2  # no --to
    assert main(["demo", "--rows", "1", "--tenants", path, "--org", "nobody"]) == 1  # refused
