"""`runplane export PLAY TABLE`: a table's rows out as JSON lines, CSV or Parquet, streaming.

How it works
- Read-only: the tenant is opened without bootstrap and the schema, play and table are checked
  first (`operators.require_schema`, `require_table`), so a missing one is one line, exit 1, and
  nothing is created — not even the output file. With `--gateway` the same reads go through it.
- Rows come from `engine.sheets.dataset` in keyset pages and are written as each page arrives,
  so memory stays flat whatever the table's size:
  - `jsonl` (the default): each row as `read_rows` gives it, one JSON object a line, exactly the
    text the server built, written without decoding. Straight from the database it is one
    `COPY (SELECT …) TO STDOUT` (one snapshot: rows written meanwhile are not in it); through a
    gateway, keyset pages;
  - `csv`: a header row, then a column a field (in the sheet's order) plus `_key`, `_status`,
    `_error`; strings as they are, other values as JSON text, a missing value empty; UTF-8.
    Formula-guarded (`--csv-safe`, the console's `csv_cell`: a cell beginning with `=`, `+`,
    `-`, `@`, tab or CR, and not a plain number, gets a leading `'`, so a spreadsheet opening
    the file shows it instead of running it) by default when written to a file, which is what
    a spreadsheet opens; verbatim with `--raw`, and by default on stdout (a pipe to a program);
  - `parquet` (needs the `frames` extra): the same columns, typed by each field's kind
    (`engine.sheets.frames`: nested values as JSON text); each page becomes Arrow columns as it
    arrives, and every `ROW_GROUP_ROWS` rows are written as one row group.
- An output cell that is not completed (it failed, or a forced run re-admitted it and has not
  completed it again) is exported as null in every format: JSON null, an empty CSV cell, a
  Parquet null (`engine.sheets.reading.shown_cell`). `--cells` adds each row's `_cells` (per
  output: status, completed_at, run_id, attempts, last_value): a key of each JSON line, and one
  last column of JSON text in CSV and Parquet.
- A progress bar (rows written, rows/s) goes to stderr only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import sys
from typing import TYPE_CHECKING, AsyncIterator, BinaryIO

from runplane.engine import PlayScope, sheets
from runplane.engine.canonical import JsonObject
from runplane.engine.sheets import frames

from .connect import Access, open_port, replica_line, require_tenant_schema
from .operators import CommandError, UsageError, require_table

if TYPE_CHECKING:
    from pyarrow import RecordBatch
    from pyarrow.parquet import ParquetWriter

HELP = "write a table's rows to a file or stdout as JSON lines, CSV or Parquet (streaming)"
FORMATS = ("jsonl", "csv", "parquet")
PAGE_ROWS = 2000
ROW_GROUP_ROWS = 20_000


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("play", help="play name")
    parser.add_argument("table", help="table namespace")
    parser.add_argument("--format", choices=FORMATS, default="jsonl",
                        help="output format (default: jsonl)")
    parser.add_argument("--output", default="-", metavar="FILE",
                        help="file to write (default: -, stdout)")
    parser.add_argument("--status", choices=sheets.dataset_pages.STATUSES, default=None,
                        help="only rows of this status")
    parser.add_argument("--run", default=None, metavar="RUN_ID", help="only that run's rows: those it wrote and those it reused")
    parser.add_argument("--fields", default=None, metavar="A,B",
                        help="only these fields, in this order (default: every field)")
    parser.add_argument("--cells", action="store_true",
                        help="add each row's _cells: per output its status, completed_at, run_id, "
                             "attempts and the value still stored (last_value)")
    guard = parser.add_mutually_exclusive_group()
    guard.add_argument("--csv-safe", dest="csv_safe", action="store_const", const=True,
                       default=None,
                       help="CSV: prefix with ' a cell a spreadsheet would run as a formula "
                            "(=, +, -, @, tab, CR; numbers stay); the default with --output FILE")
    guard.add_argument("--raw", dest="csv_safe", action="store_const", const=False,
                       help="CSV: every cell verbatim (the default on stdout)")


@contextlib.contextmanager
def _output(path: str):
    if path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
    else:
        with open(path, "wb") as out:
            yield out


class _Progress:
    """Rows written and rows/s on stderr, when stderr is a terminal (else nothing)."""

    def __init__(self, total: int | None) -> None:
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
                TimeElapsedColumn

            self.bar = Progress(TextColumn("exporting"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]} rows/s"),
                                TimeElapsedColumn(), console=Console(stderr=True),
                                transient=False)
            self.task = self.bar.add_task("export", total=total, rate="-")

    def __enter__(self) -> "_Progress":
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def advance(self, rows: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, rows)
            task = self.bar.tasks[0]
            speed = task.completed / task.elapsed if task.elapsed else 0
            self.bar.update(self.task, rate=f"{speed:,.0f}")


async def _jsonl(ds: sheets.Dataset, out: BinaryIO, progress: _Progress) -> int:
    written = 0

    async def chunk(data: bytes) -> None:
        nonlocal written
        out.write(data)
        rows = data.count(b"\n")
        written += rows
        progress.advance(rows)

    if await ds.copy_lines(chunk):  # straight from the database: one COPY
        return written
    async for page in ds.pages(PAGE_ROWS):
        out.write(page.text.encode("utf-8"))
        out.write(b"\n")
        written += page.rows
        progress.advance(page.rows)
    return written


async def _rows(ds: sheets.Dataset) -> AsyncIterator[list[JsonObject]]:
    loads = frames.loads
    async for page in ds.pages(PAGE_ROWS):
        yield [loads(line) for line in page.lines()]


async def _csv(ds: sheets.Dataset, out: BinaryIO, progress: _Progress, safe: bool) -> int:
    system = frames.system_columns(ds.filters.cells)
    # Imported here: the console package loads its web stack, which other commands never need.
    from runplane.engine.console.export import csv_cell

    def cell(value: object) -> str:
        return csv_cell(value, safe=safe)

    text = io.TextIOWrapper(out, encoding="utf-8", newline="", write_through=False)
    writer = csv.writer(text)
    header: list[str] | None = None
    written = 0
    try:
        async for rows in _rows(ds):
            if header is None:
                header = [k for k in rows[0] if k not in frames.SYSTEM_KEYS]
                header += list(system)
                writer.writerow(map(cell, header))
            writer.writerows([cell(row.get(name)) for name in header] for row in rows)
            written += len(rows)
            progress.advance(len(rows))
        if header is None:
            writer.writerow(map(cell, [*(await ds.field_kinds()), *system]))
        text.flush()
    finally:
        text.detach()  # the caller owns (and closes) the binary stream
    return written


async def _parquet(ds: sheets.Dataset, out: BinaryIO, progress: _Progress) -> int:
    pa = frames.require("pyarrow", "--format parquet")
    pq = frames.require("pyarrow.parquet", "--format parquet")
    kinds = await ds.field_kinds()
    cells = ds.filters.cells
    schema = frames.arrow_schema(kinds, cells)
    written = 0
    batches: list[RecordBatch] = []  # each page as columns as soon as it arrives (compact)

    def flush(writer: ParquetWriter) -> None:
        nonlocal written, batches
        rows = sum(b.num_rows for b in batches)
        writer.write_table(pa.Table.from_batches(batches, schema=schema),
                           row_group_size=ROW_GROUP_ROWS)
        written += rows
        progress.advance(rows)
        batches = []

    with pq.ParquetWriter(out, schema) as writer:
        async for rows in _rows(ds):
            batches.append(frames.record_batch(kinds, rows, cells))
            if sum(b.num_rows for b in batches) >= ROW_GROUP_ROWS:
                flush(writer)
        if batches or not written:
            flush(writer)
    return written


WRITERS = {"jsonl": _jsonl, "parquet": _parquet}  # and `_csv`, which takes `safe` too


async def export(args: argparse.Namespace) -> int:
    safe = args.csv_safe
    if safe is not None and args.format != "csv":
        raise UsageError("--csv-safe and --raw apply to --format csv")
    if safe is None:
        safe = args.output != "-"  # a file is what a spreadsheet opens
    if args.format == "parquet":
        # Arrow's system allocator (chosen before pyarrow is first imported) hands freed
        # buffers back, where its default one keeps tens of MB of arenas: the peak stays near
        # one row group.
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
        try:
            frames.require("pyarrow", "--format parquet")
        except ImportError as exc:
            raise CommandError(str(exc)) from None
    fields = None if args.fields is None else [f.strip() for f in args.fields.split(",")]
    async with open_port(args, access=Access.READS) as port:
        await require_tenant_schema(port)
        note = await replica_line(port)
        if note is not None:
            print(f"export: {note}", file=sys.stderr)
        scope = PlayScope(port.org_id, args.play)
        table = await require_table(port, scope, args.table)
        ds = sheets.dataset(port, scope, table, status=args.status, run_id=args.run,
                            fields=fields, cells=args.cells)
        await ds.peek(1)  # unknown fields are refused before the output is opened
        total = await ds.count() if sys.stderr.isatty() else None
        with _output(args.output) as out, _Progress(total) as progress:
            if args.format == "csv":
                await _csv(ds, out, progress, safe)
            else:
                await WRITERS[args.format](ds, out, progress)
    return 0
