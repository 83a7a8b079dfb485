"""The command registry and what the commands share: option groups, argument types, `run_trio`.

How it works
- `@command(name, help)(configure)` registers `fn(args) -> exit status` as subcommand `name`;
  `configure` adds its options. The command modules (`tool_commands`, `run_commands`,
  `data_commands`, `server_commands`, `worker`) register at import, and `cli.main` builds the
  parser from `COMMANDS` in registration order.
- `run_trio` runs a command's trio code with SIGINT and SIGTERM turned into a cancellation, so
  teardown runs at checkpoints and the command then exits as interrupted; it also serves
  `/metrics` for the command's run with `--metrics-bind` (`cli.observing`).
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Awaitable, Callable, TypeVar

import trio

from . import observing
from .connect import Access, open_port
from .terminal import warn

T = TypeVar("T")

DEFAULT_ORG = "local"
ROW_ERRORS_EXIT = 3

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
    parser.add_argument("--org", default=os.environ.get("RUNPLANE_ORG", DEFAULT_ORG),
                        help=f"org id (default: RUNPLANE_ORG, else {DEFAULT_ORG!r})")
    parser.add_argument("--schema", default=os.environ.get("RUNPLANE_SCHEMA", "runplane"),
                        help="tenant schema (default: RUNPLANE_SCHEMA, else 'runplane')")
    parser.add_argument("--tenants", default=os.environ.get("RUNPLANE_TENANTS") or None,
                        metavar="FILE",
                        help="a tenants file (TOML): connect to the server and schema it places "
                        "--org on, following its moves (instead of --dsn and --schema; default: "
                        "RUNPLANE_TENANTS)")


def _port_options(parser: argparse.ArgumentParser) -> None:
    """A tenant's options, or a gateway to go through instead."""
    _tenant_options(parser)
    parser.add_argument("--gateway", default=os.environ.get("RUNPLANE_GATEWAY_URL") or None,
                        metavar="URL", help="work through a gateway (default: RUNPLANE_GATEWAY_URL); "
                        "the token comes from RUNPLANE_TOKEN, the org from the token")
    parser.add_argument("--db-sessions", action="store_true",
                        help="with --gateway: get short-lived database sessions from the gateway and "
                        "run sheet, receipt and array-input work straight against PostgreSQL")


def _read_only(args: argparse.Namespace):
    """The tenant of a read-only command: a reader, on RUNPLANE_READ_DSN when set (or, with
    `--gateway`, the gateway)."""
    return open_port(args, access=Access.READS)


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout (other lines go to stderr)")


def _row_error_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fail-on-row-errors", action="store_true",
                        help=f"exit {ROW_ERRORS_EXIT} when any row of the run failed")


# -- argument types --------------------------------------------------------------------------
def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 100, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of calls a second > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def run_trio(async_fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """`trio.run`, with SIGINT and SIGTERM turned into a cancellation of the whole command.

    Teardown (flushing computed outcomes, rollbacks, closing the pool) then runs at checkpoints,
    instead of a KeyboardInterrupt landing inside driver or event-loop code; afterwards the
    command raises KeyboardInterrupt so `main` reports "interrupted" and exits 130.
    """

    async def guarded() -> T:
        interrupted = False
        result = None

        async def watch(scope: trio.CancelScope) -> None:
            nonlocal interrupted
            async for _ in signals:
                if interrupted:  # a second Ctrl-C: the first one is being honoured
                    warn("runplane: stopping (writing what was computed); please wait")
                    continue
                interrupted = True
                scope.cancel()

        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                work = trio.CancelScope()
                nursery.start_soon(watch, work)
                await observing.start_metrics(nursery)  # with --metrics-bind
                with work:
                    result = await async_fn(*args)
                nursery.cancel_scope.cancel()
        if interrupted:
            raise KeyboardInterrupt
        return result

    return trio.run(guarded)
