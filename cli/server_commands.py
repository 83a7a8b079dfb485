"""Long-running service commands: `supervise`, `serve` (the gateway), `token`, `console`."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets

import trio

from runplane.engine import open_tenant
from runplane.engine.sessions import sweep_expired as sweep_expired_sessions

from . import console as _console
from .commands import DEFAULT_ORG, _positive, _tenant_options, command, run_trio
from .operators import CommandError, UsageError
from .terminal import say


# -- supervise ----------------------------------------------------------------------------------
def _supervise_options(parser: argparse.ArgumentParser) -> None:
    _tenant_options(parser)
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between idle polls")
    parser.add_argument("--abandon-after", type=float, default=None, metavar="SECONDS",
                        help="also retire open runs untouched this long (never woken again)")
    parser.set_defaults(routes_by_org=True)  # --tenants: every placed org, each on its server


@command("supervise", "drain the terminal outbox (retire finished runs) until interrupted")(_supervise_options)
def supervise(args: argparse.Namespace) -> int:
    from runplane.actors import open_supervisor

    if args.tenants:
        from .placement_commands import supervise_placed

        return supervise_placed(args)

    async def main() -> None:
        async with open_tenant(args.org, args.dsn, schema=args.schema) as tenant:
            async with open_supervisor(tenant, poll_interval=args.poll,
                                       abandon_after_s=args.abandon_after) as sup:
                say(f"supervising org {tenant.org_id} in schema {tenant.schema} "
                    f"as {sup.owner} (Ctrl-C to stop)")
                await sweep_expired_sessions(tenant)  # drops expired database sessions, forever

    run_trio(main)
    return 0


# -- the gateway: serve and token --------------------------------------------------------------
SECRET_ENV = "RUNPLANE_GATEWAY_SECRET"


def _serve_options(parser: argparse.ArgumentParser) -> None:
    from runplane.engine.gateway import DEFAULT_BODY_LIMIT

    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_DSN, else embedded)")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"), help="tenant schema")
    parser.add_argument("--bind", default="127.0.0.1:8787", metavar="HOST:PORT",
                        help="where to listen (default 127.0.0.1:8787; port 0 picks a free one)")
    parser.add_argument("--body-limit", type=_positive, default=DEFAULT_BODY_LIMIT, metavar="BYTES",
                        help=f"largest request body accepted (default {DEFAULT_BODY_LIMIT:,})")
    parser.add_argument("--no-array-actions", action="store_true",
                        help="answer array-input actions as unsupported (an older gateway)")
    parser.add_argument("--dev", action="store_true",
                        help=f"without {SECRET_ENV}: a throwaway secret and a printed token for org local")
    parser.add_argument("--log-interval", type=float, default=60.0, metavar="SECONDS",
                        help="seconds between statistics log lines (default 60)")
    parser.add_argument("--max-connections", type=_positive, default=None, metavar="N",
                        help="connections the gateway may hold to its server, shared fairly by "
                        "every org (default: half of what max_connections leaves past the owner "
                        "reserve and the session budget; for a server on this machine, at most "
                        "6 a core)")
    parser.add_argument("--session-dsn", default=None, metavar="URL",
                        help="the postgresql:// address runners reach the database at, for the URLs "
                        "of database sessions (default: the gateway's own DSN)")
    parser.add_argument("--forwarded-allow", action="append", default=[], metavar="HOST",
                        help="a proxy (its IP address as this server sees it; repeatable or "
                        "comma-separated; * for any) whose X-Forwarded-Proto and X-Forwarded-Host "
                        "the console believes: its cookie is Secure when the proxy says https")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="serve HTTPS with this PEM certificate (with --tls-key); the "
                        "console's cookie is then Secure")
    parser.add_argument("--tls-key", default=None, metavar="FILE",
                        help="the PEM private key of --tls-cert")
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="a tenants file (TOML): route each request by its token's org to "
                        "that org's server (instead of --dsn and --schema)")
    parser.set_defaults(routes_by_org=True)


@command("serve", "serve the runtime actions over HTTP (the gateway) until interrupted")(_serve_options)
def serve(args: argparse.Namespace) -> int:
    from runplane.engine.gateway import ServerOptions, mint_token, open_server
    from runplane.engine.placement.router import open_router

    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        if not args.dev:
            raise UsageError(f"{SECRET_ENV} is not set: the gateway needs a signing secret for its "
                             "tokens (or pass --dev for a throwaway one)")
        secret = secrets.token_urlsafe(32)
    from .serving import address_in_use, configure_logging

    configure_logging()  # the embedded server's lines go to a file in RUNPLANE_HOME

    async def main() -> None:
        options = ServerOptions(bind=args.bind, body_limit=args.body_limit,
                                array_actions=not args.no_array_actions,
                                log_interval_s=args.log_interval, session_dsn=args.session_dsn,
                                tls_cert=args.tls_cert, tls_key=args.tls_key,
                                forwarded_allow=_forwarded_allow(args.forwarded_allow),
                                max_connections=args.max_connections)
        async with contextlib.AsyncExitStack() as stack:
            router = None if not args.tenants else await stack.enter_async_context(
                open_router(args.tenants))  # polled every second; SIGHUP reloads the file
            server = await stack.enter_async_context(open_server(
                secret=secret, dsn=args.dsn, schema=args.schema, options=options, router=router))
            actions = "off" if args.no_array_actions else "on"
            where = f"schema {args.schema}" if router is None else f"tenants {args.tenants}"
            print(f"gateway listening on {server.url} ({where}, body limit "
                  f"{server.options.body_limit:,} bytes, array actions {actions}; Ctrl-C to stop)", flush=True)
            if args.dev:
                print(f"dev token for org {DEFAULT_ORG}: {mint_token(secret, DEFAULT_ORG)}", flush=True)
            await trio.sleep_forever()

    try:
        run_trio(main)
    except BaseException as raised:  # a taken address is one line naming it
        problem = address_in_use(raised, args.bind)
        if problem is None:
            raise
        raise CommandError(problem) from None
    return 0


def _forwarded_allow(values: list[str]) -> tuple[str, ...]:
    """`--forwarded-allow` values: each repeatable, each a comma-separated list of hosts."""
    return tuple(host.strip() for value in values for host in value.split(",") if host.strip())


def _token_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--org", default=os.environ.get("RUNPLANE_ORG", DEFAULT_ORG), help="the one org the token acts for")
    parser.add_argument("--play", action="append", default=None, metavar="PLAY",
                        help="a play the token may touch (repeatable; default: every play)")
    parser.add_argument("--action", action="append", default=None, metavar="ACTION",
                        help="an action it may call, e.g. receipts.claim or sheets.* (repeatable; default: all)")
    parser.add_argument("--run", action="append", default=None, metavar="RUN_ID",
                        help="a run it may name (repeatable; default: every run)")
    parser.add_argument("--ttl", type=float, default=3600.0, metavar="SECONDS", help="lifetime (default 3600)")


@command("token", f"print a gateway token signed with {SECRET_ENV}")(_token_options)
def token(args: argparse.Namespace) -> int:
    from runplane.engine.gateway import mint_token

    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise UsageError(f"{SECRET_ENV} is not set: a token is signed with the gateway's secret")
    print(mint_token(secret, args.org, plays=args.play or ("*",), actions=args.action or ("*",),
                     ttl_s=args.ttl, runs=args.run))
    return 0


# -- console (see cli.console) ---------------------------------------------------------------
command("console", "serve the web console on loopback, behind a one-time login link")(
    _console.configure)(_console.console)
