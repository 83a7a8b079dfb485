"""`runplane console`: the web console on loopback, behind a one-time login link.

Reads `--dsn` / `RUNPLANE_DSN` (else the embedded server) and `--schema` / `RUNPLANE_SCHEMA` like
every command, opens the store read-only (nothing is created; a schema with no runplane tables
yet is served with an empty runs page that fills in once a run creates them), serves `/ui/` on
`--bind`
(loopback only; default 127.0.0.1:8788) and prints the login link
`http://HOST:PORT/ui/login?once=CODE` as one flushed line with the port actually bound. The link
works once and opens a session that sees every org and may take every action. Retries started
from it are coordinated in this process (`actors.retrying.RetryHost`); the play's `runplane
worker`s run their rows.

With `--tenants FILE --org ORG` it serves the server and schema the file's control table places
ORG on, and follows ORG when it moves (`engine.placement.following`): its reader and retries go
where ORG lives, an action of an org the table names goes where that org lives.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import trio

DEFAULT_BIND = "127.0.0.1:8788"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_DSN, else embedded)")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"),
                        help="tenant schema (default: RUNPLANE_SCHEMA, else 'runplane')")
    parser.add_argument("--org", default=os.environ.get("RUNPLANE_ORG"),
                        help="with --tenants: serve the server this org is placed on, "
                        "following its moves (default: RUNPLANE_ORG)")
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="a tenants file (TOML): serve where it places --org (instead of "
                        "--dsn and --schema)")
    parser.add_argument("--bind", default=DEFAULT_BIND, metavar="HOST:PORT",
                        help=f"loopback address to listen on (default {DEFAULT_BIND}; port 0 picks a free one)")


def console(args: argparse.Namespace) -> int:
    from runplane.actors.retrying import RetryHost
    from runplane.engine.console import open_console
    from runplane.engine.placement.following import following

    from .commands import run_trio

    # Placed by a tenants file: every tenant opened without a DSN follows its org (or ORG's).
    dsn = None if args.tenants else args.dsn

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if args.tenants:
                await stack.enter_async_context(following(args.tenants, args.org))
            async with trio.open_nursery() as nursery:  # hosts the console's retries
                host = RetryHost(dsn, args.schema, nursery)
                await serve_console(host)
                nursery.cancel_scope.cancel()

    async def serve_console(host) -> None:
        async with open_console(dsn=dsn, schema=args.schema, bind=args.bind,
                                start_retry=host.start) as server:
            note = "" if server.schema_ready else (
                ", no runplane tables yet: pages fill in once a run creates them")
            print(f"console listening on {server.url}/ui/ (schema {args.schema}{note}; Ctrl-C "
                  "to stop); open this link to log in (it works once):", flush=True)
            print(server.login_url(), flush=True)
            await trio.sleep_forever()

    run_trio(main)
    return 0
