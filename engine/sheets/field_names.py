"""Field names of a sheet: what a name may be, and how errors show it.

A field name is a non-empty string of at most `MAX_FIELD_CHARS` characters, without NUL, not
starting with `_` (the prefix of the system columns); it is stored as jsonb would store it.
"""

from __future__ import annotations

from .. import canonical
from ..errors import InvalidInputError

MAX_FIELD_CHARS = 256


def field_problem(name: str) -> str | None:
    """Why `name` (a str) cannot be a field name, or None (NUL is the caller's to check)."""
    if not name:
        return "must not be empty"
    if len(name) > MAX_FIELD_CHARS:
        return f"must have at most {MAX_FIELD_CHARS} characters, got {len(name)}"
    if name[0] == "_":
        return "must not start with '_' (the prefix of the system columns)"
    return None


def shown(name: str) -> str:
    """`field name 'x'`, the name cut short enough for an error message."""
    if not name:
        return "field name"
    return "field name " + repr(name if len(name) <= 40 else name[:40] + "…")


def clean_field(name: object, where: str) -> str:
    """A contract field name, checked (see the module docstring) and cleaned as jsonb would."""
    if not isinstance(name, str):
        raise InvalidInputError(f"{where}: field name {name!r} is not a string")
    if "\x00" in name:
        raise InvalidInputError(f"{where}: {shown(name)} must not contain NUL")
    problem = field_problem(name)
    if problem is not None:
        raise InvalidInputError(f"{where}: {shown(name)} {problem}")
    return canonical.normalize(name, where)
