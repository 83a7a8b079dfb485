"""The console's exports: a table's rows as JSON lines or CSV, streamed to the browser.

How it works
- `/ui/export/<play>/<table>.jsonl` and `.csv` (optionally `?status=`) read the sheet through
  `engine.sheets.dataset` in keyset pages of `PAGE_ROWS` rows and send each page as it arrives,
  so an export of any size holds one page in memory. The formats are those of `runplane export`:
  JSON lines are the rows as `read_rows` gives them; CSV has a column a field (in the sheet's
  order) plus `_key`, `_status`, `_error`, strings as they are and other values as JSON text.
- A CSV download is saved to a file a spreadsheet may open, so it is always formula-guarded:
  `csv_cell(value, safe=True)` prefixes with `'` a cell (header included) that begins with
  `=`, `+`, `-`, `@`, tab or CR, unless it is a plain number (`-3.5`, `+1`, `1e-07`: a JSON
  number, or text spelling one), so a spreadsheet shows the text instead of running it
  (formula injection). `runplane export --format csv` uses the same `csv_cell`: guarded when it
  writes a file, `--raw` for the cells verbatim.
  Parquet needs the `frames` extra and a file: `runplane export --format parquet`.
- The reads go through `ConsolePort`, which puts every checkout on the console's own permit
  lane, so an export competes with the console's pages, never with runs, and which never
  repairs a schema (the console runs no DDL).
"""

from __future__ import annotations

import csv
import io
import re
from typing import Any, AsyncContextManager, AsyncIterator

import attrs

from ..errors import SchemaNotFoundError
from ..pg import Connection
from ..ports import CONSOLE_LANE, Port, PortWrapper
from ..values.scopes import PlayScope
from ..sheets import dataset, frames

PAGE_ROWS = 1000
FORMATS = {"jsonl": "application/x-ndjson; charset=utf-8", "csv": "text/csv; charset=utf-8"}


@attrs.define(eq=False)
class ConsolePort(PortWrapper):
    """The tenant `inner` seen as org `org_id`, with every checkout on the console lane."""

    _org_id: str  # (its init argument is `org_id`)

    @property
    def org_id(self) -> str:
        return self._org_id

    def connection(self, _lane: str) -> AsyncContextManager[Connection]:
        return self.inner.connection(CONSOLE_LANE)

    async def repair_schema(self) -> None:
        """The console never runs DDL: a missing relation is an error here, not a repair."""
        raise SchemaNotFoundError(f"schema {self.schema!r} lacks runplane tables; the console "
                                  "reads only and created nothing")


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet may run or act on
_PLAIN_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def csv_cell(value: Any, *, safe: bool) -> str:
    """`value` as a CSV cell: strings as they are, other values as JSON text, None empty; with
    `safe`, text a spreadsheet would take for a formula is prefixed with `'` (not a plain
    number: those stay, so `-3.5` is still a number once opened)."""
    if value is None:
        return ""
    text = value if type(value) is str else frames.json_text(value)
    if safe and text.startswith(FORMULA_STARTS) and _PLAIN_NUMBER.fullmatch(text) is None:
        return "'" + text
    return text


async def export_chunks(port: Port, org: str, play: str, namespace: str, fmt: str,
                        status: str | None) -> AsyncIterator[bytes]:
    """The export's bytes, a page at a time."""
    rows = dataset(ConsolePort(port, org), PlayScope(org, play), namespace, status=status)
    header: list[str] | None = None
    async for page in rows.pages(PAGE_ROWS):
        if fmt == "jsonl":
            yield (page.text + "\n").encode("utf-8")
            continue
        found = [frames.loads(line) for line in page.lines()]
        out = io.StringIO()
        writer = csv.writer(out)
        if header is None:
            header = [k for k in found[0] if k not in frames.SYSTEM_KEYS]
            header += list(frames.TABLE_SYSTEM_COLUMNS)
            writer.writerow([csv_cell(name, safe=True) for name in header])
        writer.writerows([csv_cell(row.get(name), safe=True) for name in header]
                         for row in found)
        yield out.getvalue().encode("utf-8")
    if fmt == "csv" and header is None:
        out = io.StringIO()
        csv.writer(out).writerow([csv_cell(name, safe=True) for name in (
            *(await rows.field_kinds()), *frames.TABLE_SYSTEM_COLUMNS)])
        yield out.getvalue().encode("utf-8")
