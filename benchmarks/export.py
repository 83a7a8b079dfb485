"""`runplane export` of N rows (1,000,000 by default) to each format, as a user runs it (a
subprocess writing a file): rows/s and the process's peak RSS (target <= 200 MB in every
format), against a raw `COPY (SELECT … ORDER BY the sheet's order) TO STDOUT` of the same table's
columns by `psql` in the same run (target: JSON lines at >= 0.5 of it).

    python benchmarks/export.py [--rows 1000000] [--rounds 3] [--keep]

The JSON-lines ratio is the median of the rounds' paired ratios (the baseline, then ours, back
to back); CSV and Parquet run once. Every export is a fresh process, so its ~0.6 s start-up
(imports, connecting, the read-only checks) is in its time.

The table is filled through `engine.sheets` (admit, then complete 3 rows in 4: nested outputs,
unicode text, every fifth settled row failed) in a fresh schema, dropped afterwards unless
`--keep`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import trio  # noqa: E402

from _server import bench_dsn  # noqa: E402
from runplane.engine import PlayScope, RunScope, open_tenant, runs, sheets  # noqa: E402
from runplane.engine.sheets import RowOutcome, SheetContract  # noqa: E402
from runplane.engine.sheets.layout import layout_for  # noqa: E402
from runplane.engine.sql import quote_ident  # noqa: E402

CHUNK = 10_000
ORG, PLAY, NS = "bench", "bench_export", "companies"
CONTRACT = SheetContract(inputs=("name", "domain", "employees"),
                         outputs=("score", "summary", "tags", "profile"))


def _outcome(key: str, i: int) -> RowOutcome:
    if i % 5 == 3:
        return RowOutcome(key, "failed", error=f"quota exceeded for row {i}")
    return RowOutcome(key, "completed", data={
        "score": i * 0.37, "summary": f"Company {i} — Zürich, 東京, growth ☃",
        "tags": ["b2b", "saas", str(i % 97)],
        "profile": {"founded": 1990 + i % 30, "offices": [{"city": "Berlin", "staff": i % 500}]},
    })


async def fill(dsn: str, schema: str, rows: int) -> tuple[str, list[str]]:
    async with open_tenant(ORG, dsn, schema=schema) as tenant:
        scope = PlayScope(ORG, PLAY)
        run = await runs.register(tenant, RunScope(ORG, PLAY, "fill"))
        await sheets.ensure_sheet(tenant, scope, NS, CONTRACT)
        for start in range(0, rows, CHUNK):
            chunk = [{"name": f"company {i}", "domain": f"c{i}.example", "employees": i % 5000}
                     for i in range(start, min(rows, start + CHUNK))]
            admission = await sheets.admit(tenant, run, NS, CONTRACT, chunk, input_offset=start)
            await sheets.complete(tenant, run, NS, CONTRACT, [
                _outcome(a.key, a.input_index) for a in admission.pending if a.input_index % 4])
        layout = layout_for(tenant, scope, NS)
        async with tenant.connection("sheet") as conn:
            await conn.execute(f"VACUUM ANALYZE {layout.qualified}")
            columns = await conn.fetchval(
                f"SELECT array_agg(column_name ORDER BY position) FROM "
                f"{quote_ident(schema)}.sheet_columns WHERE org_id = $1 AND play = $2", ORG, PLAY)
        return layout.qualified, columns


def timed(argv: list[str], stdout) -> tuple[float, float]:
    """Run `argv`; (seconds, peak RSS in MB of the process, sampled every 20 ms: `ru_maxrss`
    of a forked child starts at its parent's size, so it cannot be used here)."""
    started = time.perf_counter()
    child = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE)
    watched = psutil.Process(child.pid)
    peak = 0
    while child.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    child.wait()
    elapsed = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed: {child.stderr.read().decode()}")
    return elapsed, peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="paired COPY / JSON-lines rounds")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    dsn = bench_dsn()
    schema = f"bench_export_{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    qualified, columns = trio.run(fill, dsn, schema, args.rows)
    print(f"filled {args.rows:,} rows in {time.perf_counter() - started:.1f} s")
    out_dir = Path(tempfile.mkdtemp(prefix="runplane-export-"))
    try:
        cols = ", ".join(["_key", "_status", "_error", *(quote_ident(c) for c in columns)])
        copy = (f"\\copy (SELECT {cols} FROM {qualified} ORDER BY _input_index, _created_at, "
                f"_key) TO STDOUT")

        def export(fmt: str) -> tuple[float, float]:
            path = out_dir / f"out.{fmt}"
            seconds, rss = timed([sys.executable, "-m", "runplane.cli", "export", PLAY, NS,
                                  "--dsn", dsn, "--org", ORG, "--schema", schema,
                                  "--format", fmt, "--output", str(path)], subprocess.DEVNULL)
            print(f"export {fmt:<8}  {args.rows / seconds:>10,.0f} rows/s  ({seconds:.1f} s, "
                  f"peak RSS {rss:.0f} MB, {path.stat().st_size / 1e6:.0f} MB written)")
            return seconds, rss

        ratios = []
        for round_ in range(args.rounds):  # paired: the baseline, then ours, back to back
            with (out_dir / "copy.txt").open("wb") as out:
                raw_s, raw_rss = timed(["psql", dsn, "-X", "-q", "-c", copy], out)
            print(f"raw COPY (psql):   {args.rows / raw_s:>10,.0f} rows/s  ({raw_s:.1f} s, "
                  f"peak RSS {raw_rss:.0f} MB)")
            ratios.append(raw_s / export("jsonl")[0])
        for fmt in ("csv", "parquet"):
            export(fmt)
        print(f"JSON lines vs raw COPY: median {statistics.median(ratios):.2f} of "
              f"{', '.join(f'{r:.2f}' for r in ratios)} (target >= 0.5)")
    finally:
        for path in out_dir.iterdir():
            path.unlink()
        out_dir.rmdir()
        if not args.keep:
            async def drop() -> None:
                async with open_tenant(ORG, dsn, schema=schema) as tenant:
                    async with tenant.connection("sheet") as conn:
                        await conn.execute(f"DROP SCHEMA {quote_ident(schema)} CASCADE")

            trio.run(drop)


if __name__ == "__main__":
    main()
