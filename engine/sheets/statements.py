"""Statements built with their arguments: SQL text and bind values travel together.

How it works
- A builder allocates each bind as it writes the text that uses it (`BindParams.add` returns
  the `$n::cast` to write, and keeps the value), so a bind's number is never written by hand,
  and a value the text does not use is never sent. `BindParams.statement(sql)` pairs the
  text with the values.
- Values are always binds; identifiers go through `engine.sql.quote_ident`.
- A large array of strings (a chunk's row keys) travels as the text of one JSON array and is
  expanded with `json_array_elements_text` (`BindParams.strings`): the driver checks every
  element of a `text[]` bind for being an array itself (two Python-level `isinstance` calls
  an element), while one JSON text is encoded in one call and parsed by the server in C.
This module does no I/O.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from ..canonical import stable_dumps


@attrs.frozen
class Statement:
    """SQL text and the arguments of its binds, in order."""

    sql: str
    args: tuple[object, ...]


class BindParams:
    """Allocates `$n` bind positions while a statement is built (values stay binds)."""

    def __init__(self, first: int = 1) -> None:
        self.values: list[object] = []
        self.first = first

    def add(self, value: object, cast: str) -> str:
        self.values.append(value)
        return f"${self.first + len(self.values) - 1}::{cast}"

    def strings(self, values: Sequence[str | None]) -> str:
        """Bind `values` (strings, or None for SQL NULL) as one JSON array; the text written is
        the set-returning call that expands it, one row an element, in order (for `ROWS
        FROM` beside the statement's other arrays)."""
        return f"json_array_elements_text({self.add(stable_dumps(list(values)), 'json')})"

    def statement(self, sql: str) -> Statement:
        """`sql` with the values allocated so far (the builder starts at `$1`)."""
        assert self.first == 1, "a statement's binds start at $1"
        return Statement(sql, tuple(self.values))
