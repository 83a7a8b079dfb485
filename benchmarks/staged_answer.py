"""A staged page's admission through a gateway: pending rows answered by index against in full.

    python benchmarks/staged_answer.py [--rows 1000] [--calls 30] [--rounds 5]

A list of one page (at most 1,000 rows: a small list, the kind a hundred orgs each map at
once through one gateway, `gateway_orgs.py`) is admitted in one request from the page it
staged. The client has the rows, so the gateway answers the pending ones as input indexes
alone (`runplane-rows: by-index`) and the client takes its own rows for them. The baseline is
the form this replaced, measured in the same run on the same gateway: the same request without
the header, each pending row answered in full (key, input index and row) and decoded by the
action's codec. Each call admits `--rows` new rows from a page staged for it beforehand (the
staging is outside the clock); `--calls` calls a side, alternating which side goes first each
round. Prints, a call and for each side, the median over `--rounds` rounds of: the call's
time, this process's CPU (the client) and the gateway child's CPU; and the ratios by index /
in full.
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gateway as child_gateway  # noqa: E402  (its `--serve-child` runs the gateway)
from _hosting import collect_as_hosting  # noqa: E402
from _rows import CONTRACT, row  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.engine import RunScope, array_input, open_tenant, runs, sheets  # noqa: E402
from runplane.engine.array_input.pages import encode_page  # noqa: E402
from runplane.engine.gateway import mint_token, open_gateway, senders  # noqa: E402
from runplane.engine.sheets import StagedPage  # noqa: E402
from runplane.engine.sheets.inputs import prepare_rows  # noqa: E402

ORG, PLAY = child_gateway.ORG, "staged"
SIDES = ("by index", "in full")


async def in_full(gateway, action, arguments: dict, namespace: str, offset: int):
    """The baseline: the staged page's admission answered in full, decoded by the codec."""
    body = senders.protocol.dumps(action.encode_input(
        {name: value for name, value in arguments.items() if name != "texts"}))
    return action.result.decode(await gateway.post(action, body), "result")


def child_cpu_s() -> float | None:
    """CPU seconds of this process's children so far (the gateway child), from /proc."""
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as listed:
            pids = listed.read().split()
        total = 0.0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total
    except (OSError, ValueError, IndexError):
        return None


async def staged(tenant, run, table: str, size: int):
    """A new page of `size` rows for `table`, staged and sealed, and its rows keyed and
    encoded, as a map's list source has them (outside the clock)."""
    rows = [row(i, table) for i in range(size)]
    prepared = prepare_rows(rows, table, input_offset=0, keys=None, need_texts=True)
    scope = run.scope.map(table, "map-0")
    source = [array_input.Occurrence(r) for r in rows]
    fingerprint = array_input.source_fingerprint(source)
    (draft,) = array_input.paginate(source)
    await array_input.begin(tenant, scope, source_fingerprint=fingerprint, source_rows=size,
                            has_source_identities=False)
    await array_input.put_page(tenant, scope, source_fingerprint=fingerprint, ordinal=0,
                               offset=0, rows=draft.rows)
    await array_input.seal(tenant, scope, source_fingerprint=fingerprint, source_rows=size,
                           page_count=1)
    digest = encode_page(fingerprint, 0, draft.offset, draft.rows).digest
    return prepared, StagedPage(scope, 0, digest)


async def side_cost(tenant, gateway, run, side: str, args, round_: int) -> tuple[float, ...]:
    """Seconds, client CPU and gateway CPU of one admission call on `side` over `--calls`
    calls, each on a new page of new rows."""
    tables = [f"t_{side[:2]}_{round_}_{i}" for i in range(args.calls)]
    pages = [await staged(tenant, run, table, args.rows) for table in tables]
    sender = senders._send_admit_staged
    if side == "in full":
        senders._send_admit_staged = in_full
    try:
        wall, client, gateway_cpu = [], [], []
        for table, (prepared, page) in zip(tables, pages):
            child, cpu, started = child_cpu_s(), time.process_time(), time.perf_counter()
            admission = await sheets.admit(gateway, run, table, CONTRACT, prepared.rows,
                                           keys=prepared.keys, texts=prepared.texts,
                                           staged_page=page)
            wall.append(time.perf_counter() - started)
            client.append(time.process_time() - cpu)
            after = child_cpu_s()
            gateway_cpu.append(after - child if None not in (after, child) else 0.0)
            assert admission.inserted == args.rows == len(admission.pending), admission
    finally:
        senders._send_admit_staged = sender
    # the gateway's CPU is read in clock ticks: its mean, not its median
    return statistics.median(wall), statistics.median(client), statistics.fmean(gateway_cpu)


async def measure(dsn: str, url: str, schema: str, args: argparse.Namespace) -> None:
    figures: dict[str, list[tuple[float, ...]]] = {side: [] for side in SIDES}
    async with open_tenant(ORG, dsn, schema=schema) as tenant:
        async with open_gateway(url, mint_token(child_gateway.SECRET, ORG)) as gateway:
            run = await runs.register(tenant, RunScope(ORG, PLAY, f"s-{uuid.uuid4().hex[:8]}"))
            for r in range(args.rounds):
                for side in SIDES if r % 2 == 0 else reversed(SIDES):
                    figures[side].append(await side_cost(tenant, gateway, run, side, args, r))
    medians = {side: [statistics.median(f[i] for f in figures[side]) for i in range(3)]
               for side in SIDES}
    for side in SIDES:
        call, client, gw = medians[side]
        print(f"{side}: {args.rows:,}-row staged page admitted in {call * 1000:.2f} ms; "
              f"client CPU {client * 1000:.2f} ms, gateway CPU {gw * 1000:.2f} ms a call")
    new, old = medians["by index"], medians["in full"]
    print(f"by index / in full: call {new[0] / old[0]:.2f}, client CPU {new[1] / old[1]:.2f}"
          + (f", gateway CPU {new[2] / old[2]:.2f}" if old[2] else "")
          + f" (medians of {args.rounds} rounds of {args.calls} calls)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    print(collect_as_hosting(), flush=True)
    dsn = args.dsn or bench_dsn()
    child_gateway.with_gateway_child(dsn, "bench_staged", measure, args)


if __name__ == "__main__":
    main()
