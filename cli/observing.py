"""The options every command shares for observability: `--log-format` and `--metrics-bind`.

- `--log-format human|json` is added to every command (`cli.main.build_parser`), commands added
  later included; `apply` switches the process's logging once, before the command runs
  (`engine.observability.logs`).
- `--metrics-bind HOST:PORT` (a bare PORT: 127.0.0.1) is added to the commands that host rows or
  serve (`METRICS_COMMANDS`); `run_trio` (`cli.commands`) then serves `/metrics` on it inside the
  command's trio run for as long as the command runs (`engine.observability.exposition`), and
  one line on stderr names the URL bound (port 0 picks a free one).
"""

from __future__ import annotations

import argparse
import sys

import trio

from runplane.engine.errors import InvalidInputError
from runplane.engine.observability import logs
from runplane.engine.observability.exposition import parse_bind, serve_metrics

from .operators import UsageError
from .terminal import say

METRICS_COMMANDS = ("run", "worker", "supervise", "demo", "serve", "console")

_metrics_bind: str | None = None


def add_options(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=[f.value for f in logs.LogFormat],
                        default=logs.LogFormat.HUMAN.value,
                        help="log lines on stderr: human (default) or json (one object a line: "
                        "time, level, message, org, play, run_id, map)")
    if name in METRICS_COMMANDS:
        parser.add_argument("--metrics-bind", default=None, metavar="HOST:PORT",
                            help="serve Prometheus metrics at http://HOST:PORT/metrics while the "
                            "command runs (a bare PORT listens on 127.0.0.1; port 0 picks one)")


def apply(args: argparse.Namespace) -> None:
    """Switch the process's log format and remember the metrics bind (checked here: exit 2)."""
    global _metrics_bind
    logs.use(logs.LogFormat(getattr(args, "log_format", logs.LogFormat.HUMAN.value)))
    _metrics_bind = getattr(args, "metrics_bind", None)
    if _metrics_bind is not None:
        try:
            parse_bind(_metrics_bind)
        except InvalidInputError as exc:
            raise UsageError(str(exc)) from None


async def start_metrics(nursery: trio.Nursery) -> None:
    """Serve `/metrics` in `nursery` when `--metrics-bind` was given."""
    if _metrics_bind is not None:
        url = await nursery.start(serve_metrics, _metrics_bind)
        say(f"runplane: metrics at {url}", file=sys.stderr)
