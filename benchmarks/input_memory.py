"""Peak memory of `runplane run --input FILE.csv` over a large generated CSV.

    python benchmarks/input_memory.py [--rows 1000000] [--format csv|jsonl]

Writes a file of `--rows` rows (one `name` column holding the row's number: 6.9 MB for
1,000,000 CSV rows), then runs the command line as a user would, in a child process, with a play that
maps a no-op function over the rows. The play prints the child's peak RSS (its own `VmHWM`:
Linux keeps `ru_maxrss` across exec, see `benchmarks/_memory.py`) after its map; this prints it against the file's
size and row count (target: <= 200 MB for 1,000,000 rows, whatever the file's size).

The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _server import bench_dsn

PLAY = '''
from runplane.engine.sheets import SheetContract

PLAY = "input-memory"
CONTRACT = SheetContract(inputs=("name",), outputs=("ok",))


async def touch(row):
    return {"ok": 1}


async def play(run, rows):
    result = await run.map("rows", rows, touch, contract=CONTRACT, concurrency=16)
    with open("/proc/self/status") as status:
        peak_mb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    print(f"rows object: {type(rows).__name__}; peak RSS {peak_mb:.0f} MB", flush=True)
    return result
'''


def write_rows(path: Path, rows: int, kind: str) -> None:
    with path.open("w", encoding="utf-8") as out:
        if kind == "csv":
            out.write("name\n")
        for i in range(rows):
            out.write(f"{i}\n" if kind == "csv" else json.dumps({"name": str(i)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--format", choices=("csv", "jsonl"), default="csv")
    args = parser.parse_args()
    dsn = bench_dsn()
    with tempfile.TemporaryDirectory(prefix="runplane-input-memory-") as folder:
        play = Path(folder) / "memory_play.py"
        play.write_text(PLAY)
        data = Path(folder) / f"rows.{args.format}"
        write_rows(data, args.rows, args.format)
        size_mb = data.stat().st_size / 1e6
        schema = f"bench_{uuid.uuid4().hex[:12]}"
        env = {**os.environ, "RUNPLANE_DSN": dsn}
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "runplane.cli", "run", str(play), "--input", str(data),
             "--schema", schema], capture_output=True, text=True, env=env)
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            sys.exit(f"the run failed ({done.returncode}): {done.stderr.strip()}")
        peak = [line for line in done.stdout.splitlines() if "peak RSS" in line]
        print(f"{args.rows:,} {args.format} rows, {size_mb:.1f} MB file: {peak[-1]} "
              f"(run took {elapsed:.0f} s)")


if __name__ == "__main__":
    main()
