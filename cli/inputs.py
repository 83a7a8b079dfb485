"""Input files of `runplane run --input`: CSV and JSON lines, read into rows or one clear error.

How it works
- A file is read whole as bytes and decoded as `utf-8-sig` (a byte-order mark is not part of
  the first header or the first line); a byte that is not UTF-8 is reported with its line.
- CSV: the first record is the header; each later record is a row `{header: cell}` of strings
  (a short record leaves its missing cells null; a long one, or a header naming a column twice,
  is refused). Cells up to the array-input page limit (`MAX_PAGE_BYTES`, 1 MiB) are accepted:
  the csv module's own 128 KiB field limit is raised for the read and restored afterwards.
- JSON lines: one JSON object per non-blank line. Values PostgreSQL's jsonb cannot hold (NaN,
  Infinity, numbers that overflow to infinity, integers past the digit limit, nesting past the
  depth limit) are refused naming the line and the field as the file spells it (`score`,
  `meta.tags[2]`, `["odd key"]`).
- Every error is an `InputFileError` whose text starts with `FILE:LINE:` (or `FILE:` when no
  line applies). An empty file, a file of blank lines, or a CSV with a header and no rows is
  not an error: `read_input` returns no rows and `InputFile.note` says why, and the command
  ends without starting a run.
This module does no database I/O; the CLI calls it before connecting.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import attrs

from runplane.engine import canonical
from runplane.engine.array_input import MAX_PAGE_BYTES
from runplane.engine.errors import InvalidInputError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")


class InputFileError(Exception):
    """An input file that cannot be read as rows; the message names the file and line."""


@attrs.frozen
class InputFile:
    """The rows of an input file; `note` says why there are none when the file holds none."""

    rows: list[dict]
    note: str | None = None


def read_input(path: str) -> InputFile:
    file = Path(path)
    if not file.is_file():
        raise InputFileError(f"{path}: no such file")
    suffix = file.suffix.lower()
    if suffix not in (".csv", ".jsonl", ".ndjson"):
        raise InputFileError(f"{path}: input must be .csv or .jsonl")
    text = _decode(path, file.read_bytes())
    if not text.strip():
        return InputFile([], f"{path}: the file is empty; nothing to run")
    if suffix == ".csv":
        return _read_csv(path, text)
    return _read_json_lines(path, text)


def _decode(path: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
        at = exc.start + bom
        line = raw.count(b"\n", 0, at) + 1
        column = at - (raw.rfind(b"\n", 0, at) + 1) + 1
        raise InputFileError(
            f"{path}:{line}: byte 0x{raw[at]:02x} at column {column} is not UTF-8 "
            "(save the file as UTF-8)"
        ) from None


# -- CSV ---------------------------------------------------------------------------------------
def _read_csv(path: str, text: str) -> InputFile:
    previous_limit = csv.field_size_limit()
    csv.field_size_limit(MAX_PAGE_BYTES)
    try:
        reader = csv.reader(io.StringIO(text, newline=""))
        try:
            header = next(reader)
            rows = []
            seen: dict[str, int] = {}
            for position, name in enumerate(header, 1):
                if name in seen:
                    raise InputFileError(
                        f"{path}:{reader.line_num}: the header names column {name!r} twice "
                        f"(columns {seen[name]} and {position})"
                    )
                seen[name] = position
            for record in reader:
                if not record:
                    continue  # a blank line
                if len(record) > len(header):
                    raise InputFileError(
                        f"{path}:{reader.line_num}: {len(record)} cells, but the header has "
                        f"{len(header)} columns"
                    )
                row = dict(zip(header, record))
                for name in header[len(record):]:
                    row[name] = None
                rows.append(row)
        except csv.Error as exc:
            message = str(exc)
            if message.startswith("field larger than field limit"):
                message = f"a cell is larger than {MAX_PAGE_BYTES:,} bytes (the page limit)"
            raise InputFileError(f"{path}:{reader.line_num}: {message}") from None
    finally:
        csv.field_size_limit(previous_limit)
    if not rows:
        return InputFile([], f"{path}: a header and no rows; nothing to run")
    return InputFile(rows)


# -- JSON lines --------------------------------------------------------------------------------
def _read_json_lines(path: str, text: str) -> InputFile:
    rows = []
    # Lines end at "\n" only: JSON strings may hold U+2028 and friends, which splitlines() splits.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputFileError(
                f"{path}:{number}: invalid JSON at column {exc.colno}: {exc.msg}"
            ) from None
        except ValueError as exc:  # e.g. an integer past Python's digit limit
            raise InputFileError(f"{path}:{number}: {exc}") from None
        if not isinstance(row, dict):
            raise InputFileError(f"{path}:{number}: each line must be a JSON object")
        try:
            canonical.normalize(row, "row")
        except InvalidInputError as exc:
            raise InputFileError(f"{path}:{number}: {refusal(row, str(exc))}") from None
        rows.append(row)
    if not rows:
        return InputFile([], f"{path}: no rows (only blank lines); nothing to run")
    return InputFile(rows)


def refusal(row: dict, fallback: str) -> str:
    """Why canonical JSON refuses `row`, naming the field as the file spells it."""
    found = _first_refused(row, [], 0)
    if found is None:
        return fallback
    parts, reason = found
    return f"field {field_path(parts)}: {reason}"


def _first_refused(value: Any, parts: list, depth: int) -> tuple[list, str] | None:
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
