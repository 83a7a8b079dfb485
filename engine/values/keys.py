"""Receipt keys: injective, prefix-safe byte strings.

A key is the UTF-8 of the compact JSON array `[org, play, kind, *parts]`. JSON arrays of
strings and integers are injective, and kinds keep user receipts (`receipt`) disjoint from
internal facts by construction. For every (org, play, kind, run) the text of the array without
its closing bracket plus a comma is a byte prefix; `[prefix, prefix || 0xff)` holds exactly that
run's facts of that kind, because no UTF-8 text contains the byte 0xff and a JSON string can only
end at an unescaped quote. This module does no I/O.
"""

from __future__ import annotations

import json

from ..errors import InvalidInputError
from ..limits.inputs import MAX_STORED_RECEIPT_KEY_BYTES, key_problem
from .scopes import PlayScope, RunScope

USER_RECEIPT_KIND = "receipt"


def _encode(parts: list) -> bytes:
    try:
        return json.dumps(parts, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"key part {parts!r} holds a lone surrogate") from exc


def check_user_key(key: object) -> str:
    if not isinstance(key, str):
        raise InvalidInputError(f"key must be a string, got {type(key).__name__}")
    problem = key_problem(key)
    if problem is not None:
        raise InvalidInputError(f"key {problem}")
    return key


def receipt_key(scope: PlayScope | RunScope, key: str) -> bytes:
    """The stored key of a user's work receipt (only the scope's org and play are used); its
    size is checked against what the index holds (see `engine.limits.inputs`)."""
    stored = _encode([scope.org_id, scope.play, USER_RECEIPT_KIND, check_user_key(key)])
    if len(stored) > MAX_STORED_RECEIPT_KEY_BYTES:
        raise InvalidInputError(
            f"the stored receipt key (org, play and key as JSON) is {len(stored)} bytes, more "
            f"than {MAX_STORED_RECEIPT_KEY_BYTES}: use a shorter key"
        )
    return stored


def fact_key(scope: PlayScope, kind: str, run_id: str, *parts: str | int) -> bytes:
    """The stored key of an internal fact of `kind` belonging to `run_id`."""
    if kind == USER_RECEIPT_KIND:
        raise ValueError("internal facts cannot use the user receipt kind")
    return _encode([scope.org_id, scope.play, kind, run_id, *parts])


def run_key_range(scope: PlayScope, kind: str, run_id: str) -> tuple[bytes, bytes]:
    """`[low, high)` holding every fact of `kind` of `run_id` that has further parts."""
    low = _encode([scope.org_id, scope.play, kind, run_id])[:-1] + b","
    return low, low + b"\xff"


def kind_range(scope: PlayScope, kind: str, *, prefix: bool = False) -> tuple[bytes, bytes]:
    """`[low, high)` holding every key of the scope's (org, play) whose kind is `kind` — or, with
    `prefix`, whose kind starts with `kind` (the JSON string is left open after it)."""
    low = _encode([scope.org_id, scope.play, kind])[:-1]
    low = low[:-1] if prefix else low + b","
    return low, low + b"\xff"


def decode_key(stored: bytes) -> list:
    return json.loads(stored.decode("utf-8"))
