"""A recorded list's digest (`engine.sheets.lists.list_digest`) against the `marshal` format 2
digest it replaced, same process, same rows.

    python benchmarks/list_digest.py [--rows 10000,100000] [--rounds 7]

Both digest the namespace, the contract and the rows, then SHA-256 the bytes: the current one
pickles them in fast mode (no memo), the baseline `marshal.dumps(..., 2)` (no back-references
either). Each round times both on the same list, alternating which goes first; prints each
side's median milliseconds and the median of the rounds' ratios current / baseline (lower is
faster). No database: an unchanged rerun's digest is pure CPU before its one statement.
"""

from __future__ import annotations

import argparse
import hashlib
import marshal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _rows import CONTRACT, row  # noqa: E402
from runplane.engine.sheets import SheetWrite  # noqa: E402
from runplane.engine.sheets.lists import list_digest  # noqa: E402
from runplane.engine.values.scopes import RunRef, RunScope  # noqa: E402


def marshal_digest(write: SheetWrite, rows: list[dict]) -> bytes:
    """The digest as it was computed before (format 2: no back-references)."""
    contract = write.contract
    return hashlib.sha256(marshal.dumps(
        (write.table_namespace, contract.inputs, contract.outputs, rows), 2)).digest()


def seconds(digest, write: SheetWrite, rows: list[dict]) -> float:
    started = time.perf_counter()
    digest(write, rows)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,100000", help="sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    write = SheetWrite(RunRef(RunScope("org", "bench", "run"), 1), "t", CONTRACT)
    for size in (int(part) for part in args.rows.split(",")):
        rows = [row(i) for i in range(size)]
        current, baseline = [], []
        for r in range(args.rounds):
            sides = [(list_digest, current), (marshal_digest, baseline)]
            for digest, times in (sides if r % 2 == 0 else sides[::-1]):
                times.append(seconds(digest, write, rows))
        ratio = statistics.median(a / b for a, b in zip(current, baseline))
        print(f"{size:,} rows: digest {statistics.median(current) * 1000:.2f} ms, marshal format 2 "
              f"{statistics.median(baseline) * 1000:.2f} ms; current / marshal {ratio:.2f} "
              f"(median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
