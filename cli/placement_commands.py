"""Many servers on the command line: `move-org`, `--tenants FILE` for the other commands, and
`supervise --tenants` (docs/guide/operations.md, "Moving an org").

- `move-org ORG --to SERVER --tenants FILE` moves an org online (`engine.placement.move`);
  `--resume` / `--abort` finish or roll back an interrupted move; `--drop-source` deletes the
  org's rows from the server it left (alone, or after a move in the same command).
- `apply(args)`: a command given `--tenants FILE` (and no `--dsn`) is pointed at the server and
  schema the control table places `--org` on as it starts. Commands that open their tenant
  through `connect.open_port` (`run`, `worker`, `demo`, `retry`, `status`, ...) and the
  console then follow the org while they run (`engine.placement.following`); the others
  (`psql`, `views`) use the server read at start. `serve` and `supervise` route by org themselves
  (`routes_by_org`) and follow moves while they run.
- `supervise_placed(args)`: one supervisor per org the control table names, each on its
  org's server, restarted on the new server when its org moves (the router's poll).
"""

from __future__ import annotations

import argparse

import trio

from runplane.engine import open_tenant
from runplane.engine.placement.control import Placement
from runplane.engine.placement.move import MoveRequest, move_org
from runplane.engine.placement.router import Router, load_router, open_router
from runplane.engine.placement.tenants_file import DEFAULT_ORG, load_tenants_file

from .commands import command, run_trio
from .operators import UsageError
from .terminal import say, warn


def tenants_option(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    parser.add_argument("--tenants", default=None, required=required, metavar="FILE",
                        help="the tenants file (TOML): which server and schema each org is on")


def apply(args: argparse.Namespace) -> None:
    """Point a command given `--tenants` at its org's server and schema (see the docstring)."""
    path = getattr(args, "tenants", None)
    if not path or getattr(args, "routes_by_org", False) or getattr(args, "gateway", None):
        return
    if getattr(args, "dsn", None):
        raise UsageError("--tenants and --dsn exclude each other")
    if not getattr(args, "org", None):
        raise UsageError("--tenants needs --org ORG (or RUNPLANE_ORG): the org to follow")

    async def resolve() -> tuple[Placement, str]:
        router = await load_router(path)
        placement = router.resolve(args.org)
        return placement, router.dsn(placement.server)

    placement, args.dsn = trio.run(resolve)
    args.schema = placement.schema
    if placement.fenced:
        warn(f"runplane: org {args.org} is being moved to {placement.move_to}: its writes wait")


# -- supervise --tenants ----------------------------------------------------------------------
async def _supervise_org(router: Router, org: str, poll: float) -> None:
    from runplane.actors import open_supervisor
    from runplane.engine.sessions import sweep_expired

    while True:
        placement = router.resolve(org)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                async def watch() -> None:  # a move: start again on the new server
                    while router.resolve(org).server == placement.server:
                        await router.wait_for_poll()
                    scope.cancel()

                nursery.start_soon(watch)
                async with open_tenant(org, router.dsn(placement.server),
                                       schema=placement.schema) as tenant:
                    async with open_supervisor(tenant, poll_interval=poll):
                        say(f"supervising org {org} on server {placement.server}")
                        await sweep_expired(tenant)
        await router.wait_for_poll()


def supervise_placed(args: argparse.Namespace) -> int:
    async def main() -> None:
        async with open_router(args.tenants) as router:
            async with trio.open_nursery() as nursery:
                started: set[str] = set()
                while True:
                    for org in sorted(set(router.placements) - started - {DEFAULT_ORG}):
                        started.add(org)
                        nursery.start_soon(_supervise_org, router, org, args.poll)
                    await router.wait_for_poll()

    run_trio(main)
    return 0


# -- move-org ---------------------------------------------------------------------------------
def _move_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("org", metavar="ORG", help="the org to move")
    parser.add_argument("--to", default=None, metavar="SERVER",
                        help="the server (a [servers.NAME] of the tenants file) to move it to")
    tenants_option(parser, required=True)
    parser.add_argument("--resume", action="store_true",
                        help="finish an interrupted move from the step it recorded")
    parser.add_argument("--abort", action="store_true",
                        help="roll an interrupted move back (before its route switched)")
    parser.add_argument("--drop-source", action="store_true",
                        help="delete the org's rows from the server it moved away from")


@command("move-org", "move an org to another server online (fence, copy, verify, switch)")(
    _move_options)
def move_org_command(args: argparse.Namespace) -> int:
    if not (args.to or args.resume or args.abort or args.drop_source):
        raise UsageError("move-org needs --to SERVER (or --resume, --abort, --drop-source)")
    file = load_tenants_file(args.tenants)
    request = MoveRequest(args.org, to=args.to, resume=args.resume, abort=args.abort,
                          drop_source=args.drop_source)
    report = run_trio(move_org, file, request)
    if report.aborted:
        say(f"move of org {report.org} to {report.target} rolled back; it stays on "
            f"{report.source}")
    elif report.rows:
        say(f"moved org {report.org} from {report.source} to {report.target}: "
            f"{sum(report.rows.values()):,} rows in {len(report.rows)} tables, verified; "
            f"fenced {report.fenced_s:.2f} s (copy {report.copy_s:.2f} s)")
    if report.dropped:
        say(f"dropped org {report.org}'s rows from the server it left")
    return 0
