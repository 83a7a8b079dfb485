"""Canonical JSON: values exactly as PostgreSQL `jsonb` stores them.

`normalize` maps a Python value to the value `jsonb` will hand back, or raises
`InvalidInputError` naming the path of the first value jsonb cannot hold. `stable_dumps` is the
one canonical text (sorted keys, no spaces, UTF-8, shortest float repr) and `digest` its SHA-256.
Law, property-tested against a real server: for every value `normalize` accepts, storing
`stable_dumps(normalize(v))` in jsonb and reading it back gives the same `stable_dumps`.

Choices where jsonb forces one:
- integral floats become `int` (jsonb keeps numbers as numeric; `1.0` reads back as `1`);
- NaN and ±inf are refused (jsonb has no such numbers);
- NUL and lone surrogates in strings (keys included) become U+FFFD (jsonb refuses both);
- two keys of one object that become equal after that substitution are refused;
- integers of more than 4000 digits are refused (Python's int/str conversion limit is near);
- nesting deeper than 64 containers is refused.
This module does no I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from .errors import InvalidInputError

MAX_DEPTH = 64
MAX_INT_DIGITS = 4000
_INT_LIMIT = 10**MAX_INT_DIGITS

# NUL or a lone surrogate (valid pairs never appear in a decoded Python str).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")

_encoder = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False, check_circular=False
)


def _clean_str(value: str) -> str:
    if _UNSTORABLE.search(value) is None:
        return value
    return _UNSTORABLE.sub("\ufffd", value)


def normalize(value: Any, path: str = "value") -> Any:
    """Return `value` exactly as jsonb will store and return it; raise `InvalidInputError`."""
    return _normalize(value, path, 0)


def _normalize(value: Any, path: str, depth: int) -> Any:
    # Order matters: bool is an int subclass, and str is the commonest leaf.
    if value is None or value is True or value is False:
        return value
    kind = type(value)
    if kind is str:
        return _clean_str(value)
    if kind is int:
        if -_INT_LIMIT < value < _INT_LIMIT:
            return value
        raise InvalidInputError(f"{path}: integer has more than {MAX_INT_DIGITS} digits")
    if kind is float:
        if not math.isfinite(value):
            raise InvalidInputError(f"{path}: {value!r} is not a JSON number")
        if value.is_integer():
            return int(value)
        return value
    if depth >= MAX_DEPTH:
        raise InvalidInputError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if kind is dict or isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidInputError(f"{path}: key {key!r} is not a string")
            clean = _clean_str(key)
            if clean in out:
                raise InvalidInputError(f"{path}: key {key!r} collides with another after cleaning")
            out[clean] = _normalize(item, f"{path}.{key}", depth + 1)
        return out
    if kind is list or kind is tuple or isinstance(value, (list, tuple)):
        return [_normalize(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return _clean_str(str(value))
    if isinstance(value, int):
        return _normalize(int(value), path, depth)
    if isinstance(value, float):
        return _normalize(float(value), path, depth)
    raise InvalidInputError(f"{path}: {type(value).__name__} is not a JSON value")


def stable_dumps(value: Any) -> str:
    """The canonical text of an already normalized value."""
    return _encoder.encode(value)


def digest(value: Any) -> str:
    """SHA-256 hex of the canonical text of `normalize(value)`."""
    return hashlib.sha256(stable_dumps(normalize(value)).encode("utf-8")).hexdigest()


def loads(text: str | None) -> Any:
    """Decode jsonb text as the server returns it (None stays None)."""
    return None if text is None else json.loads(text)
