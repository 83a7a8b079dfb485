"""Input limits: what the API accepts, checked before any query.

Every string the API accepts must be storable and must work; anything past a limit below is
refused before the first query (the callers raise `ScopeError` for scope parts and
`InvalidInputError` for everything else, naming the field). The limits follow from what
PostgreSQL holds:
- identifiers (org, play, run id, table namespace, map invocation id): 1–256 UTF-8 bytes
  after stripping surrounding whitespace, and no NUL, lone surrogate or control character
  (Unicode category Cc). They are parts of primary keys, so they must fit an index entry
  together.
- schema and execution role names: the same, but at most 63 UTF-8 bytes, because PostgreSQL
  silently truncates longer names (two schemas sharing their first 63 bytes would be one).
- keys (receipts, explicit sheet keys): 1–1024 characters and at most 2,048 UTF-8 bytes (a
  b-tree entry holds at most 2,704 bytes). A receipt's stored key is the compact JSON of
  `[org, play, "receipt", key]`, where `"` and `\\` double and control characters take six
  bytes: it must be at most `MAX_STORED_RECEIPT_KEY_BYTES`, reachable only with identifiers
  and a key all near their limits and full of such characters.
- field names (contract fields and output keys): see `engine.sheets.model`.
- a row's input index (an offset plus a position, or given): 0 to `MAX_INPUT_INDEX`, a
  `bigint` column's largest value.
This module does no I/O.
"""

from __future__ import annotations

import re

MAX_IDENTIFIER_BYTES = 256
MAX_NAME_BYTES = 63  # PostgreSQL's NAMEDATALEN - 1: schema and role names
MAX_KEY_CHARS = 1024
MAX_KEY_BYTES = 2048
MAX_STORED_RECEIPT_KEY_BYTES = 2640  # a b-tree entry holds 2,704 bytes with its headers
MAX_INPUT_INDEX = 2**63 - 1  # `_input_index` is a bigint

# NUL and the other C0/C1 control characters, DEL, and lone surrogates (valid pairs never
# appear in a decoded Python str).
_REFUSED_IN_IDENTIFIERS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def utf8_size(text: str) -> int:
    """Bytes of `text` in UTF-8 (lone surrogates counted as three, as their escapes would be)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def identifier_problem(value: str, max_bytes: int = MAX_IDENTIFIER_BYTES) -> str | None:
    """Why `value` (already stripped) is not an acceptable identifier, or None."""
    if not value:
        return "must not be empty"
    found = _REFUSED_IN_IDENTIFIERS.search(value)
    if found is not None:
        char = found.group()
        kind = "NUL" if char == "\x00" else (
            "a lone surrogate" if "\ud800" <= char <= "\udfff" else "a control character")
        return f"must not contain {kind} ({char!r} at position {found.start()})"
    size = utf8_size(value)
    if size > max_bytes:
        return f"must be at most {max_bytes} UTF-8 bytes, got {size}"
    return None


def key_problem(key: str) -> str | None:
    """Why `key` is not an acceptable key (length only; callers check the characters they
    cannot store), or None."""
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        return f"must have 1 to {MAX_KEY_CHARS} characters, got {len(key)}"
    if len(key) * 4 > MAX_KEY_BYTES and not key.isascii():
        size = utf8_size(key)
        if size > MAX_KEY_BYTES:
            return f"must be at most {MAX_KEY_BYTES} UTF-8 bytes, got {size}"
    return None
