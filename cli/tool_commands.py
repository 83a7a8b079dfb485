"""Commands about the installation itself: `doctor`, `psql`, `views`, `index`, `simulate`."""

from __future__ import annotations

import argparse
import os

from runplane.engine.ports import RECEIPTS_LANE
from runplane.engine.schema import SCHEMA_VERSION, schema_status
from runplane.engine.sessions import password_probe

from .commands import _tenant_options, command, run_trio
from .connect import Access, open_port
from .terminal import say


# -- doctor -------------------------------------------------------------------------------------
@command("doctor", "connect and report the server, how to reach it with psql, schema status and permit lanes")(_tenant_options)
def doctor(args: argparse.Namespace) -> int:
    from .doctor import connection_budget_lines, connection_lines, outage_line

    async def main() -> None:
        async with open_port(args, access=Access.NO_DDL) as tenant:
            version = await tenant.server_version()
            async with tenant.connection(RECEIPTS_LANE) as conn:
                status = await schema_status(conn, tenant.schema)
                where = await connection_lines(conn, args.dsn or os.environ.get("RUNPLANE_DSN"))
                budget = await connection_budget_lines(conn, tenant.schema)
            say(f"server      PostgreSQL {version}")
            for line in where:
                say(line)
            if status is None:
                state = "absent; nothing created (the first `runplane run` or `demo` creates it)"
            elif status == SCHEMA_VERSION:
                state = f"version {status} (ok)"
            else:
                state = f"version {status} (the next `runplane run` or `demo` upgrades it)"
            say(f"schema      {tenant.schema} {state}")
            say(f"org         {tenant.org_id}")
            say(outage_line(tenant))
            for name, stats in tenant.permits().items():
                say(f"lane        {name:<12} limit {stats.limit}")
            for line in budget:
                say(line)
            say(f"sessions    {await password_probe(tenant)}")

    run_trio(main)
    return 0


# -- psql ---------------------------------------------------------------------------------------
def _psql_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_DSN, else embedded)")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"),
                        help="tenant schema, first on psql's search_path (default: RUNPLANE_SCHEMA, else 'runplane')")
    parser.add_argument("psql_args", nargs=argparse.REMAINDER, metavar="-- PSQL_ARGS",
                        help="passed to psql, e.g. -- -c 'SELECT * FROM runs'")


@command("psql", "a psql session on the database, keeping the embedded server up while it lasts")(_psql_options)
def psql(args: argparse.Namespace) -> int:
    from .psql import run_psql

    return run_psql(args)


# -- views --------------------------------------------------------------------------------------
def _views_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_DSN, else embedded)")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"),
                        help="tenant schema (default: RUNPLANE_SCHEMA, else 'runplane'); the views "
                        "go to <schema>_views")


@command("views", "(re)create the readable view of every sheet in <schema>_views (psql does at start)")(_views_options)
def views(args: argparse.Namespace) -> int:
    from .psql import refresh_views

    run_trio(refresh_views, args.dsn, args.schema, True)
    return 0


# -- index --------------------------------------------------------------------------------------
def _index_options(parser: argparse.ArgumentParser) -> None:
    _tenant_options(parser)
    parser.add_argument("play", help="play name")
    parser.add_argument("table", help="table namespace")
    parser.add_argument("field", help="an input field of the table")


@command("index", "index an input field of a table, so the console finds a row by its value at once")(_index_options)
def index(args: argparse.Namespace) -> int:
    from runplane.engine.errors import InvalidInputError
    from runplane.engine.sheets.field_index import create_field_index
    from runplane.engine.values.scopes import PlayScope

    from .connect import require_tenant_schema
    from .operators import UsageError

    async def main() -> None:
        async with open_port(args, access=Access.NO_DDL) as tenant:
            await require_tenant_schema(tenant)
            try:
                made = await create_field_index(tenant, PlayScope(tenant.org_id, args.play),
                                                args.table, args.field)
            except InvalidInputError as exc:
                raise UsageError(str(exc)) from None
            say(f"index {made.name} of field {made.field!r} of {args.play}/{args.table}: "
                f"{made.build.value}")

    run_trio(main)
    return 0


# -- simulate -----------------------------------------------------------------------------------
def _simulate_options(parser: argparse.ArgumentParser) -> None:
    from runplane import simulations

    parser.add_argument("name", nargs="?", default="all", choices=[*simulations.SCENARIOS, "all"])
    parser.add_argument("--examples", type=int, default=None,
                        help="examples per scenario (default: the scenario's; 100 for most)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_TEST_DSN or a throwaway embedded server)")


@command("simulate", "run the property-tested race simulations")(_simulate_options)
def simulate(args: argparse.Namespace) -> int:
    from runplane.simulations.__main__ import main as run_simulations

    argv = [args.name]
    if args.examples is not None:
        argv += ["--examples", str(args.examples)]
    if args.seed is not None:
        argv += ["--seed", str(args.seed)]
    if args.dsn:
        argv += ["--dsn", args.dsn]
    return run_simulations(argv)
