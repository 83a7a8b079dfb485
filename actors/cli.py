"""The `runplane` command line.

Every command connects through `engine.open_tenant` (the embedded default, or `RUNPLANE_DSN`).
Errors reach the user as one line on stderr and a non-zero exit status, never a traceback:
engine errors exit 1, usage errors 2, an interrupt 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import trio

from engine import open_tenant
from engine.errors import EngineError
from engine.schema import SCHEMA_VERSION, schema_status

DEFAULT_ORG = "local"

Command = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[Command, Callable[[argparse.ArgumentParser], None], str]] = {}


def command(name: str, help: str):
    """Register `fn(args) -> exit status` as subcommand `name`; `configure` adds its options."""

    def register(configure: Callable[[argparse.ArgumentParser], None]):
        def wrap(fn: Command) -> Command:
            COMMANDS[name] = (fn, configure, help)
            return fn

        return wrap

    return register


def _tenant_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_DSN, else embedded)")
    parser.add_argument("--org", default=os.environ.get("RUNPLANE_ORG", DEFAULT_ORG), help="org id")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"), help="tenant schema")


# -- doctor -------------------------------------------------------------------------------------
@command("doctor", "connect and report server version, schema status and permit lanes")(_tenant_options)
def doctor(args: argparse.Namespace) -> int:
    async def main() -> None:
        async with open_tenant(args.org, args.dsn, schema=args.schema) as tenant:
            version = await tenant.server_version()
            async with tenant.connection("receipts") as conn:
                status = await schema_status(conn, tenant.schema)
            print(f"server      PostgreSQL {version} at {tenant.host}")
            state = "ok" if status == SCHEMA_VERSION else f"needs bootstrap (found {status})"
            print(f"schema      {tenant.schema} version {status} ({state})")
            print(f"org         {tenant.org_id}")
            for name, stats in tenant.permits().items():
                print(f"lane        {name:<12} limit {stats.limit}")

    trio.run(main)
    return 0


# -- simulate -----------------------------------------------------------------------------------
def _simulate_options(parser: argparse.ArgumentParser) -> None:
    import simulations

    parser.add_argument("name", nargs="?", default="all", choices=[*simulations.SCENARIOS, "all"])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_TEST_DSN or a throwaway embedded server)")


@command("simulate", "run the property-tested race simulations")(_simulate_options)
def simulate(args: argparse.Namespace) -> int:
    from simulations.__main__ import main as run_simulations

    argv = [args.name, "--examples", str(args.examples)]
    if args.seed is not None:
        argv += ["--seed", str(args.seed)]
    if args.dsn:
        argv += ["--dsn", args.dsn]
    return run_simulations(argv)


# -- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runplane", description="durable, idempotent map runs on PostgreSQL")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, configure, help) in COMMANDS.items():
        configure(sub.add_parser(name, help=help, description=help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = COMMANDS[args.command][0]
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("runplane: interrupted", file=sys.stderr)
        return 130
    except EngineError as exc:
        print(f"runplane: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"runplane: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
