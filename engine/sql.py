"""SQL identifiers: the one quoting helper. Values always travel as bind parameters."""

from __future__ import annotations

from .errors import InvalidInputError


def quote_ident(name: str) -> str:
    """Quote an identifier for PostgreSQL (double quotes doubled); refuses NUL and empty names."""
    if not name or "\x00" in name:
        raise InvalidInputError(f"invalid SQL identifier {name!r}")
    return '"' + name.replace('"', '""') + '"'


def qualified(schema: str, table: str) -> str:
    """`"schema"."table"`."""
    return f"{quote_ident(schema)}.{quote_ident(table)}"
