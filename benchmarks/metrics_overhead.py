"""What metrics and traces cost a map: a no-op `run.map` with both on and both off, in one run.

    python benchmarks/metrics_overhead.py [--rows 100000] [--rounds 3] [--concurrency 16]
                                          [--metrics-only] [--row-ratio 0.01]

Each round maps `--rows` rows streamed from an async iterable through a no-op function twice,
into fresh sheets of one run: once with the per-call and per-statement observations on (the
default: `runplane_row_seconds`, `runplane_statement_seconds`, `runplane_permit_wait_seconds`)
and tracing on (SPEC §35: an SDK `TracerProvider` whose `BatchSpanProcessor` hands spans to a
no-op exporter; map, admission and completion batch spans, row calls sampled at `--row-ratio`,
1 %), and once with both off (`metrics.set_enabled(False)`, `tracing.configure(None)`),
alternating which goes first so a load swing between rounds cancels out. The row counters
(`MapTally` pushing deltas as it reports) run either way: they cost a few additions per report,
not per row. `--metrics-only` leaves tracing off on both sides (and works without the `otel`
extra). Prints rows/s of both sides (medians of rounds) and the median of the per-round ratios
on/off (target >= 0.97, SPEC §31), and the same ratio of this process's CPU seconds (off/on).

The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attrs  # noqa: E402
import trio  # noqa: E402

from _rows import CONTRACT, noop, stream  # noqa: E402
from _server import bench_dsn  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant  # noqa: E402
from runplane.engine.observability import metrics, tracing  # noqa: E402

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


def noop_provider():
    """An SDK provider batching spans to an exporter that drops them (the SDK's full work, no
    output)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropped(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    return provider


@attrs.frozen
class Tracing:
    """The "on" side's traces: a provider (None: `--metrics-only`) and the row spans' ratio."""

    provider: TracerProvider | None
    ratio: float

    def switch(self, on: bool) -> None:
        tracing.configure(self.provider if on else None, ratio=self.ratio)


async def one_side(run, table: str, rows: int, concurrency: int, on: bool,
                   traced: Tracing) -> tuple[float, float]:
    """rows/s, and this process's CPU seconds, of one map."""
    metrics.set_enabled(on)
    traced.switch(on)
    try:
        started, cpu = time.perf_counter(), time.process_time()
        result = await run.map(table, stream(rows, "r"), noop, contract=CONTRACT,
                               concurrency=concurrency)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        metrics.set_enabled(True)
        traced.switch(True)
    assert result.completed == rows, result
    return rows / elapsed, cpu


async def measure(dsn: str, rows: int, rounds: int, concurrency: int, traced: Tracing) -> None:
    schema = f"bench_metrics_{uuid.uuid4().hex[:8]}"
    what = "metrics and traces" if traced.provider is not None else "metrics"
    traced.switch(True)  # the run's own span, when traced
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            on_rates, off_rates, ratios, cpu_ratios = [], [], [], []
            async with open_run(tenant, "bench") as run:
                for r in range(rounds):
                    order = (True, False) if r % 2 == 0 else (False, True)
                    got = {}
                    for on in order:
                        got[on] = await one_side(run, f"{'on' if on else 'off'}_{r}", rows,
                                                 concurrency, on, traced)
                    on_rates.append(got[True][0])
                    off_rates.append(got[False][0])
                    ratios.append(got[True][0] / got[False][0])
                    cpu_ratios.append(got[False][1] / got[True][1])
            sampled = f"; row spans sampled at {traced.ratio:g}" if traced.provider else ""
            print(f"{what} on:  {statistics.median(on_rates):,.0f} rows/s over {rows:,} rows "
                  f"(median of {rounds}{sampled})")
            print(f"{what} off: {statistics.median(off_rates):,.0f} rows/s")
            print(f"ratio on/off: {statistics.median(ratios):.3f} (per round: "
                  f"{', '.join(f'{x:.3f}' for x in ratios)}; target >= 0.97)")
            print(f"CPU seconds of this process off/on: {statistics.median(cpu_ratios):.3f} "
                  f"(per round: {', '.join(f'{x:.3f}' for x in cpu_ratios)}; steadier than "
                  "rows/s when other work shares the machine)")
        finally:
            tracing.configure(None)
            if traced.provider is not None:
                traced.provider.shutdown()
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--metrics-only", action="store_true",
                        help="tracing off on both sides (no otel extra needed)")
    parser.add_argument("--row-ratio", type=float, default=tracing.DEFAULT_ROW_RATIO)
    args = parser.parse_args()
    traced = Tracing(None if args.metrics_only else noop_provider(), args.row_ratio)
    trio.run(measure, bench_dsn(), args.rows, args.rounds, args.concurrency, traced)


if __name__ == "__main__":
    main()
