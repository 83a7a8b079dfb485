"""Rows as columns: the Arrow shape of a dataset (for `to_arrow` and Parquet export).

How it works
- A field's kind comes from the values the rows read show (one scan, `kinds_statement`; an
  output cell that is not completed shows null, `reading.shown_cell`): `string` (only
  strings), `integer` (only integral numbers within int64), `float` (other numbers),
  `boolean`, `json` (objects, arrays or a mix of kinds: the column holds each value's JSON
  text) and `null` (no value at all: a string column of nulls). A missing output is null in
  every kind.
- The columns are the fields in the sheet's order, then `_key`, `_status`, `_error` (the same
  columns a CSV export has), and with `cells` one more, `_cells`: each row's cell report as
  JSON text.
- A value that no longer fits its column's kind (a concurrent run wrote another type after the
  kinds were read) raises `ConflictError` rather than being changed; a string or null column
  takes any value as its JSON text.
- `pyarrow` and `pandas` come with the `frames` extra; `require` imports them or raises one
  `ImportError` line naming the extra. This module imports neither at import time and does no
  I/O.
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Mapping

from ..canonical import JsonValue
from ..errors import ConflictError
from ..sql import quote_ident
from .dataset_pages import Filters, SheetRead, field_names, filter_sql
from .reading import shown_cell
from .statements import BindParams

KINDS = ("string", "integer", "float", "boolean", "json", "null")
SYSTEM_KEYS = ("_key", "_status", "_error", "_input_index", "_attempts", "_failed_runs", "_cells")
TABLE_SYSTEM_COLUMNS = ("_key", "_status", "_error")
CELLS_COLUMN = "_cells"


def system_columns(cells: bool) -> tuple[str, ...]:
    """The system columns of a table (CSV, Arrow, Parquet) after the fields."""
    return (*TABLE_SYSTEM_COLUMNS, CELLS_COLUMN) if cells else TABLE_SYSTEM_COLUMNS
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
loads = json.loads


def require(module: str, what: str) -> Any:
    """Import `module` (pyarrow or pandas), or raise one line naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{what} needs {module}: install the extra with "
                          "`pip install 'runplane[frames]'`") from None


def kinds_statement(read: SheetRead, filters: Filters) -> tuple[str, list[object]]:
    """One scan giving, per field i, its JSON types (`t<i>`) and whether its numbers are all
    integral within int64 (`n<i>`)."""
    binds = BindParams(1)
    where = filter_sql(filters, binds, read) or ["true"]
    names = field_names(read, binds)
    columns = []
    for i, (_, column) in enumerate(read.pairs):
        c = f"({shown_cell(quote_ident(column), names[i])})"
        columns.append(
            f"array_agg(DISTINCT jsonb_typeof({c})) AS t{i}, "
            f"bool_and(CASE WHEN jsonb_typeof({c}) = 'number' THEN {c}::numeric = "
            f"trunc({c}::numeric) AND {c}::numeric BETWEEN {INT64_MIN} AND {INT64_MAX} "
            f"ELSE true END) AS n{i}")
    sql = f"SELECT {', '.join(columns)} FROM {read.layout.qualified} WHERE {' AND '.join(where)}"
    return sql, binds.values


def kind_of(types: list[str | None] | None, integral: bool | None) -> str:
    """A field's kind from the JSON types its values have."""
    present = {t for t in (types or ()) if t not in (None, "null")}
    if not present:
        return "null"
    if present == {"string"}:
        return "string"
    if present == {"number"}:
        return "integer" if integral else "float"
    if present == {"boolean"}:
        return "boolean"
    return "json"


# json.dumps with arguments builds a new encoder per call; a column's cells share this one
_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def json_text(value: JsonValue) -> str:
    """A value as compact JSON text (UTF-8, not ASCII-escaped)."""
    return _compact(value)


def arrow_schema(kinds: Mapping[str, str], cells: bool = False) -> Any:
    pa = require("pyarrow", "Arrow output")
    types = {"string": pa.string(), "integer": pa.int64(), "float": pa.float64(),
             "boolean": pa.bool_(), "json": pa.string(), "null": pa.string()}
    return pa.schema([pa.field(name, types[kind]) for name, kind in kinds.items()]
                     + [pa.field(name, pa.string()) for name in system_columns(cells)])


def _misfit(field: str, kind: str, value: JsonValue) -> ConflictError:
    return ConflictError(f"field {field!r} holds a {type(value).__name__} where its column "
                         f"is {kind} (a run wrote it during the read); read it again")


def column_values(field: str, kind: str, values: list[JsonValue]) -> list[JsonValue]:
    """`values` as the column of `kind` holds them (see the module docstring)."""
    if kind in ("string", "null"):
        return [v if v is None or type(v) is str else json_text(v) for v in values]
    if kind == "json":
        return [None if v is None else json_text(v) for v in values]
    out: list[JsonValue] = []
    for v in values:
        if v is None:
            out.append(None)
        elif kind == "integer" and type(v) is int and INT64_MIN <= v <= INT64_MAX:
            out.append(v)
        elif kind == "float" and type(v) in (int, float):
            out.append(float(v))
        elif kind == "boolean" and type(v) is bool:
            out.append(v)
        else:
            raise _misfit(field, kind, v)
    return out


def record_batch(kinds: Mapping[str, str], rows: list[dict], cells: bool = False) -> Any:
    """One Arrow record batch of `rows` (dicts as `Dataset.iterate` gives them; with `cells`,
    their `_cells` as JSON text in the last column)."""
    pa = require("pyarrow", "Arrow output")
    arrays = [column_values(field, kind, [row.get(field) for row in rows])
              for field, kind in kinds.items()]
    arrays += [[row[name] for row in rows] for name in TABLE_SYSTEM_COLUMNS]
    if cells:
        arrays.append([json_text(row[CELLS_COLUMN]) for row in rows])
    schema = arrow_schema(kinds, cells)
    return pa.RecordBatch.from_arrays(
        [pa.array(a, type=t) for a, t in zip(arrays, schema.types)], schema=schema)

