"""Array-input values and their wire codecs: occurrences, pages, manifests; pure, no I/O.

How it works
- An `Occurrence` is one element of a map's array source: an object of user data and an
  optional `SourceIdentity` (which dataset row it came from). Values validate themselves when
  built, so an invalid one cannot exist; `as_occurrence` accepts a bare dict as an occurrence
  without identity.
- The codecs (`OCCURRENCE`, `MANIFEST`, `PAGE`, ...) are how these values travel as action
  arguments and results (`engine.actions`).

`engine.array_input.pages` re-exports every name here; import them from there.
"""

from __future__ import annotations

import re
from typing import Literal

import attrs

from ..values.codecs import BOOL, INT, STR, USER_JSON, Codec, list_of, optional, record
from ..errors import InvalidInputError

MAX_PAGE_ROWS = 1000
MAX_PAGE_BYTES = 1024 * 1024
RETIRE_BATCH_ROWS = 128
MAX_SAFE_INTEGER = 2**53 - 1
SEAL_BATCH_SIZES = (1, 4, 8)

PAGE_KIND = "array_input_page"
FINGERPRINT_PATTERN = re.compile(r"[0-9a-f]{64}")


# -- validation --------------------------------------------------------------------------------


def check_count(value: object, name: str) -> int:
    """A non-negative safe integer (JSON numbers beyond 2**53 - 1 lose precision elsewhere)."""
    if type(value) is not int or not 0 <= value <= MAX_SAFE_INTEGER:
        raise InvalidInputError(f"{name} must be an integer from 0 to 2**53 - 1, got {value!r}")
    return value


def check_fingerprint(value: object, name: str = "source_fingerprint") -> str:
    if not isinstance(value, str) or FINGERPRINT_PATTERN.fullmatch(value) is None:
        raise InvalidInputError(f"{name} must be 64 lowercase hex digits (SHA-256), got {value!r}")
    return value


def _dataset_id(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"source_identity.dataset_id must be a non-empty string, got {value!r}")


def _row_index(instance: object, attribute: attrs.Attribute, value: object) -> None:
    check_count(value, "source_identity.row_index")


@attrs.frozen
class SourceIdentity:
    """Where an occurrence came from: a dataset and the row's index in it."""

    dataset_id: str = attrs.field(validator=_dataset_id)
    row_index: int = attrs.field(validator=_row_index)


def _source_identity(value: object) -> SourceIdentity | None:
    if value is None or isinstance(value, SourceIdentity):
        return value
    if isinstance(value, dict) and set(value) == {"dataset_id", "row_index"}:
        return SourceIdentity(value["dataset_id"], value["row_index"])
    raise InvalidInputError(f"source_identity must be a SourceIdentity or None, got {value!r}")


def _data(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, dict):
        raise InvalidInputError(f"occurrence data must be an object (dict), got {type(value).__name__}")


@attrs.frozen
class Occurrence:
    """One element of an array source: user data (an object) and its optional source identity."""

    data: dict = attrs.field(validator=_data)
    source_identity: SourceIdentity | None = attrs.field(default=None, converter=_source_identity)


@attrs.frozen
class PageDraft:
    """A page of a source as `paginate` cut it: `rows` are occurrences `offset…offset+len-1`."""

    ordinal: int
    offset: int
    rows: tuple[Occurrence, ...] = attrs.field(converter=tuple)


@attrs.frozen
class Page:
    """A sealed page as read back and verified."""

    offset: int
    rows: tuple[Occurrence, ...] = attrs.field(converter=tuple)


@attrs.frozen
class Manifest:
    """What is staged for one map: nothing, a begun source, or a sealed one of `page_count` pages."""

    state: Literal["absent", "staging", "sealed"]
    source_fingerprint: str | None = None
    source_rows: int | None = None
    has_source_identities: bool | None = None
    page_count: int | None = None


@attrs.frozen
class RetireResult:
    """One retirement batch: `deleted` facts removed; `done` once no begin/page/seal fact is left;
    `settled` when the batch also settled the run's outbox entry as done (`retire_entry`)."""

    done: bool
    deleted: int
    settled: bool = False


# What `retire_entry` recording the entry answers when it finds the entry done already (someone
# else retired the run): nothing left, nothing deleted, settled.
DONE_ALREADY = RetireResult(True, 0, True)


# -- wire codecs (engine.actions) ----------------------------------------------------------------


def _encode_occurrence(value: object, path: str) -> dict:
    occurrence = as_occurrence(value, path)
    row = {"data": USER_JSON.encode(occurrence.data, f"{path}.data")}
    identity = occurrence.source_identity
    if identity is not None:
        row["source_identity"] = {"dataset_id": identity.dataset_id, "row_index": identity.row_index}
    return row


def _decode_occurrence(value: object, path: str) -> Occurrence:
    if type(value) is not dict or not set(value) <= {"data", "source_identity"} or "data" not in value:
        raise InvalidInputError(f"{path} must be an object with data (and source_identity)")
    return Occurrence(value["data"], value.get("source_identity"))


OCCURRENCE = Codec("occurrence", _encode_occurrence, _decode_occurrence)
OCCURRENCES = list_of(OCCURRENCE)
MANIFEST = record(Manifest, state=STR, source_fingerprint=optional(STR), source_rows=optional(INT),
                  has_source_identities=optional(BOOL), page_count=optional(INT))
PAGE = record(Page, offset=INT, rows=list_of(OCCURRENCE, as_tuple=True))
RETIRE_RESULT = record(RetireResult, done=BOOL, deleted=INT, settled=BOOL)


def as_occurrence(value: object, path: str) -> Occurrence:
    """Accept an `Occurrence`, or a bare dict as an occurrence of that data without identity."""
    if isinstance(value, Occurrence):
        return value
    if isinstance(value, dict):
        return Occurrence(value)
    raise InvalidInputError(f"{path} must be an Occurrence or a dict, got {type(value).__name__}")
