"""The `runplane` command line.

Every command connects through `engine.open_tenant` (the embedded default, or `RUNPLANE_DSN`);
`run`, `demo` and `status` can go through a gateway instead (`--gateway URL` or
`RUNPLANE_GATEWAY_URL`, with the token in `RUNPLANE_TOKEN`), needing no database access at all.
Errors reach the user as one line on stderr and a non-zero exit status, never a traceback:
engine errors and refusals exit 1, usage errors (bad arguments, unreadable input files) 2, rows
that failed under `--fail-on-row-errors` 3, an interrupt or a cancelled run 130. Errors that come out of trio
nurseries as exception groups are unwrapped to their first leaf for that line. A run that ends
any other way than success (interrupt, SIGTERM, a store failure, a failing play, a simulated
crash) exits non-zero and prints the command that resumes it on stderr (see
`operators.RunNotice`). A second or third Ctrl-C while the command winds down only says it is
stopping; `--json` (status, runs, failures, run) prints one JSON document on stdout and the
human lines on stderr (see `terminal`). Printed text goes through
`terminal.clean`: stored or user-supplied text never reaches the terminal with control
characters in it.

Commands: `demo` (the main job, see `cli.demo`), `run PLAY.py` (a user's play), `status`,
`failures`, `runs`, `supervise`, `doctor`, `simulate`. `status`, `failures`, `runs` and
`doctor` are read-only: they open the tenant without bootstrap and create nothing.

The commands live in a module per group (`tool_commands`: doctor, psql, simulate;
`run_commands`: demo, run; `data_commands`: status, failures, export, runs; `server_commands`:
supervise, serve, token, console; `worker`; `placement_commands`: move-org), registered
through `commands.command`; this module builds the parser and turns errors into exit statuses.
The process's own hosting command (`collector.HOSTING_COMMANDS`) runs with the garbage
collector tuned (`cli.collector`).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from runplane.engine.errors import EngineError, leaf_errors, public_name

# The command modules register their commands at import, in this order (the order of `--help`).
from . import tool_commands, run_commands, data_commands, server_commands
from . import worker  # registers `runplane worker`
from . import placement_commands  # registers `runplane move-org`, last
from . import collector, observing
from .commands import COMMANDS
from .inputs import InputFileError
from .operators import CommandError, RunCancelled, UsageError
from .terminal import emit_json, warn

# What registered `COMMANDS`, in registration order (imported above for that alone).
COMMAND_MODULES = (tool_commands, run_commands, data_commands, server_commands, worker,
                   placement_commands)


# -- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runplane", description="durable, idempotent map runs on PostgreSQL")
    parser.add_argument("--version", action="version", version=f"runplane {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, configure, help) in COMMANDS.items():
        # No abbreviations: the resume command is rebuilt from the exact option names.
        command_parser = sub.add_parser(name, help=help, description=help, allow_abbrev=False)
        configure(command_parser)
        observing.add_options(name, command_parser)  # --log-format, --metrics-bind
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("runplane")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    process = argv is None  # the process's own command (not a call from Python)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command and its arguments, for resume commands
    args.notice = None
    args.json_stream = sys.stdout  # with --json, the one document goes here ...
    human = contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else None
    handler = COMMANDS[args.command][0]
    try:
        observing.apply(args)
        placement_commands.apply(args)  # --tenants: the org's server and schema
        if process and args.command in collector.HOSTING_COMMANDS:
            collector.tune_for_hosting()  # after every import and the parse
        if human is None:
            return handler(args)
        with human:  # ... and every other line to stderr
            return handler(args)
    except BaseException as raised:  # reported as one line below, or re-raised
        exc = leaf_errors(raised)[0]  # the first, unwrapped from nested groups
        status = _report(exc, args.command)
        if status is None:
            raise
        notice = args.notice
        if (notice is not None and notice.resume_command is not None
                and getattr(exc, "resumable", True)):
            warn(f"runplane: resume run {notice.run_id} with: {notice.resume_command}")
            if getattr(args, "json", False):
                emit_json({"run_id": notice.run_id, "status": "unfinished", "exit_status": status,
                           "error": str(exc), "resume_command": notice.resume_command},
                          args.json_stream)
        return status
    finally:
        if process:  # the exit handlers (stopping the embedded server) run without Ctrl-C
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _report(exc: BaseException, command_name: str) -> int | None:
    """Print `exc` as one line and return the exit status, or None to let it through."""
    if isinstance(exc, KeyboardInterrupt):
        warn("runplane: interrupted")
        return 130
    if isinstance(exc, RunCancelled):
        warn(f"runplane: {exc}")
        return 130
    if isinstance(exc, (UsageError, InputFileError)):
        warn(f"runplane: {exc}")
        return 2
    if isinstance(exc, CommandError):
        warn(f"runplane: {exc}")
        return 1
    if isinstance(exc, EngineError):
        warn(f"runplane: {public_name(exc)}: {exc}")
        return 1
    if isinstance(exc, OSError):
        warn(f"runplane: {exc}")
        return 1
    if isinstance(exc, Exception) and command_name == "run":
        warn(f"runplane: the play failed: {type(exc).__name__}: {exc}")
        return 1
    return None
