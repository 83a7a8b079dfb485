"""Input files of `runplane run --input`: CSV and JSON lines, checked in one streamed pass, then
read back page by page.

How it works
- `read_input` checks the whole file before anything connects, holding one row at a time: it
  decodes each line as UTF-8 (a byte-order mark opening the file is not part of the first
  header or line; a byte that is not UTF-8 is reported with its line and column), parses the
  rows, and runs them through the array input's encoding pass (`array_input.scan_source`), so
  a row that `run.map` would refuse (a value jsonb cannot hold, a row alone past the 1 MiB page
  limit) is refused here, naming its line, before a run is registered. Every error is an
  `InputFileError` whose text starts with `FILE:LINE:` (or `FILE:` when no line applies).
- The pass keeps only the file's shape (the row count, the fingerprint and page cuts a list of
  the same rows gets) and an index of blocks: for every `BLOCK_ROWS` rows (or `BLOCK_BYTES` of
  file) the first row, its byte offset and line, and a digest of the block's bytes. The rows a
  play receives are a `FileRows`: a read-only sequence (`len()` from the pass; indexing,
  slicing and iteration read the blocks they need, checking their digests — a file changed
  since the check is refused with `InvalidInputError`) that `run.map` stages like a list,
  reading a page at a time. Memory is a few pages, whatever the file's size.
- Bounded reads: a JSON line, or a CSV record (a quoted cell may span physical lines), holds
  at most `MAX_RECORD_BYTES` (the page limit + 32 KiB) of file. Lines are read with that bound
  on what is left of the record, so a longer one is refused (`LongRecordError`, naming its
  first line and the limit) after reading at most `MAX_RECORD_BYTES + 1` bytes of it, whatever
  its length. No row is lost by it: a CSV record's bytes are never more than its row's canonical
  JSON, which a page limits to `MAX_PAGE_BYTES`; a JSON line past it would need more than 32 KiB
  of spaces or escapes to fit a page.
- CSV: the first record is the header; each later record is a row `{header: cell}` of strings
  (a short record leaves its missing cells null; a long one, or a header naming a column twice,
  is refused; blank lines are skipped). Cells up to the page limit (`MAX_PAGE_BYTES`) are
  accepted: the csv module's own 128 KiB field limit is raised to it for the process. With
  `infer_types` (`--infer-types`) a cell is read as a JSON scalar where it is one: a JSON
  number (so `007` and ` 42` stay text, as does a number jsonb cannot hold), `true`, `false`,
  or empty (null); every other cell stays text.
- JSON lines: one JSON object per non-blank line (lines end at "\n" only). Values PostgreSQL's
  jsonb cannot hold (NaN, Infinity, numbers that overflow to infinity, integers past the digit
  limit, nesting past the depth limit) are refused naming the line and the field as the file
  spells it (`score`, `meta.tags[2]`, `["odd key"]`).
- An empty file, a file of blank lines, or a CSV with a header and no rows is not an error:
  `read_input` returns no rows and `InputFile.note` says why, and the command ends without
  starting a run.
- `InputFile.columns` names the file's columns (a CSV's header; the top-level keys of JSON
  lines, in order of first appearance, up to `MAX_COLUMNS_NAMED`), so the CLI can say which ones
  no contract stores.
This module does no database I/O; the CLI calls `read_input` before connecting.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import io
import json
import re
from pathlib import Path
from typing import IO, Iterator, Sequence

import attrs

from runplane.engine import canonical
from runplane.engine.canonical import JsonObject, JsonValue
from runplane.engine.array_input import MAX_PAGE_BYTES, PagedRows, SourceShape, scan_source
from runplane.engine.errors import InvalidInputError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
_BOM = b"\xef\xbb\xbf"

BLOCK_ROWS = 500          # a block of the index: at most this many rows ...
BLOCK_BYTES = 256 * 1024  # ... and it ends after the row that reaches this many bytes
READ_CHUNK = 1 << 20      # the digest pass reads the file in chunks of this size
MAX_RECORD_BYTES = MAX_PAGE_BYTES + 32 * 1024  # a JSON line or CSV record, in bytes of file
MAX_COLUMNS_NAMED = 1000  # distinct JSON-line keys kept for `InputFile.columns`
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_JSON_BOOLEANS = {"true": True, "false": False}


class InputFileError(Exception):
    """An input file that cannot be read as rows; the message names the file and line."""


class LongRecordError(InputFileError):
    """A JSON line or a CSV record longer than `limit` bytes, refused when its first `limit` + 1
    bytes have been read; `line` is the line it begins on."""

    def __init__(self, path: str, line: int, what: str, limit: int) -> None:
        self.path, self.line, self.limit = path, line, limit
        super().__init__(f"{path}:{line}: the {what} is longer than {limit:,} bytes (a row holds "
                         f"at most {MAX_PAGE_BYTES:,} bytes, the page limit)")


@attrs.frozen
class InputFile:
    """The rows of an input file; `note` says why there are none when the file holds none."""

    rows: Sequence[dict]
    note: str | None = None
    columns: tuple[str, ...] = ()


def read_input(path: str, *, infer_types: bool = False) -> InputFile:
    """Check `path` fully (see the module docstring): its rows as a `FileRows`, or no rows and
    a note, or `InputFileError`. `infer_types` reads CSV cells as JSON scalars where they are."""
    file = Path(path)
    if not file.is_file():
        raise InputFileError(f"{path}: no such file")
    suffix = file.suffix.lower()
    if suffix not in (".csv", ".jsonl", ".ndjson"):
        raise InputFileError(f"{path}: input must be .csv or .jsonl")
    kind = "csv" if suffix == ".csv" else "jsonl"
    if kind == "csv" and csv.field_size_limit() < MAX_PAGE_BYTES:
        csv.field_size_limit(MAX_PAGE_BYTES)
    return _check(path, kind, infer_types)


def infer_cell(cell: str | None) -> JsonValue:
    """A CSV cell as the JSON scalar it spells (a number, a boolean, empty: null), else text."""
    if cell is None or cell == "":
        return None
    if cell in _JSON_BOOLEANS:
        return _JSON_BOOLEANS[cell]
    if not _JSON_NUMBER.match(cell):
        return cell
    try:
        return canonical.normalize(json.loads(cell))
    except (ValueError, InvalidInputError):  # past the digit limit, or infinite: stays text
        return cell


# -- reading records ---------------------------------------------------------------------------
class _Reader:
    """Rows from a binary stream of the file's lines, starting at byte `pos` after `line`
    lines; `pos` and `line` follow what was consumed, so right after a row is yielded they
    are the end of that row (the csv module reads no line ahead of a record)."""

    def __init__(self, path: str, kind: str, stream: IO[bytes], pos: int, line: int,
                 header: tuple[str, ...] | None, infer_types: bool = False) -> None:
        self.path, self.kind, self.stream = path, kind, stream
        self.infer_types = infer_types
        self.pos, self.line, self.header = pos, line, header
        self.row_line = line  # the line the last row began on
        self.rows_from = (pos, line)  # where the rows begin (past a CSV header once read)
        self.blank = True  # every line so far was blank
        self.record_pos, self.record_line = pos, line + 1  # where the current record begins

    def begin_record(self) -> None:
        """The next line read begins a record (`lines` bounds a record's bytes)."""
        self.record_pos, self.record_line = self.pos, self.line + 1

    def lines(self) -> Iterator[str]:
        readline = self.stream.readline
        what = "record" if self.kind == "csv" else "line"
        while True:
            if self.kind != "csv":
                self.begin_record()  # a JSON line is a record of its own
            room = self.record_pos + MAX_RECORD_BYTES - self.pos
            raw = readline(room + 1)
            if not raw:
                return
            if len(raw) > room:
                raise LongRecordError(self.path, self.record_line, what, MAX_RECORD_BYTES)
            bom = 3 if self.pos == 0 and raw.startswith(_BOM) else 0
            self.pos += len(raw)
            self.line += 1
            try:
                text = raw[bom:].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputFileError(
                    f"{self.path}:{self.line}: byte 0x{raw[bom + exc.start]:02x} at column "
                    f"{bom + exc.start + 1} is not UTF-8 (save the file as UTF-8)") from None
            if self.blank and text.strip():
                self.blank = False
            yield text

    def rows(self) -> Iterator[dict]:
        return self._csv_rows() if self.kind == "csv" else self._json_rows()

    def _csv_rows(self) -> Iterator[dict]:
        records = csv.reader(self.lines())
        try:
            header = self.header
            if header is None:
                for record in records:
                    if record:
                        break
                    self.begin_record()  # a blank line before the header
                else:
                    return
                header = record
                seen: dict[str, int] = {}
                for position, name in enumerate(header, 1):
                    if name in seen:
                        raise InputFileError(
                            f"{self.path}:{self.line}: the header names column {name!r} twice "
                            f"(columns {seen[name]} and {position})")
                    seen[name] = position
                self.header = header = tuple(header)
                self.rows_from = (self.pos, self.line)
            width = len(header)
            self.begin_record()
            for record in records:
                if not record:
                    self.begin_record()
                    continue  # a blank line
                if len(record) > width:
                    raise InputFileError(
                        f"{self.path}:{self.line}: {len(record)} cells, but the header has "
                        f"{width} columns")
                row: JsonObject = dict(zip(header, record))
                for name in header[len(record):]:
                    row[name] = None
                if self.infer_types:
                    row = {name: infer_cell(cell) for name, cell in row.items()}
                self.row_line = self.record_line
                yield row
                self.begin_record()
        except csv.Error as exc:
            message = str(exc)
            if message.startswith("field larger than field limit"):
                message = f"a cell is larger than {MAX_PAGE_BYTES:,} bytes (the page limit)"
            raise InputFileError(f"{self.path}:{self.line}: {message}") from None

    def _json_rows(self) -> Iterator[dict]:
        for text in self.lines():
            if not text.strip():
                continue
            where = f"{self.path}:{self.line}"
            try:
                row = json.loads(text[:-1] if text.endswith("\n") else text)
            except json.JSONDecodeError as exc:
                raise InputFileError(
                    f"{where}: invalid JSON at column {exc.colno}: {exc.msg}") from None
            except ValueError as exc:  # e.g. an integer past Python's digit limit
                raise InputFileError(f"{where}: {exc}") from None
            if not isinstance(row, dict):
                raise InputFileError(f"{where}: each line must be a JSON object")
            self.row_line = self.line
            yield row


# -- the checking pass -------------------------------------------------------------------------
def _check(path: str, kind: str, infer_types: bool) -> InputFile:
    keys: dict[str, None] = {}  # JSON lines: the top-level keys, in order of first appearance
    with open(path, "rb") as stream:
        reader = _Reader(path, kind, stream, 0, 0, None, infer_types)
        first_rows: list[int] = []
        starts: list[int] = []
        lines: list[int] = []
        current: list[JsonObject | None] = [None]

        def indexed_rows() -> Iterator[dict]:
            end = line = 0
            for number, row in enumerate(reader.rows()):
                if number == 0:
                    end, line = reader.rows_from
                if not first_rows or number - first_rows[-1] >= BLOCK_ROWS \
                        or end - starts[-1] >= BLOCK_BYTES:
                    first_rows.append(number)
                    starts.append(end)
                    lines.append(line)
                current[0] = row
                if kind != "csv" and len(keys) < MAX_COLUMNS_NAMED:
                    keys.update(dict.fromkeys(row))
                yield row
                end, line = reader.pos, reader.line

        try:
            shape = scan_source(indexed_rows())
        except InvalidInputError as exc:
            raise InputFileError(
                f"{path}:{reader.row_line}: {_why_refused(current[0], str(exc))}") from None
        end = reader.pos
    if reader.blank:
        return InputFile([], f"{path}: the file is empty; nothing to run")
    if shape.source_rows == 0:
        return InputFile([], f"{path}: a header and no rows; nothing to run")
    digests = _block_digests(path, starts, end)
    columns = reader.header if kind == "csv" else tuple(keys)[:MAX_COLUMNS_NAMED]
    index = BlockIndex(first_rows, starts, lines, digests, end)
    return InputFile(FileRows(path, kind, reader.header, shape, index, infer_types),
                     columns=tuple(columns or ()))


def _why_refused(row: JsonObject | None, message: str) -> str:
    """A row the encoding refused: the field jsonb cannot hold, or the row's size."""
    try:
        canonical.normalize(row, "row")
    except InvalidInputError as exc:
        return refusal(row, str(exc))
    return "the row " + re.sub(r"^rows\[\d+\] ", "", message)


def _digest() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=16)


def _block_digests(path: str, starts: list[int], end: int) -> list[bytes]:
    digests = []
    with open(path, "rb") as stream:
        for i, start in enumerate(starts):
            stop = starts[i + 1] if i + 1 < len(starts) else end
            stream.seek(start)
            hasher, left = _digest(), stop - start
            while left:
                chunk = stream.read(min(left, READ_CHUNK))
                if not chunk:
                    raise InputFileError(f"{path}: the file changed while it was checked")
                hasher.update(chunk)
                left -= len(chunk)
            digests.append(hasher.digest())
    return digests


# -- the rows a play receives ------------------------------------------------------------------
@attrs.frozen
class BlockIndex:
    """The checking pass's index of a file's blocks: each block's first row number, byte
    offset and line, and the digest of its bytes; `end` is the byte offset where the rows end."""

    first_rows: list[int]
    starts: list[int]
    lines: list[int]
    digests: list[bytes]
    end: int


class FileRows(PagedRows):
    """The rows of a checked input file, read from it a span at a time (see the module
    docstring); a read-only sequence that `run.map` stages like a list."""

    def __init__(self, path: str, kind: str, header: tuple[str, ...] | None, shape: SourceShape,
                 index: BlockIndex, infer_types: bool = False) -> None:
        self.path, self.kind, self.header, self._shape = path, kind, header, shape
        self.infer_types = infer_types
        self._first_rows, self._starts, self._lines = index.first_rows, index.starts, index.lines
        self._digests, self._end = index.digests, index.end

    def __len__(self) -> int:
        return self._shape.source_rows

    def __repr__(self) -> str:
        return f"FileRows({self.path!r}, {len(self)} rows)"

    def shape(self) -> SourceShape:
        return self._shape

    def read_span(self, low: int, high: int) -> list[dict]:
        high = min(high, len(self))
        if low >= high:
            return []
        first = bisect.bisect_right(self._first_rows, low) - 1
        last = bisect.bisect_right(self._first_rows, high - 1) - 1
        start = self._starts[first]
        stop = self._starts[last + 1] if last + 1 < len(self._starts) else self._end
        with open(self.path, "rb") as stream:
            stream.seek(start)
            data = stream.read(stop - start)
        for block in range(first, last + 1):
            block_stop = self._starts[block + 1] if block + 1 < len(self._starts) else self._end
            hasher = _digest()
            hasher.update(data[self._starts[block] - start:block_stop - start])
            if len(data) != stop - start or hasher.digest() != self._digests[block]:
                raise InvalidInputError(
                    f"{self.path} changed after it was checked (near line "
                    f"{self._lines[block] + 1}); run the command again")
        reader = _Reader(self.path, self.kind, io.BytesIO(data), start, self._lines[first],
                         self.header, self.infer_types)
        rows = []
        for number, row in enumerate(reader.rows(), self._first_rows[first]):
            if number >= high:
                break
            if number >= low:
                rows.append(row)
        return rows


def refusal(row: dict, fallback: str) -> str:
    """Why canonical JSON refuses `row`, naming the field as the file spells it."""
    found = _first_refused(row, [], 0)
    if found is None:
        return fallback
    parts, reason = found
    return f"field {field_path(parts)}: {reason}"


def _first_refused(value: object, parts: list, depth: int) -> tuple[list, str] | None:
    if isinstance(value, dict) or isinstance(value, list):
        if depth >= canonical.MAX_DEPTH:
            return parts, f"nested deeper than {canonical.MAX_DEPTH} levels"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            found = _first_refused(item, [*parts, key], depth + 1)
            if found is not None:
                return found
        return None
    try:
        canonical.normalize(value, "v")
    except InvalidInputError as exc:
        return parts, str(exc).removeprefix("v: ")
    return None


def field_path(parts: list) -> str:
    """`score`, `meta.tags[2]`, `["odd key"]`: a path in the file's own spelling."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _IDENTIFIER.match(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part, ensure_ascii=False)}]"
    return out
