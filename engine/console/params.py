"""What a console URL may carry: path segments that hold any text (a `/` too), and query values
checked before any query runs. Pure: no I/O.

How it works
- A path segment is percent-encoded whole (`seg`: `/` is `%2F`, `%` is `%25`), and the routes
  match the request's raw path re-encoded segment by segment (`encoded_path`), so a play or run
  id holding `/` is one segment; handlers decode it back (`segment`). ASGI's `path` is already
  decoded (a `%2F` there is a `/`), so the raw path is the truth when it agrees with it.
- Every value a request brings (path segments and query values) is text without NUL of at most
  `MAX_TEXT` characters; `epoch` and `cursor` check the shapes the store reads (an int64, a
  timestamp as PostgreSQL prints it). Anything else raises `ValueError` naming the field: the
  routes answer 400 and no statement runs.
"""

from __future__ import annotations

import datetime
import json
import re
import urllib.parse
from typing import Iterable

from starlette.datastructures import QueryParams

from ..limits.bounds import is_int

MAX_TEXT = 2048
INT64_MAX = 2**63 - 1
_EPOCH = re.compile(r"[0-9]{1,19}")
# `_created_at::text` as PostgreSQL prints a timestamptz (DateStyle ISO)
_TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?"
                        r"[+-][0-9]{2}(:[0-9]{2}){0,2}")


def seg(text: str) -> str:
    """One path segment, percent-encoded whole (`/` included)."""
    return urllib.parse.quote(text, safe="")


def encoded_path(path: str, raw_path: bytes | None) -> str:
    """The request path with each segment percent-encoded whole, from the raw path (where a
    `%2F` is still told apart from a `/`); `path` itself when there is no raw path that agrees."""
    if raw_path is None:
        return "/".join(seg(part) for part in path.split("/"))
    parts = raw_path.split(b"/")
    decoded = [urllib.parse.unquote_to_bytes(part) for part in parts]
    if b"/".join(decoded).decode("utf-8", "replace") != path:
        return "/".join(seg(part) for part in path.split("/"))
    return "/".join(urllib.parse.quote(part, safe="") for part in decoded)


def segment(value: str, field: str) -> str:
    """A path segment matched on the encoded path, decoded back to its text."""
    return text(urllib.parse.unquote(value), field)


def text(value: str, field: str) -> str:
    if "\x00" in value:
        raise ValueError(f"{field} must not contain NUL")
    if len(value) > MAX_TEXT:
        raise ValueError(f"{field} is longer than {MAX_TEXT} characters")
    return value


def check_all(items: Iterable[tuple[str, str]]) -> None:
    """Every (field, value) a request brings is text (see `text`)."""
    for field, value in items:
        text(value, field)


def epoch(value: str | None, field: str = "before") -> int | None:
    """A run epoch: a positive int64 written in digits, or None when absent."""
    if not value:
        return None
    if not _EPOCH.fullmatch(value) or not 0 < int(value) <= INT64_MAX:
        raise ValueError(f"{field} must be a positive integer below 2**63")
    return int(value)


def cursor(value: str | None) -> tuple[int | None, str, str] | None:
    """A rows page's `after` cursor `[input_index, created, key]`, or None when absent."""
    if not value:
        return None
    try:
        index, created, key = json.loads(value)
    except (TypeError, ValueError):
        raise ValueError("after must be [input_index, created, key]") from None
    if index is not None and not is_int(index, 0, INT64_MAX):
        raise ValueError("after: the input index must be an integer from 0 to 2**63 - 1")
    if not isinstance(created, str) or not _TIMESTAMP.fullmatch(created) \
            or not _timestamp(created):
        raise ValueError("after: created must be a timestamp as the console wrote it")
    if not isinstance(key, str):
        raise ValueError("after: the key must be text")
    return index, created, text(key, "after: the key")


def _timestamp(value: str) -> bool:
    try:
        datetime.datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def query_items(params: QueryParams) -> list[tuple[str, str]]:
    return [(name, value) for name, value in params.multi_items()]
