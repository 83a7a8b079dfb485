"""`runplane worker PLAY.py`: join the open shared maps of a play and run their rows.

The worker connects like every command (`--dsn` / `RUNPLANE_DSN`, `--org`, `--schema`; or
`--gateway URL` with the token in `RUNPLANE_TOKEN`, and `--db-sessions`), loads the play file, and serves the play's shared maps (`actors.shared.worker.serve_play`) until
interrupted, or with `--exit-when-idle` until no waiting or open shared map of the play has a
unit not done (waiting up to 60 s for one to appear). The play is resolved exactly as
`runplane run` resolves it (the file is imported: `PLAY` may be computed, else the file's stem),
unless `--play` says otherwise. The worker prints one line naming the org, play and shared map
it joins, and one as it leaves it. A play file that differs from the one a map was published
with, or that lacks its function, is refused with one line naming both (exit 1).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .connect import open_port
from .commands import _port_options, _positive, command, run_trio
from .operators import UsageError
from .terminal import say


def _worker_options(parser: argparse.ArgumentParser) -> None:
    _port_options(parser)
    parser.add_argument("play_file", metavar="PLAY.py",
                        help="the play file whose function the shared maps run")
    parser.add_argument("--play", dest="play_name", default=None,
                        help="play name (default: PLAY in the file, else its stem)")
    parser.add_argument("--concurrency", type=_positive, default=None,
                        help="rows run at once (default: the map's concurrency)")
    parser.add_argument("--exit-when-idle", action="store_true",
                        help="exit once no shared map of the play has work left")


LIVE_WORKER_S = 60.0  # `runplane status` lists the workers seen this recently


async def show_workers(port, play: str) -> None:
    """`runplane status`: the workers of the play's shared maps seen lately (pid, host, units
    done)."""
    from runplane.engine.shared import maps as shared_maps

    for worker in await shared_maps.workers(port, play):
        if worker.seen_s_ago <= LIVE_WORKER_S:
            say(f"worker pid {worker.pid} on {worker.host}: {worker.units_done} units done "
                f"(seen {worker.seen_s_ago:.0f} s ago)")


@command("worker", "join the open shared maps of a play and run their rows")(_worker_options)
def worker(args: argparse.Namespace) -> int:
    from runplane.actors.shared.config import PlayFile
    from runplane.actors.shared.worker import WorkerOptions, serve_play

    if not Path(args.play_file).is_file():
        raise UsageError(f"{args.play_file}: no such file")
    if args.dsn is None and "RUNPLANE_DSN" in os.environ:
        args.dsn = os.environ["RUNPLANE_DSN"]
    # As `runplane run` resolves it: the imported file's `PLAY` (it may be computed), else its
    # stem. The import is the one the worker serves with (`PlayFile.load` keeps it).
    play = args.play_name or str(getattr(PlayFile.load(args.play_file).module, "PLAY",
                                         Path(args.play_file).stem))

    async def main() -> int:
        async with open_port(args) as tenant:
            say(f"worker {os.getpid()}: serving org {tenant.org_id!r}, play {play!r}")
            units = await serve_play(tenant, play, args.play_file, WorkerOptions(
                concurrency=args.concurrency, exit_when_idle=args.exit_when_idle, notify=say))
        say(f"worker {os.getpid()}: {units} units done")
        return 0

    return run_trio(main)

