"""Rows expected new against the ordinary admission, direct and through a gateway, in one run.

    python benchmarks/admission_hint.py [--rows 50000] [--unit 5000] [--rounds 5]

A map sends an admission unit ahead once the unit before it was all new (or the sheet held no
row), and admits it as rows expected new (`sheets.admit(..., expect_new=True)`): inserted
without `ON CONFLICT`, and admitted the ordinary way instead when a row was there after all.
This measures what the hint saves where a map uses it: `--rows` new rows admitted into a fresh
sheet in units of `--unit` rows (keys computed before the clock starts, as the map's pipeline
does while the unit before is on its way), with the hint and without, alternating which goes
first each round; directly, and through a gateway in a child process (as `runplane serve`).
Prints rows/s for each side and the ratio hinted / plain, medians of the rounds.
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
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
from runplane.engine import PlayScope, RunScope, open_tenant, runs, sheets  # noqa: E402
from runplane.engine.gateway import mint_token, open_gateway  # noqa: E402
from runplane.engine.sheets.inputs import prepare_rows  # noqa: E402

ORG, PLAY = child_gateway.ORG, "hint"


async def admit_rate(port, run, table: str, units: list[tuple[list[dict], list[str], list[str]]],
                     expect_new: bool) -> float:
    """Rows/s admitting `units` (rows, keys, texts) one after the other into a fresh sheet."""
    await sheets.ensure_sheet(port, PlayScope(ORG, PLAY), table, CONTRACT)
    offset, started = 0, time.perf_counter()
    for rows, keys, texts in units:
        admission = await sheets.admit(port, run, table, CONTRACT, rows, input_offset=offset,
                                       keys=keys, texts=texts, expect_new=expect_new)
        assert admission.inserted == len(rows), admission
        offset += len(rows)
    return offset / (time.perf_counter() - started)


def make_units(table: str, total: int, unit: int) -> list[tuple[list[dict], list[str], list[str]]]:
    """`total` new rows cut into units, each keyed (keys hash the table's namespace) and
    encoded, as the map's pipeline does before sending a unit."""
    units = []
    for low in range(0, total, unit):
        rows = [row(i, table) for i in range(low, min(low + unit, total))]
        prepared = prepare_rows(rows, table, input_offset=low, keys=None, need_texts=True)
        units.append((prepared.rows, prepared.keys, prepared.texts))
    return units


async def measure(dsn: str, url: str, schema: str, args: argparse.Namespace) -> None:
    rates: dict[tuple[str, bool], list[float]] = {}
    ratios: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with open_tenant(ORG, dsn, schema=schema) as tenant:
        async with open_gateway(url, mint_token(child_gateway.SECRET, ORG)) as gateway:
            run = await runs.register(tenant, RunScope(ORG, PLAY, f"hint-{uuid.uuid4().hex[:8]}"))
            for r in range(args.rounds):
                for side, port in (("direct", tenant), ("gateway", gateway)):
                    order = (True, False) if r % 2 == 0 else (False, True)
                    got = {}
                    for hinted in order:
                        table = f"{side}_{'hinted' if hinted else 'plain'}_{r}"
                        units = make_units(table, args.rows, args.unit)
                        got[hinted] = await admit_rate(port, run, table, units, hinted)
                        rates.setdefault((side, hinted), []).append(got[hinted])
                    ratios[side].append(got[True] / got[False])
    for side in ("direct", "gateway"):
        hinted = statistics.median(rates[(side, True)])
        plain = statistics.median(rates[(side, False)])
        print(f"{side}: {args.rows:,} new rows in units of {args.unit:,}: hinted {hinted:,.0f} "
              f"rows/s, plain {plain:,.0f} rows/s; hinted / plain "
              f"{statistics.median(ratios[side]):.2f} (median of {args.rounds} rounds: "
              + ", ".join(f"{ratio:.2f}" for ratio in ratios[side]) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--unit", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    print(collect_as_hosting(), flush=True)
    dsn = args.dsn or bench_dsn()
    child_gateway.with_gateway_child(dsn, "bench_hint", measure, args)

if __name__ == "__main__":
    main()
