"""A map's writes overlapping, as built, against the two ways they went before, in one run.

    python benchmarks/overlap.py [--rows 200000] [--list-rows 100000] [--rounds 3]

As built, a plain map's admissions and completions to one sheet form a write group
(`engine.sheets.write_group`): while the group's token holds they hold the sheet's summary row
shared and overlap one another; and the map keeps up to `ADMISSIONS_IN_FLIGHT` units on their
way (`actors.admission`) and `COMPLETION_WRITERS` completion batches (`actors.completer`).
The baselines, each switched in this process between maps:
- `serialized`: no write groups — `group_for` answers None, as for a guarded write, so each
  transaction holds the summary row exclusively from its lock statement to its `COMMIT`
  (every sheet write before write groups);
- `narrow`: write groups, but one completion writer and two units in flight (the pipeline
  before it was widened).
Each round maps `--rows` rows of an async iterable and `--list-rows` rows of a list (no-op
function, `open_run` to its exit, each run a play of its own) once each way, in an order that
turns each round. Prints, for each source, rows/s each way, the median ratio as built / each
baseline, and how busy the machine's cores were (from `/proc/stat`, where there is one).
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import contextlib
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
from _machine import machine_busy_s  # noqa: E402
from _rows import CONTRACT, noop, row, stream  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402
from runplane.actors import admission as admission_actor, mapper  # noqa: E402
from runplane.engine.sheets import admission, completion  # noqa: E402

SIDES = ("as built", "serialized", "narrow")


@contextlib.contextmanager
def serialized() -> Iterator[None]:
    """Every sheet write of this process outside any write group, as a guarded write is."""
    saved = admission.group_for, completion.group_for
    admission.group_for = completion.group_for = lambda *_args, **_kwargs: None
    try:
        yield
    finally:
        admission.group_for, completion.group_for = saved


@contextlib.contextmanager
def narrow() -> Iterator[None]:
    """One completion writer and two units in flight a map."""
    saved = mapper.COMPLETION_WRITERS, admission_actor.ADMISSIONS_IN_FLIGHT
    mapper.COMPLETION_WRITERS, admission_actor.ADMISSIONS_IN_FLIGHT = 1, 2
    try:
        yield
    finally:
        mapper.COMPLETION_WRITERS, admission_actor.ADMISSIONS_IN_FLIGHT = saved


SWITCHES = {"as built": contextlib.nullcontext, "serialized": serialized, "narrow": narrow}


async def one_map(tenant, source, rows: int) -> tuple[float, float | None]:
    """(rows/s, cores busy on average) of one run mapping `source`, open_run to its exit."""
    before, started = machine_busy_s(), time.perf_counter()
    async with open_run(tenant, f"ov-{uuid.uuid4().hex[:8]}") as run:
        result = await run.map("t", source, noop, contract=CONTRACT, concurrency=16)
    elapsed, after = time.perf_counter() - started, machine_busy_s()
    assert result.completed == rows, result
    cores = None if before is None or after is None else (after - before) / elapsed
    return rows / elapsed, cores


async def bench(dsn: str, args) -> None:
    schema = f"bench_overlap_{uuid.uuid4().hex[:8]}"
    sources = {"async iterable": (args.rows, lambda: stream(args.rows)),
               "list": (args.list_rows, lambda: [row(i) for i in range(args.list_rows)])}
    figures: dict[tuple[str, str], list[tuple[float, float | None]]] = {
        (name, side): [] for name in sources for side in SIDES}
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            for r in range(args.rounds):
                for side in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
                    for name, (rows, make) in sources.items():
                        if rows <= 0:
                            continue
                        source = make()
                        with SWITCHES[side]():
                            figures[name, side].append(await one_map(tenant, source, rows))
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    for name, (rows, _) in sources.items():
        if rows <= 0:
            continue
        built = figures[name, "as built"]
        line = [f"{name}, {rows:,} rows: as built {statistics.median(b[0] for b in built):,.0f}"
                f" rows/s{_cores(built)}"]
        for side in SIDES[1:]:
            other = figures[name, side]
            ratio = statistics.median(b[0] / o[0] for b, o in zip(built, other))
            line.append(f"/ {side} {ratio:.2f} ({statistics.median(o[0] for o in other):,.0f}"
                        f" rows/s{_cores(other)})")
        print("; ".join(line), flush=True)


def _cores(figures: list) -> str:
    if any(figure[1] is None for figure in figures):
        return ""
    return f", cores busy {statistics.median(f[1] for f in figures):.2f}"


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
