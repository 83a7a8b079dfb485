"""A map's own sheet writes overlapping (write groups) against every write taking the sheet's
lock in turn, in one run.

    python benchmarks/write_groups.py [--rows 200000] [--list-rows 100000] [--rounds 3]

A plain map's admissions and completions to one sheet form a write group
(`engine.sheets.write_group`): while the group's token holds, they hold the sheet's summary
row shared and overlap one another. The baseline is the way every sheet write went before
groups existed, and still goes for a guarded write: `group_for` answers None, so each
transaction holds the summary row exclusively from its lock statement to its `COMMIT`. Each
round maps `--rows` rows of an async iterable and `--list-rows` rows of a list (no-op
function, `open_run` to its exit, each run a play of its own), once each way, alternating
which goes first. Prints, for each source, rows/s each way, the median ratio grouped /
serialized, and how busy the machine's cores were (from `/proc/stat`, where there is one).
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from _hosting import collect_as_hosting  # noqa: E402
from _rows import CONTRACT, noop, row, stream  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402
from runplane.engine.sheets import admission, completion  # noqa: E402

SIDES = ("grouped", "serialized")


@contextlib.contextmanager
def serialized() -> Iterator[None]:
    """Every sheet write of this process outside any write group, as a guarded write is."""
    saved = admission.group_for, completion.group_for
    admission.group_for = completion.group_for = lambda *_args, **_kwargs: None
    try:
        yield
    finally:
        admission.group_for, completion.group_for = saved


def busy_ticks() -> tuple[int, int] | None:
    """(busy, all) CPU ticks of the whole machine so far, or None without `/proc/stat`."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:8]]
    except OSError:
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # idle and iowait are not busy


async def one_map(tenant, source, rows: int) -> tuple[float, float | None]:
    """(rows/s, cores busy on average) of one run mapping `source`, open_run to its exit."""
    before, started = busy_ticks(), time.perf_counter()
    async with open_run(tenant, f"wg-{uuid.uuid4().hex[:8]}") as run:
        result = await run.map("t", source, noop, contract=CONTRACT, concurrency=16)
    elapsed, after = time.perf_counter() - started, busy_ticks()
    assert result.completed == rows, result
    cores = None
    if before is not None and after is not None:
        cores = (after[0] - before[0]) / os.sysconf("SC_CLK_TCK") / elapsed
    return rows / elapsed, cores


async def bench(dsn: str, args) -> None:
    schema = f"bench_wg_{uuid.uuid4().hex[:8]}"
    sources = {"async iterable": (args.rows, lambda: stream(args.rows)),
               "list": (args.list_rows, lambda: [row(i) for i in range(args.list_rows)])}
    figures: dict[tuple[str, str], list[tuple[float, float | None]]] = {
        (name, side): [] for name in sources for side in SIDES}
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            for r in range(args.rounds):
                for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                    for name, (rows, make) in sources.items():
                        if rows <= 0:
                            continue
                        source = make()
                        with serialized() if side == "serialized" else contextlib.nullcontext():
                            figures[name, side].append(await one_map(tenant, source, rows))
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    for name, (rows, _) in sources.items():
        if rows <= 0:
            continue
        grouped, alone = figures[name, "grouped"], figures[name, "serialized"]
        ratio = statistics.median(g[0] / s[0] for g, s in zip(grouped, alone))
        print(f"{name}, {rows:,} rows: rows/s grouped / serialized {ratio:.2f} "
              f"(median {statistics.median(g[0] for g in grouped):,.0f} / "
              f"{statistics.median(s[0] for s in alone):,.0f})"
              + _cores(grouped, alone), flush=True)


def _cores(grouped: list, alone: list) -> str:
    if any(figure[1] is None for figure in grouped + alone):
        return ""
    return (f"; cores busy {statistics.median(g[1] for g in grouped):.2f} grouped, "
            f"{statistics.median(s[1] for s in alone):.2f} serialized")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--list-rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    print(collect_as_hosting(), flush=True)
    trio.run(bench, args.dsn or bench_dsn(), args)


if __name__ == "__main__":
    main()
