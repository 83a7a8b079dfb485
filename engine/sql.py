"""SQL identifiers: the one quoting helper. Values always travel as bind parameters.

Closed sets of states (`SqlLiteral` enums) are the one exception: their members are constants
of the code, never input, so statement text writes them as `State.MEMBER.sql`.
"""

from __future__ import annotations

import enum

from .errors import InvalidInputError


class SqlLiteral(enum.StrEnum):
    """A closed set of strings that Python and SQL text both spell: a member equals its value
    (`State.OPEN == "open"`), and statement text writes `State.OPEN.sql` (`'open'`), so each
    state has one definition. Values hold no quote."""

    @property
    def sql(self) -> str:
        """The value as an SQL string literal, for statement text."""
        return f"'{self.value}'"

    @classmethod
    def coerce(cls, value: object) -> object:
        """`value` as a member when it is one's value, else unchanged (for a converter whose
        validator then refuses it with a message naming the field)."""
        return cls(value) if isinstance(value, str) and value in cls._value2member_map_ else value

    @classmethod
    def sql_list(cls, members: "tuple[SqlLiteral, ...]") -> str:
        """`'a', 'b'`: members as an SQL list's items (`state IN ({...})`)."""
        return ", ".join(member.sql for member in members)


def quote_ident(name: str) -> str:
    """Quote an identifier for PostgreSQL (double quotes doubled); refuses NUL and empty names."""
    if not name or "\x00" in name:
        raise InvalidInputError(f"invalid SQL identifier {name!r}")
    return '"' + name.replace('"', '""') + '"'


def qualified(schema: str, table: str) -> str:
    """`"schema"."table"`."""
    return f"{quote_ident(schema)}.{quote_ident(table)}"
