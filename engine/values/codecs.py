"""Wire codecs: engine values to JSON and back, directed by type, for the gateway.

How it works
- A `Codec` pairs `encode(value, path) -> JSON` with `decode(JSON, path) -> value`. Codecs are
  built from a few primitives (`STR`, `INT`, `BOOL`, `FLOAT`, `USER_JSON`, `RAW`) and
  combinators (`optional`, `list_of`, `dict_of`, `record`), so each action of the registry
  (`engine.actions`) states exactly what its input and output look like on the wire.
- A closed set of states (an `engine.sql.SqlLiteral` enum) travels as its members' plain
  strings (`enum_of`): the same text SQL stores, decoded back into members.
- Both directions check types and raise `InvalidInputError` naming the path (`run.scope.play`,
  `outcomes[3].key`): a client refuses bad input before sending it, and a server refuses a
  malformed body before any query. A `record` is built by calling its attrs class, so the
  class's own validators (which raise `InvalidInputError` or `ScopeError`) still hold.
- User data (rows, outputs) is never walked by the codec: `USER_JSON` encodes through
  `canonical.normalize_fast` (the same refusals, with the same paths, as a direct call) and
  decodes as given; `RAW` passes trusted JSON (what a server answered) through both ways.
- What a server decodes is bounded to what the database can hold, so a hostile body is a 400,
  never a database error: `INT` is a 64-bit integer (`INT32` for 32-bit columns), `FLOAT` a
  finite number within ±`MAX_FLOAT` (NaN, infinities and 1e308 intervals are refused), `STR`
  holds no lone surrogate (UTF-8 cannot encode one) and `TEXT` is a `STR` without NUL either
  (for text stored as is; fields the engine normalizes, such as a failure's message, stay `STR`).
This module does no I/O.
"""

from __future__ import annotations

import datetime
import enum
import math
import re
from typing import Callable, Iterable, TypeVar

import attrs

from .. import canonical
from ..canonical import JsonObject, JsonValue
from ..errors import EngineError, InvalidInputError
from ..limits.bounds import ints_within
from .scopes import MapScope, PlayScope, RunRef, RunScope

T = TypeVar("T")
# encode(value, path): an engine value (of any type: the codec checks it) to JSON;
# decode(json, path): JSON (of any shape: the codec checks it) to an engine value.
Encode = Callable[[object, str], JsonValue]
Decode = Callable[[JsonValue, str], object]


@attrs.frozen
class Codec:
    """How one kind of value travels: `encode(value, path)` and `decode(json, path)`."""

    name: str
    encode: Encode
    decode: Decode


def _typed(name: str, check: Callable[[object], bool],
           convert: Callable[[object], JsonValue] = lambda v: v) -> Codec:
    def code(value: object, path: str) -> JsonValue:
        if not check(value):
            raise InvalidInputError(f"{path} must be {name}, got {type(value).__name__}")
        return convert(value)

    return Codec(name, code, code)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_FLOAT = 1e12  # seconds, rates and bursts: 31,000 years of seconds, far past any real value
_SURROGATE = re.compile("[\ud800-\udfff]")


def _str_decode(value: object, path: str) -> str:
    if type(value) is not str:
        raise InvalidInputError(f"{path} must be a string, got {type(value).__name__}")
    if not value.isascii() and _SURROGATE.search(value) is not None:
        raise InvalidInputError(f"{path} holds a lone surrogate")
    return value


def _text_decode(value: object, path: str) -> str:
    value = _str_decode(value, path)
    if "\x00" in value:
        raise InvalidInputError(f"{path} holds NUL, which text cannot store")
    return value


def _int_between(low: int, high: int, what: str) -> Codec:
    def code(value: object, path: str) -> int:
        if type(value) is not int:
            raise InvalidInputError(f"{path} must be an integer, got {type(value).__name__}")
        if not low <= value <= high:
            raise InvalidInputError(f"{path} must be {what} (from {low} to {high}), got {value}")
        return value

    return Codec(f"an integer ({what})", code, code)


def _float_encode(value: object, path: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise InvalidInputError(f"{path} must be a finite number, got {value!r}")
    return float(value)


def _float_decode(value: object, path: str) -> float:
    if type(value) not in (int, float):
        raise InvalidInputError(f"{path} must be a number, got {type(value).__name__}")
    if not -MAX_FLOAT <= value <= MAX_FLOAT:  # NaN fails both comparisons
        raise InvalidInputError(f"{path} must be a finite number within ±{MAX_FLOAT:g}, got {value!r}")
    return float(value)


STR = Codec("a string", _typed("a string", lambda v: type(v) is str).encode, _str_decode)
TEXT = Codec("a string without NUL", _text_decode, _text_decode)
INT = _int_between(INT64_MIN, INT64_MAX, "a 64-bit integer")
INT32 = _int_between(INT32_MIN, INT32_MAX, "a 32-bit integer")
BOOL = _typed("a boolean", lambda v: type(v) is bool)
FLOAT = Codec("a number", _float_encode, _float_decode)
NOTHING = Codec("null", lambda _v, _path: None, lambda _v, _path: None)


def _all_str(values: list) -> bool:
    if set(map(type, values)) - {str}:
        return False
    joined = "".join(values)  # a lone surrogate stays one wherever it sits
    return joined.isascii() or _SURROGATE.search(joined) is None


def _all_int(low: int, high: int) -> Callable[[list], bool]:
    return lambda values: not values or ints_within(values, low, high)


# A list of these encodes or decodes as it is when the check of the whole list (each one pass
# in C) holds; `list_of` then skips the call per item (a gateway's keys and input indexes, a
# completion's committed keys). Anything off goes item by item, naming the item.
_COLUMN_CHECKS: dict[Encode | Decode, Callable[[list], bool]] = {
    _str_decode: _all_str,
    STR.encode: lambda values: not set(map(type, values)) - {str},
    INT.decode: _all_int(INT64_MIN, INT64_MAX),  # INT's encode is its decode
    INT32.decode: _all_int(INT32_MIN, INT32_MAX),
}


def enum_of(kind: type[enum.StrEnum]) -> Codec:
    """A member of the string enum `kind`, on the wire as its plain value; a caller may pass the
    value itself. Decoding gives the member back and refuses any other value, naming the path."""
    values = tuple(member.value for member in kind)
    name = "one of " + ", ".join(values)

    def encode(value: object, path: str) -> str:
        if not isinstance(value, str) or value not in values:
            raise InvalidInputError(f"{path} must be {name}, got {value!r}")
        return value if type(value) is str else value.value

    def decode(value: object, path: str) -> enum.StrEnum:
        if type(value) is not str or value not in values:
            raise InvalidInputError(f"{path} must be {name}, got {value!r}")
        return kind(value)

    return Codec(name, encode, decode)


def as_is(value: T, _path: str) -> T:
    """The decode (or encode) that takes a value as it is; `list_of`, `record` and `optional`
    recognise it and skip the call per item."""
    return value


RAW = Codec("JSON", as_is, as_is)
USER_JSON = Codec("user JSON", canonical.normalize_fast, as_is)


def _encode_timestamp(value: object, path: str) -> str:
    if not isinstance(value, datetime.datetime) or value.tzinfo is None:
        raise InvalidInputError(f"{path} must be an aware datetime, got {value!r}")
    return value.isoformat()


def _decode_timestamp(value: object, path: str) -> datetime.datetime:
    if type(value) is str:
        try:
            parsed = datetime.datetime.fromisoformat(value)
        except ValueError:
            parsed = None
        if parsed is not None and parsed.tzinfo is not None:
            return parsed
    raise InvalidInputError(f"{path} must be an ISO 8601 timestamp with an offset, got {value!r}")


TIMESTAMP = Codec("an ISO 8601 timestamp", _encode_timestamp, _decode_timestamp)


def optional(inner: Codec) -> Codec:
    encode, decode = inner.encode, inner.decode
    return Codec(
        f"{inner.name} or null",
        as_is if encode is as_is else lambda v, path: None if v is None else encode(v, path),
        as_is if decode is as_is else lambda v, path: None if v is None else decode(v, path),
    )


def _items(value: Iterable[T]) -> list[T] | tuple[T, ...]:
    return value if type(value) in (list, tuple) else list(value)


def list_of(inner: Codec, *, as_tuple: bool = False) -> Codec:
    """A list of `inner`. Items are coded with the list's own path first; only when one fails
    is the list coded again with each item's path, so the error names the item (paths cost
    nothing on the way through)."""
    inner_encode, inner_decode = inner.encode, inner.decode
    column, column_out = _COLUMN_CHECKS.get(inner_decode), _COLUMN_CHECKS.get(inner_encode)

    def encode(value: object, path: str) -> list[JsonValue]:
        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
            raise InvalidInputError(f"{path} must be a list, got {type(value).__name__}")
        items = _items(value)  # a one-shot iterable is read once
        if column_out is not None and column_out(items):
            return list(items)
        try:
            return [inner_encode(item, path) for item in items]
        except EngineError as exc:
            [inner_encode(item, f"{path}[{i}]") for i, item in enumerate(items)]
            raise exc  # pragma: no cover - a codec that failed once fails again

    def decode(value: object, path: str) -> list[object] | tuple[object, ...]:
        if type(value) is not list:
            raise InvalidInputError(f"{path} must be a list, got {type(value).__name__}")
        if inner_decode is as_is or column is not None and column(value):
            return tuple(value) if as_tuple else list(value)
        try:
            items = [inner_decode(item, path) for item in value]
        except EngineError as exc:
            [inner_decode(item, f"{path}[{i}]") for i, item in enumerate(value)]
            raise exc  # pragma: no cover - a codec that failed once fails again
        return tuple(items) if as_tuple else items

    return Codec(f"list of {inner.name}", encode, decode)


def dict_of(inner: Codec) -> Codec:
    """An object with string keys, its values coded by `inner` (order kept)."""

    def encode(value: object, path: str) -> JsonObject:
        if not isinstance(value, dict):
            raise InvalidInputError(f"{path} must be a mapping, got {type(value).__name__}")
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidInputError(f"{path} keys must be strings, got {key!r}")
            out[key] = inner.encode(item, f"{path}[{key!r}]")
        return out

    def decode(value: object, path: str) -> dict[str, object]:
        if type(value) is not dict:
            raise InvalidInputError(f"{path} must be an object, got {type(value).__name__}")
        return {key: inner.decode(item, f"{path}[{key!r}]") for key, item in value.items()}

    return Codec(f"object of {inner.name}", encode, decode)


def record(cls: type, *, default: Codec | None = None, **fields: Codec) -> Codec:
    """An attrs class as a JSON object of its fields. Every field needs a codec (given by name,
    or `default`); decoding rebuilds the value through the class, so its validators run."""
    names = [field.name for field in attrs.fields(cls)]
    codecs = {}
    for name in names:
        codec = fields.get(name, default)
        if codec is None:
            raise TypeError(f"record({cls.__name__}): no codec for field {name!r}")
        codecs[name] = codec
    unknown = set(fields) - set(names)
    if unknown:
        raise TypeError(f"record({cls.__name__}): no such fields {sorted(unknown)}")
    items = tuple(codecs.items())
    coded = tuple((name, codec.encode, codec.decode) for name, codec in items)
    taken = tuple(name for name, codec in items if codec.decode is as_is)  # decoded as they are
    decoded = tuple((name, codec.decode) for name, codec in items if codec.decode is not as_is)
    known = frozenset(codecs)
    width = len(known)

    def encode_paths(value: object, path: str) -> JsonObject:
        return {name: codec.encode(getattr(value, name), f"{path}.{name}") for name, codec in items}

    def encode(value: object, path: str) -> JsonObject:
        if not isinstance(value, cls):
            raise InvalidInputError(f"{path} must be a {cls.__name__}, got {type(value).__name__}")
        try:  # fields are coded with the record's path; a failure is coded again with theirs
            return {name: code(getattr(value, name), path) for name, code, _ in coded}
        except EngineError as exc:
            encode_paths(value, path)
            raise exc  # pragma: no cover - a codec that failed once fails again

    def decode(value: object, path: str) -> object:
        if type(value) is not dict:
            raise InvalidInputError(f"{path} must be an object ({cls.__name__}), got {type(value).__name__}")
        if len(value) > width or not known.issuperset(value):
            raise InvalidInputError(f"{path} has unknown fields {sorted(value.keys() - known)}")
        kwargs = {name: value[name] for name in taken if name in value}
        try:
            for name, code in decoded:
                if name in value:
                    kwargs[name] = code(value[name], path)
        except EngineError as exc:
            {name: codec.decode(value[name], f"{path}.{name}") for name, codec in items
             if name in value}
            raise exc  # pragma: no cover - a codec that failed once fails again
        try:
            return cls(**kwargs)
        except EngineError:
            raise
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"{path}: {exc}") from exc

    return Codec(cls.__name__, encode, decode)


PLAY_SCOPE = record(PlayScope, org_id=STR, play=STR)
RUN_SCOPE = record(RunScope, org_id=STR, play=STR, run_id=STR)
MAP_SCOPE = record(MapScope, org_id=STR, play=STR, run_id=STR, table_namespace=STR,
                   map_invocation_id=STR)
RUN_REF = record(RunRef, scope=RUN_SCOPE, epoch=INT)
