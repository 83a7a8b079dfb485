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

The fast path: most values are already canonical, and proving that is cheaper than rebuilding
them. `is_canonical(value)` walks the containers without allocating, checking exact JSON types
(dict, list, str, int, float, bool, None; no subclasses, no tuples), str keys, clean strings,
bounded ints, finite non-integral floats and the depth limit; it is True exactly when
`normalize` would return an equal value of the same types. `normalize_fast(value, path)` always
returns a value equal to `normalize(value, path)` (same types, same errors): it returns the
caller's own object, not a copy, when it is already canonical (copy it if you will mutate
either), rebuilds directly a value whose only departures are integral floats, and hands anything
else to `normalize`, which cleans it or refuses it naming the path.
This module does no I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from itertools import repeat
from typing import Callable, Iterable, Union

from .errors import InvalidInputError

# A JSON value as jsonb holds it (what `normalize` returns); annotations name it, not `Any`.
JsonValue = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
# A JSON object: a row's inputs or outputs, a body, a cell map.
JsonObject = dict[str, JsonValue]

MAX_DEPTH = 64
MAX_INT_DIGITS = 4000
_INT_LIMIT = 10**MAX_INT_DIGITS
_NEG_INT_LIMIT = -_INT_LIMIT  # negating a 4000-digit int per check would allocate
_DEEPEST = MAX_DEPTH - 1  # a container at this depth may hold no container

# NUL or a lone surrogate (valid pairs never appear in a decoded Python str).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")

_encoder = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False, check_circular=False
)


def _clean_str(value: str) -> str:
    if _UNSTORABLE.search(value) is None:
        return value
    return _UNSTORABLE.sub("\ufffd", value)


def normalize(value: object, path: str = "value") -> JsonValue:
    """Return `value` exactly as jsonb will store and return it; raise `InvalidInputError`."""
    return _normalize(value, path, 0)


def _normalize(value: object, path: str, depth: int) -> JsonValue:
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
        out: JsonObject = {}
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


def is_clean_str(value: str) -> bool:
    """True when `value` holds no NUL and no lone surrogate (so `normalize` keeps it as is)."""
    if value.isascii():
        return "\x00" not in value
    return _UNSTORABLE.search(value) is None


def is_canonical(value: object, strings: bool = True, _depth: int = 0) -> bool:
    """True when `normalize(value)` would return an equal value of the same types.

    `strings=False` skips the two string rules (no NUL, no lone surrogate) for a caller that
    checks them once on the encoded text instead; everything else is still checked. `_depth`
    is the walk's own (how many containers enclose `value`).
    """
    # One pass over a container's items with the scalar checks inline (the common case of flat
    # rows: no call per field); dict keys get a pass of their own. `x - x == 0.0` holds exactly
    # for finite floats, without a call.
    kind = type(value)
    if kind is dict:
        for key in value:
            if type(key) is not str or strings and not (
                "\x00" not in key and (key.isascii() or _UNSTORABLE.search(key) is None)
            ):
                return False
        items: Iterable[object] = value.values()
    elif kind is list:
        items = value
    elif kind is str:
        return not strings or is_clean_str(value)
    elif value is None or kind is bool:
        return True
    elif kind is int:
        return _NEG_INT_LIMIT < value < _INT_LIMIT
    elif kind is float:
        return value - value == 0.0 and not value.is_integer()
    else:
        return False
    for item in items:
        kind = type(item)
        if kind is str:
            if not strings or "\x00" not in item and (
                item.isascii() or _UNSTORABLE.search(item) is None
            ):
                continue
        elif kind is int:
            if _NEG_INT_LIMIT < item < _INT_LIMIT:
                continue
        elif kind is float:
            if item - item == 0.0 and not item.is_integer():
                continue
        elif item is None or kind is bool:
            continue
        elif (kind is dict or kind is list) and _depth < _DEEPEST and is_canonical(
            item, strings, _depth + 1
        ):
            continue
        return False
    return True


class _NeedsNormalize(Exception):
    """Raised by `_rebuild` when a value needs `normalize` (to clean or refuse it)."""


def _rebuild(value: object, depth: int) -> JsonValue:
    # A value whose only departures from canonical form are integral floats.
    kind = type(value)
    if kind is str:
        if "\x00" not in value and (value.isascii() or _UNSTORABLE.search(value) is None):
            return value
    elif kind is float:
        if value - value == 0.0:
            return int(value) if value.is_integer() else value
    elif kind is int:
        if _NEG_INT_LIMIT < value < _INT_LIMIT:
            return value
    elif value is None or kind is bool:
        return value
    elif kind is dict:
        if depth < MAX_DEPTH:
            out = {}
            for key, item in value.items():
                if type(key) is not str or "\x00" in key or not key.isascii() and (
                    _UNSTORABLE.search(key) is not None
                ):
                    raise _NeedsNormalize
                out[key] = _rebuild(item, depth + 1)
            return out
    elif kind is list:
        if depth < MAX_DEPTH:
            return [_rebuild(item, depth + 1) for item in value]
    raise _NeedsNormalize


def normalize_fast(value: object, path: str = "value") -> JsonValue:
    """`normalize(value, path)`, without its per-element work on the common inputs.

    Returns `value` itself (not a copy) when it is already canonical; rebuilds a value whose
    only departures are integral floats; hands anything else to `normalize`.
    """
    if is_canonical(value):
        return value
    try:
        return _rebuild(value, 0)
    except _NeedsNormalize:
        return normalize(value, path)


def _reused_c_encoder() -> Callable[[JsonValue, int], list[str]] | None:
    """`_encoder`'s settings as one reused C encoder (`JSONEncoder.encode` builds a new one per
    call, which costs about as much as encoding a small row): the same text and errors, in
    chunks. None without the C accelerator."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return None
    return make(None, _encoder.default, json.encoder.encode_basestring, None, ":", ",",
                True, False, False)


_C_ENCODE = _reused_c_encoder()
_encode: Callable[[JsonValue], str] = _encoder.encode if _C_ENCODE is None else \
    (lambda value: "".join(_C_ENCODE(value, 0)))


def _encode_each(values: list[JsonValue]) -> list[str]:
    """`_encode` of each value, without a Python frame per value."""
    if _C_ENCODE is None:  # pragma: no cover
        return list(map(_encoder.encode, values))
    return list(map("".join, map(_C_ENCODE, values, repeat(0, len(values)))))


def stable_dumps(value: JsonValue) -> str:
    """The canonical text of an already normalized value."""
    return _encode(value)


def canonical_texts(rows: object) -> list[str] | None:
    """The canonical texts of `rows` when it is a list of dicts that `normalize` keeps as they
    are (each check one pass in C), else None: the caller then goes row by row, normalizing
    each and naming a row it refuses."""
    if type(rows) is not list or set(map(type, rows)) != {dict} \
            or not all(map(is_canonical, rows)):
        return None
    return _encode_each(rows)


def digest(value: object) -> str:
    """SHA-256 hex of the canonical text of `normalize(value)`."""
    return hashlib.sha256(stable_dumps(normalize(value)).encode("utf-8")).hexdigest()


def loads(text: str | None) -> JsonValue:
    """Decode jsonb text as the server returns it (None stays None)."""
    return None if text is None else json.loads(text)
