"""Moving an org to another server online: fence, copy, verify, switch, unfence.

How it works (`move_org(file, MoveRequest(org, to=...))`, the steps of `runplane move-org`)
1. `fence`: the control table marks the org fenced (every process sees it within a second: a
   gateway answers its requests 503 with `retry_after_ms`), and the fence inside the source
   database (`engine.placement.fence`) fails any write of the org that comes by another path.
   Installing it waits for the org's transactions in flight: runs in flight are cut there, their
   next write fails, is retried, and lands on the target after the switch.
2. `copy`: the target's schema is prepared, every table of the org is copied with COPY in one
   target transaction, counts and digests are compared per table, the org's sheet views
   (`runplane views`) are recreated there, and every sequence of the
   target's schema is moved past the source's (run epochs stay increasing for the org); then
   the control table routes the org to the target (`switch`), still fenced.
3. `unfence`: the org is unfenced; the control table remembers the source (`moved_from`),
   which keeps the org's rows, still fenced in its database, until `drop_source`. Dropping
   them lifts that fence, so it waits until the move ended `drop_grace_s` (3 polls) ago: a
   process that had not yet read the switch would otherwise write to the source, unfenced, and
   its write would be lost to the org.
Each step is recorded in the control table before it runs, and each is idempotent, so
`resume=True` redoes the recorded step and goes on; `abort=True` rolls a move back (source
unfenced, the target's partial copy deleted) unless the route already switched (then only
`resume` finishes it). `on_step` is called before each step (simulations crash the mover there).
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable

import attrs
import trio

from .. import pg, schema as schema_ddl
from ..errors import ConflictError, InvalidInputError
from . import control, copying, fence
from .control import MoveStep, Placement
from .router import POLL_S, Router
from .tenants_file import TenantsFile

StepHook = Callable[[MoveStep], Awaitable[None]]
# Every process polls the control table each second (`router.POLL_S`): past this, every live
# one routes the org to its new server, so none can still write to the source once unfenced.
DROP_GRACE_S = 3 * POLL_S


@attrs.frozen
class MoveRequest:
    """What `runplane move-org` was asked: the org, its target (None with `resume`, `abort`
    or `drop_source` alone) and the flags."""

    org: str
    to: str | None = None
    resume: bool = False
    abort: bool = False
    drop_source: bool = False
    # How long after the move's last step `drop_source` waits (module docstring).
    drop_grace_s: float = DROP_GRACE_S


@attrs.frozen
class MoveReport:
    """What a move did: rows per table copied, how long the org was fenced and the copy took
    (seconds), and whether the source's rows were dropped or the move rolled back."""

    org: str
    source: str | None
    target: str | None
    rows: dict[str, int] = attrs.field(factory=dict)
    fenced_s: float = 0.0
    copy_s: float = 0.0
    dropped: bool = False
    aborted: bool = False


async def _nothing(_step: MoveStep) -> None:
    return None


async def move_org(file: TenantsFile, request: MoveRequest, *,
                   on_step: StepHook = _nothing) -> MoveReport:
    """Carry out `request` (see the module docstring)."""
    if request.resume and request.abort:
        raise InvalidInputError("--resume and --abort exclude each other")
    if request.to is not None:
        file.dsn(request.to)  # a server the file names, before anything connects
    async with pg.open_driver() as driver:
        async with control.connect(driver, file.control_dsn) as conn:
            await control.seed(conn, file)
            placement = Router(file, await control.read(conn)).resolve(request.org)
            if request.abort:
                return await _abort(driver, file, conn, placement)
            report = MoveReport(request.org, placement.server, request.to)
            if placement.move_step is None and request.to is not None:
                placement = await _begin(conn, placement, request.to)
            elif placement.move_step is not None and not request.resume:
                raise ConflictError(
                    f"a move of org {request.org!r} to {placement.move_to!r} stopped at step "
                    f"{placement.move_step.value}: run again with --resume or --abort")
            elif placement.move_step is None and not request.drop_source:
                raise InvalidInputError(f"no move of org {request.org!r} is under way: "
                                        "name a server with --to")
            if placement.move_step is not None:
                report = await _steps(driver, file, conn, placement, on_step)
            if request.drop_source:
                report = attrs.evolve(report, dropped=await _drop_source(
                    driver, file, conn, request.org, request.drop_grace_s))
            return report


async def _begin(conn: pg.Connection, placement: Placement, to: str) -> Placement:
    if to == placement.server:
        raise InvalidInputError(f"org {placement.org!r} already lives on server {to!r}")
    if placement.moved_from == to:
        raise ConflictError(f"server {to!r} still holds the org's rows from its last move: "
                            "drop them first (--drop-source)")
    return await control.record_step(conn, attrs.evolve(placement, move_to=to), MoveStep.FENCE)


async def _steps(driver: pg.Driver, file: TenantsFile, conn: pg.Connection,
                 placement: Placement, on_step: StepHook) -> MoveReport:
    started = time.perf_counter()
    source = placement.moved_from if placement.move_step is MoveStep.UNFENCE else placement.server
    target = placement.server if placement.move_step is MoveStep.UNFENCE else placement.move_to
    assert source is not None and target is not None
    org, schema = placement.org, placement.schema
    rows: dict[str, int] = {}
    copy_s = 0.0
    async with control.connect(driver, file.dsn(source)) as src, \
            control.connect(driver, file.dsn(target)) as dst:
        if placement.move_step is MoveStep.FENCE:
            await on_step(MoveStep.FENCE)
            await schema_ddl.bootstrap(src, schema)  # an org placed but never used yet
            await fence.install(src, schema, org)
            await fence.end_sessions(src, schema, org)
            placement = await control.record_step(conn, placement, MoveStep.COPY)
        if placement.move_step is MoveStep.COPY:
            await on_step(MoveStep.COPY)
            copies = await copying.plan(src, schema, org)
            await copying.prepare_target(src, dst, copies, org)
            async with control.connect(driver, file.dsn(source)) as reader:
                rows, copy_s = await copying.copy_verified(src, reader, dst, copies)
            await copying.copy_views(src, dst, schema, org)
            await copying.advance_sequences(src, dst, schema)
            await on_step(MoveStep.SWITCH)
            placement = await control.switch(conn, placement)
        await on_step(MoveStep.UNFENCE)
        await control.settle(conn, org, moved_from=source)
    return MoveReport(org, source, target, rows, time.perf_counter() - started, copy_s)


async def _abort(driver: pg.Driver, file: TenantsFile, conn: pg.Connection,
                 placement: Placement) -> MoveReport:
    if placement.move_step is None:
        raise InvalidInputError(f"no move of org {placement.org!r} is under way to abort")
    if placement.move_step is MoveStep.UNFENCE:
        raise ConflictError(f"the move of org {placement.org!r} already switched its route to "
                            f"{placement.server!r}: finish it with --resume")
    assert placement.move_to is not None
    async with control.connect(driver, file.dsn(placement.server)) as src, \
            control.connect(driver, file.dsn(placement.move_to)) as dst:
        await copying.drop_org(dst, placement.schema, placement.org)
        await fence.remove(src, placement.schema, placement.org)
    await control.settle(conn, placement.org, moved_from=placement.moved_from)
    return MoveReport(placement.org, placement.server, placement.move_to, aborted=True)


async def _drop_source(driver: pg.Driver, file: TenantsFile, conn: pg.Connection,
                       org: str, grace_s: float) -> bool:
    """Delete the org's rows from the server it moved away from (False: none to drop), once
    the move ended `grace_s` ago (module docstring)."""
    placement = Router(file, await control.read(conn)).resolve(org)
    if placement.move_step is not None:
        raise ConflictError(f"a move of org {org!r} is under way: finish it first (--resume)")
    if placement.moved_from is None or placement.moved_from == placement.server:
        return False
    await trio.sleep(max(0.0, grace_s - await control.since_update_s(conn, org)))
    async with control.connect(driver, file.dsn(placement.moved_from)) as src:
        await copying.drop_org(src, placement.schema, org)
    await control.settle(conn, org, moved_from=None)
    return True
