"""Scenario `routing`: many orgs over several servers (databases of one embedded server), moved
between them under load, the mover and the runs crashing at every step.

How it works
- Once per simulation, `SERVERS` databases are created on the server (and dropped after); the
  first holds the control table. Each example writes a tenants file placing its orgs (fresh
  names, a fresh schema) on drawn servers, and serves them through one gateway routing by org
  (`engine.placement`), polled every 50 ms.
- Hypothesis draws a `Plan`: per org its first server and the operation after which its writer
  "crashes" (its task is cancelled mid-request, then a new writer resumes the same run), and
  a few moves: which org, to which server, after how many of that org's operations, at which
  step the mover dies (`MoveStep`, or never), whether it is then resumed or rolled back, and
  whether the source is dropped after.
- Each writer, through the gateway or (drawn per org) on a tenant of its own that the
  router places and that follows its org (`engine.placement.following`, each call retried
  through the fence's refusals as a run's are): registers its run, admits its rows in batches
  and completes them, then keeps registering extra runs until every move is done (load during
  every move). `--drop-source` waits `DROP_GRACE_S` after a move, as it does in production.
- Invariants, checked on each org's current server at the end: nothing lost (every run whose
  registration was answered is there with the answered epoch; every row admitted, completed
  once), no row written twice (one row per key, counters equal to a COUNT, `counters_match`),
  epochs increasing in the order the writer saw them (a move advanced the target's
  sequences), and every write answered by the org's current server or refused: no server but
  the current one holds rows of the org unless it is the fenced source kept until
  `--drop-source`, and a dropped source holds none.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import urllib.parse
import uuid
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Protocol, TypeVar

import attrs
import trio
from hypothesis import strategies as st

from runplane.actors.retry import OutageWatch, retry_transient
from runplane.engine import PlayScope, RunScope, open_tenant, runs, sheets
from runplane.engine.gateway import (
    RetryPolicy, ServerOptions, mint_token, open_gateway, open_server,
)
from runplane.engine.placement import fence, load_tenants_file
from runplane.engine.placement.control import MoveStep, control_connection
from runplane.engine.placement.move import MoveRequest, move_org
from runplane.engine.placement.following import placed
from runplane.engine.placement.router import Router, load_router, open_router
from runplane.engine.ports import Port
from runplane.engine.sheets import RowOutcome, SheetContract

from .counters import counters_match
from .harness import run_examples
from .report import SimulationReport

NAME = "routing"
SERVERS = 3
ROWS, BATCH = 24, 6
PLAY, NS = "play-sim", "routed"
CONTRACT = SheetContract(inputs=("name",), outputs=("upper",))
SECRET = "routing-simulation-secret-" + "x" * 16
RETRY = RetryPolicy(answered_delays_s=(0.01, 0.02, 0.05), unreachable_budget_s=60.0,
                    request_timeout_s=30.0, completion_total_s=60.0, min_answered_wait_s=0.0)
CRASH_STEPS = (None, MoveStep.FENCE, MoveStep.COPY, MoveStep.SWITCH, MoveStep.UNFENCE)
EXAMPLE_TIMEOUT = 120.0
POLL_S = 0.05  # every router of an example polls the control table this often
DROP_GRACE_S = 4 * POLL_S  # `--drop-source` waits that long after the move (`move.DROP_GRACE_S`)
T = TypeVar("T")


class Call(Protocol):
    """How a writer makes one store call (once, or retried through outages)."""

    async def __call__(self, operation: Callable[[], Awaitable[T]]) -> T: ...


class MoverCrash(Exception):
    """The mover died at a step."""


@attrs.frozen
class Move:
    org: int
    to: int
    after_ops: int
    crash_at: MoveStep | None
    abort: bool
    drop_source: bool


@attrs.frozen
class Plan:
    servers: tuple[int, ...]  # each org's first server
    writer_crash: tuple[int | None, ...]  # each org's writer is cancelled after this op
    moves: tuple[Move, ...]
    direct: tuple[bool, ...] = ()  # each org's writer: on a placed tenant, not the gateway

    def describe(self) -> str:
        moves = ", ".join(f"org{m.org}->s{m.to} after {m.after_ops} (crash {m.crash_at}, "
                          f"{'abort' if m.abort else 'resume'}{', drop' if m.drop_source else ''})"
                          for m in self.moves)
        return (f"orgs on {list(self.servers)}, direct {list(self.direct)}, writer crashes "
                f"{list(self.writer_crash)}; {moves}")


@st.composite
def plans(draw) -> Plan:
    orgs = draw(st.integers(2, 4))
    moves = tuple(Move(draw(st.integers(0, orgs - 1)), draw(st.integers(0, SERVERS - 1)),
                       draw(st.integers(0, 6)), draw(st.sampled_from(CRASH_STEPS)),
                       draw(st.booleans()), draw(st.booleans()))
                  for _ in range(draw(st.integers(1, 3))))
    return Plan(tuple(draw(st.integers(0, SERVERS - 1)) for _ in range(orgs)),
                tuple(draw(st.one_of(st.none(), st.integers(1, 8))) for _ in range(orgs)), moves,
                tuple(draw(st.booleans()) for _ in range(orgs)))


@attrs.define
class Ledger:
    """What one org's writers saw answered."""

    ops: int = 0
    epochs: list[tuple[str, int]] = attrs.field(factory=list)
    completed: set[str] = attrs.field(factory=set)
    progressed: trio.Event = attrs.field(factory=trio.Event)

    def tick(self) -> None:
        self.ops += 1
        self.progressed.set()
        self.progressed = trio.Event()


def _database_dsn(dsn: str, database: str) -> str:
    return urllib.parse.urlunsplit(urllib.parse.urlsplit(dsn)._replace(path=f"/{database}"))


async def _databases(dsn: str, names: list[str], *, create: bool) -> None:
    async with control_connection(dsn) as conn:
        for name in names:
            verb = "CREATE DATABASE" if create else "DROP DATABASE IF EXISTS"
            await conn.execute(f'{verb} "{name}"' + ("" if create else " WITH (FORCE)"))


@contextlib.asynccontextmanager
async def _port(url: str, router: Router, schema: str, org: str, direct: bool
                ) -> AsyncIterator[tuple[Port, Call]]:
    """The writer's port and how it calls: through the gateway (whose client rides 503s), or
    on a tenant placed by the router (`engine.placement.following`), each call retried through
    outages (the fence's refusals) as a run's are."""
    if not direct:
        async with open_gateway(url, mint_token(SECRET, org), retry=RETRY) as gateway:
            yield gateway, _once
        return
    watch = OutageWatch(RETRY.unreachable_budget_s)

    async def ride(operation: Callable[[], Awaitable[T]]) -> T:
        return await retry_transient(operation, watch=watch)

    with placed(router, org):
        async with open_tenant(org, schema=schema) as tenant:
            yield tenant, ride


async def _once(operation: Callable[[], Awaitable[T]]) -> T:
    return await operation()


async def _writer(port: Port, call: Call, org: str, ledger: Ledger, done: trio.Event,
                  crash_after: int | None) -> None:
    """One org's load; a crash cancels it after `crash_after` ops and a new writer resumes."""
    while True:
        with trio.CancelScope() as scope:
            async def crash() -> None:
                while crash_after is None or ledger.ops < crash_after:
                    await ledger.progressed.wait()
                scope.cancel()

            async with trio.open_nursery() as nursery:
                if crash_after is not None and ledger.ops < crash_after:
                    nursery.start_soon(crash)
                await _write(port, call, org, ledger, done)
                nursery.cancel_scope.cancel()
            return
        crash_after = None  # crashed once: the next writer resumes the same run


async def _org_load(url: str, router: Router, schema: str, org: str, ledger: Ledger,
                    done: trio.Event, crash_after: int | None, direct: bool) -> None:
    async with _port(url, router, schema, org, direct) as (port, call):
        await _writer(port, call, org, ledger, done, crash_after)


async def _write(port: Port, call: Call, org: str, ledger: Ledger, done: trio.Event) -> None:
    run = await call(lambda: runs.register(port, RunScope(org, PLAY, "main")))
    if ("main", run.epoch) not in ledger.epochs:  # a resumed writer registers it again
        ledger.epochs.append(("main", run.epoch))
    ledger.tick()
    await call(lambda: sheets.ensure_sheet(port, PlayScope(org, PLAY), NS, CONTRACT))
    for start in range(0, ROWS, BATCH):
        rows = [{"name": f"row-{i}"} for i in range(start, start + BATCH)]
        admitted = await call(lambda: sheets.admit(port, run, NS, CONTRACT, rows))
        ledger.tick()
        outcomes = [RowOutcome(p.key, "completed", {"upper": p.row["name"].upper()})
                    for p in admitted.pending]
        if outcomes:
            await call(lambda: sheets.complete(port, run, NS, CONTRACT, outcomes))
        ledger.completed.update(row["name"] for row in rows)
        ledger.tick()
    while not done.is_set():
        run_id = f"extra-{len(ledger.epochs)}"
        ref = await call(lambda: runs.register(port, RunScope(org, PLAY, run_id)))
        ledger.epochs.append((ref.scope.run_id, ref.epoch))
        ledger.tick()


async def _mover(path: str, orgs: list[str], ledgers: list[Ledger], plan: Plan,
                 done: trio.Event) -> int:
    """The plan's moves, one after another; returns how many steps the mover died at."""
    crashes = 0
    try:
        for move in plan.moves:
            while ledgers[move.org].ops < move.after_ops:
                await ledgers[move.org].progressed.wait()
            file = load_tenants_file(path)

            async def hook(step: MoveStep, at: MoveStep | None = move.crash_at) -> None:
                if step is at:
                    raise MoverCrash(step.value)

            org, target = orgs[move.org], f"s{move.to}"
            placement = (await load_router(path)).resolve(org)
            if placement.server == target:
                continue
            if placement.moved_from == target:  # its old rows are still there: drop them first
                await move_org(file, MoveRequest(org, drop_source=True, drop_grace_s=DROP_GRACE_S))
            try:
                await move_org(file, MoveRequest(org, to=target), on_step=hook)
            except MoverCrash:
                crashes += 1
                switched = move.crash_at is MoveStep.UNFENCE  # past the switch: only resume
                await move_org(file, MoveRequest(org, abort=move.abort and not switched,
                                                 resume=not move.abort or switched))
            if move.drop_source:
                await move_org(file, MoveRequest(org, drop_source=True, drop_grace_s=DROP_GRACE_S))
    finally:
        done.set()
    return crashes


async def org_rows(conn, schema: str, org: str) -> int:
    """Every row the org holds on one server: its sheets' rows, its rows of the shared tables
    and its work receipts (none once the server neither places it nor keeps it fenced)."""
    tables = await fence.org_tables(conn, schema, org)
    total = len(tables.sheets)
    for name in tables.shared:
        total += await conn.fetchval(f'SELECT count(*) FROM "{schema}"."{name}" WHERE org_id = $1',
                                     org)
    receipts = f'"{schema}".work_receipts'
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", receipts):
        return total  # a server the schema was never created on
    prefix = fence.receipt_prefix(org)
    return total + await conn.fetchval(
        f"SELECT count(*) FROM {receipts} WHERE k >= $1 AND k < $2", prefix, prefix + b"\xff")


async def _check_org(path: str, dsns: dict[str, str], schema: str, org: str,
                     ledger: Ledger) -> list[str]:
    """The invariants of one org (see the module docstring)."""
    placement = (await load_router(path)).resolve(org)
    problems = []
    async with open_tenant(org, dsns[placement.server], schema=schema) as tenant:
        for run_id, epoch in ledger.epochs:
            stored = await runs.get(tenant, RunScope(org, PLAY, run_id))
            if stored is None or stored.epoch != epoch:
                found = "lost" if stored is None else stored.epoch
                problems.append(f"{org}: run {run_id} answered with epoch {epoch} is {found} "
                                f"on {placement.server}")
        seen = [epoch for _, epoch in ledger.epochs]
        if seen != sorted(set(seen)):
            problems.append(f"{org}: epochs not increasing in answer order: {seen}")
        scope = PlayScope(org, PLAY)
        stored_rows = await sheets.read_rows(tenant, scope, NS)
        names = [row["name"] for row in stored_rows]
        if len(names) != len(set(names)) or set(names) != {f"row-{i}" for i in range(ROWS)}:
            problems.append(f"{org}: {len(names)} rows ({len(set(names))} distinct), not {ROWS}")
        if any(row["upper"] != row["name"].upper() for row in stored_rows):
            problems.append(f"{org}: a row not completed on {placement.server}")
        ok, why = await counters_match(tenant, scope, NS)
        if not ok:
            problems.append(f"{org}: counters drifted on {placement.server}: {why}")
    for server, dsn in dsns.items():
        if server == placement.server:
            continue
        async with control_connection(dsn) as conn:
            rows = await org_rows(conn, schema, org)
            fenced = await fence.is_fenced(conn, schema, org)
        if rows and not (server == placement.moved_from and fenced):
            problems.append(f"{org}: {rows} rows on {server}, which is neither its server nor "
                            "its fenced source")
    return problems


def _tenants_file(path: Path, dsns: dict[str, str], orgs: list[str], servers: tuple[int, ...],
                  schema: str, control_dsn: str) -> str:
    lines = [f'[control]\ndsn = "{control_dsn}"']
    lines += [f'[servers.{name}]\ndsn = "{dsn}"' for name, dsn in dsns.items()]
    lines += [f'[orgs.{org}]\nserver = "s{server}"\nschema = "{schema}"'
              for org, server in zip(orgs, servers)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


async def _example(dsns: dict[str, str], control_dsn: str, _dsn: str, plan: Plan
                   ) -> tuple[list[str], dict[str, int]]:
    tag, schema = uuid.uuid4().hex[:8], f"sim_{uuid.uuid4().hex[:12]}"
    orgs = [f"o{tag}{i}" for i in range(len(plan.servers))]
    path = _tenants_file(Path(tempfile.mkdtemp(prefix="runplane-routing-")) / "tenants.toml",
                         dsns, orgs, plan.servers, schema, control_dsn)
    ledgers = [Ledger() for _ in orgs]
    done = trio.Event()
    crashes = 0
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with open_router(path, poll_s=POLL_S) as router:
            async with open_server(secret=SECRET, options=ServerOptions(), router=router) as server:
                async with trio.open_nursery() as nursery:
                    for org, ledger, crash_after, direct in zip(orgs, ledgers, plan.writer_crash,
                                                                plan.direct):
                        nursery.start_soon(_org_load, server.url, router, schema, org, ledger,
                                           done, crash_after, direct)
                    crashes = await _mover(path, orgs, ledgers, plan, done)
    problems = []
    for org, ledger in zip(orgs, ledgers):
        problems += await _check_org(path, dsns, schema, org, ledger)
    writer_crashes = sum(1 for c in plan.writer_crash if c is not None)
    return problems, {"mover crashes": crashes, "writer crashes": writer_crashes,
                      "moves": len(plan.moves), "direct writers": sum(plan.direct)}


DEFAULT_EXAMPLES = 5  # each example starts a gateway and moves orgs: seconds, not milliseconds


def run(examples: int = DEFAULT_EXAMPLES, seed: int | None = None,
        dsn: str | None = None) -> SimulationReport:
    """Run the scenario on `SERVERS` databases created on `dsn`'s server (dropped after)."""
    from . import resolve_dsn

    dsn = resolve_dsn(dsn)
    names = [f"rp_routing_{uuid.uuid4().hex[:8]}_{i}" for i in range(SERVERS)]
    trio.run(functools.partial(_databases, dsn, names, create=True))
    dsns = {f"s{i}": _database_dsn(dsn, name) for i, name in enumerate(names)}
    try:
        return run_examples(NAME, plans(), functools.partial(_example, dsns, dsns["s0"]),
                            examples=examples, seed=seed, dsn=dsn)
    finally:
        trio.run(functools.partial(_databases, dsn, names, create=False))
