"""Error messages grouped by cause: one cause whose message names the row's value is one line.

How it works
- `error_pattern(message)` masks what varies from row to row and keeps what names the cause:
  quoted values become `'…'`, UUIDs `<id>`, long hex strings (row keys, digests) `<key>`,
  and every run of digits `N` (so `no data for r13` and `no data for r7` are both
  `no data for rN`). A message that is one quoted string as a whole (a `KeyError`'s, its key)
  is masked inside its quotes only. A message that starts with an exception type (`ValueError: ...`) keeps it,
  so two types with one text stay apart.
- `group_errors(counts)` folds (message, count) pairs into causes: the messages of one pattern,
  their total count, how many distinct messages it stands for and one example (the commonest
  message), commonest cause first. It is pure: the command line reads the distinct messages
  with their counts (`engine.sheets.error_counts`, up to `MESSAGES_READ` of them) and groups
  them here.
"""

from __future__ import annotations

import re
from typing import Iterable

import attrs

MESSAGES_READ = 2000

_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_HEX = re.compile(r"\b(?:0x)?[0-9a-fA-F]{16,}\b")
_DIGITS = re.compile(r"\d+")


def _quoted(match: re.Match) -> str:
    quote = match.group(0)[0]
    return f"{quote}…{quote}"


def error_pattern(message: str | None) -> str:
    """`message` with its row-specific parts masked (see the module docstring)."""
    if message is None:
        return "(no message)"
    whole = _QUOTED.fullmatch(message)
    if whole is not None and len(message) >= 2:  # a KeyError's message is its quoted key
        return message[0] + error_pattern(message[1:-1]) + message[-1]
    text = _QUOTED.sub(_quoted, message)
    text = _UUID.sub("<id>", text)
    text = _HEX.sub("<key>", text)
    return _DIGITS.sub("N", text)


@attrs.frozen
class ErrorCause:
    pattern: str
    count: int
    variants: int
    example: str | None


def group_errors(counts: Iterable[tuple[str | None, int]]) -> list[ErrorCause]:
    """(message, count) pairs folded by pattern, commonest cause first (then by pattern)."""
    groups: dict[str, list] = {}
    for message, count in counts:
        pattern = error_pattern(message)
        group = groups.setdefault(pattern, [0, 0, message, -1])
        group[0] += count
        group[1] += 1
        if count > group[3]:  # the commonest message is the example
            group[2], group[3] = message, count
    causes = [ErrorCause(pattern, total, variants, example)
              for pattern, (total, variants, example, _) in groups.items()]
    return sorted(causes, key=lambda cause: (-cause.count, cause.pattern))
