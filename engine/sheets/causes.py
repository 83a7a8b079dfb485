"""A failed row's cause: its error message with what varies from row to row masked.

How it works
- `cause_of(message, inputs)` keeps the words that name what went wrong and masks the rest:
  every whole token (not inside a longer word) equal to one of the row's own input values
  (the `str` of each input scalar with at least `MIN_INPUT_CHARS` characters and a letter)
  becomes `<field>`, quoted values `'…'`, UUIDs `<id>`, long hex strings (row keys, digests)
  `<key>`, and every run of digits `N`. So `quota exceeded for BGR` with input `iata = "BGR"`
  and `quota exceeded for LAX` with `iata = "LAX"` are one cause, `quota exceeded for <iata>`;
  `no data for r13` and `no data for r7` are `no data for rN`. One scan, left to right, the
  input values tried first at each position: a mask is never masked again.
- Values shorter than `MIN_INPUT_CHARS`, or with no letter (numbers, dates: the digit rule
  masks them anyway, with one placeholder whatever the row), are not matched as inputs, so a
  short value does not eat the words of a message.
- A message that is one quoted string as a whole (a `KeyError`'s: its key) is masked inside
  its quotes only, so a missing key stays the cause unless it is the row's own value. A
  message that starts with an exception type (`ValueError: ...`) keeps it.
- A cause is at most `MAX_CAUSE_BYTES` of UTF-8 (cut at a character): the sheet indexes it
  beside the row's key (`layout.CAUSE_INDEX_COLUMNS`), and a b-tree entry is bounded.
- The cause is computed once, where a failed outcome is built (`actors.workers`, which has the
  row's inputs) and stored with the row as `_cause`; a failed row from before that column, or
  an outcome sent without a cause, gets `cause_of(message)` (no inputs) — the same rule, from
  the message alone.
- `group_causes(counts)` folds `CauseCount`s (a stored cause, or a message whose cause was not
  stored, with its rows) into `ErrorCause`s: the rows of one cause, how many distinct
  messages it stands for and one example message (the commonest), commonest cause first.

This module does no I/O: the readers (`sheets.audit`, the console) count in SQL and fold here.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import attrs

from ..canonical import JsonValue

MIN_INPUT_CHARS = 3
MAX_CAUSE_BYTES = 512
NO_MESSAGE = "(no message)"

_QUOTED = r"'[^']*'|\"[^\"]*\"|`[^`]*`"
_GENERIC = (
    rf"(?P<quoted>{_QUOTED})"
    r"|(?P<uuid>\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b)"
    r"|(?P<hex>\b(?:0x)?[0-9a-fA-F]{16,}\b)"
    r"|(?P<digits>\d+)"
)
_GENERIC_ONLY = re.compile(_GENERIC)
_WHOLE_QUOTED = re.compile(_QUOTED)
_LETTER = re.compile(r"[^\W\d_]")
_SCALARS = (str, int, float, bool)


def _input_values(inputs: Mapping[str, JsonValue] | None) -> dict[str, str]:
    """The maskable string forms of the row's input scalars -> the field each one names
    (the first field in the row's order when two fields hold one value)."""
    found: dict[str, str] = {}
    for field, value in (inputs or {}).items():
        if not isinstance(value, _SCALARS) or value is None:
            continue
        text = str(value)
        if len(text) >= MIN_INPUT_CHARS and _LETTER.search(text) and text not in found:
            found[text] = str(field)
    return found


def _pattern(values: dict[str, str]) -> re.Pattern[str]:
    if not values:
        return _GENERIC_ONLY
    longest_first = sorted(values, key=lambda text: (-len(text), text))
    alternatives = "|".join(re.escape(text) for text in longest_first)
    return re.compile(rf"(?P<input>(?<!\w)(?:{alternatives})(?!\w))|{_GENERIC}")


def _mask(text: str, values: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        kind = match.lastgroup
        if kind == "input":
            return f"<{values[match.group(0)]}>"
        if kind == "quoted":
            quote = match.group(0)[0]
            return f"{quote}…{quote}"
        return {"uuid": "<id>", "hex": "<key>", "digits": "N"}[kind]

    return _pattern(values).sub(replace, text)


def bound_cause(cause: str) -> str:
    """`cause` cut to at most `MAX_CAUSE_BYTES` of UTF-8, at a character."""
    if len(cause) * 4 <= MAX_CAUSE_BYTES:
        return cause
    return cause.encode("utf-8")[:MAX_CAUSE_BYTES].decode("utf-8", "ignore")


def cause_of(message: str | None, inputs: Mapping[str, JsonValue] | None = None) -> str:
    """`message` with its row-specific parts masked (see the module docstring); `inputs` are
    the row's input fields (field -> value) as the function was given them."""
    if message is None:
        return NO_MESSAGE
    values = _input_values(inputs)
    if len(message) >= 2 and _WHOLE_QUOTED.fullmatch(message):  # a KeyError's: its key
        return bound_cause(message[0] + _mask(message[1:-1], values) + message[-1])
    return bound_cause(_mask(message, values))


@attrs.frozen
class CauseCount:
    """Failed rows counted together: those of one stored `cause`, or (`cause` None: rows
    failed before causes were stored) those of one `message`."""

    cause: str | None
    message: str | None
    count: int
    variants: int = 1          # distinct messages among the rows
    example: str | None = None  # their commonest message (`message` when cause is None)


@attrs.frozen
class ErrorCause:
    """One cause of failures: its rows, the distinct messages it stands for, one example (the
    commonest message)."""

    pattern: str
    count: int
    variants: int
    example: str | None


def group_causes(counts: Iterable[CauseCount]) -> list[ErrorCause]:
    """`counts` folded by cause, commonest cause first (then by cause). A count without a
    stored cause takes its message's (`cause_of(message)`)."""
    # cause -> (count, variants, example, the example's own count)
    groups: dict[str, tuple[int, int, str | None, int]] = {}
    for one in counts:
        if one.cause is not None:
            cause, example = one.cause, one.example
        else:
            cause, example = cause_of(one.message), one.message
        total, variants, shown, top = groups.get(cause, (0, 0, example, -1))
        if one.count > top:  # the commonest message is the example
            shown, top = example, one.count
        groups[cause] = (total + one.count, variants + one.variants, shown, top)
    causes = [ErrorCause(cause, total, variants, example)
              for cause, (total, variants, example, _) in groups.items()]
    return sorted(causes, key=lambda cause: (-cause.count, cause.pattern))
