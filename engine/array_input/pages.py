"""Array-input page encoding: stored forms, fingerprints, pagination, page facts; pure, no I/O.

How it works
- The values (`Occurrence`, `Page`, `Manifest`, ...) and their codecs live in
  `array_input.values` and are re-exported here. An occurrence's stored form is
  `{"data": {...}}` plus `"source_identity": {"dataset_id", "row_index"}` when present, after
  `canonical.normalize`, i.e. exactly what `jsonb` hands back.
- `source_fingerprint` hashes the stored forms one occurrence at a time (canonical text, then a
  newline, which canonical text never contains), so a source of any size is fingerprinted
  without ever building one string of it.
- `paginate` cuts a source into `PageDraft`s of 1–`MAX_PAGE_ROWS` occurrences whose stored page
  fact stays within `MAX_PAGE_BYTES` of canonical JSON; sizes are computed exactly from each
  row's canonical text, without building the page.
- `encode_page` builds a page fact's canonical text and digest; `verify_page` checks a decoded
  stored fact against what a caller expects and recomputes its digest. Both encode the rows
  once: the digest envelope `{offset, ordinal, rows, source_fingerprint}` and the fact
  `{digest, kind, offset, ordinal, row_count, rows, source_fingerprint}` are assembled around
  the same canonical rows text, in sorted-key order, so they equal `stable_dumps` of the dicts.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Sequence

import attrs

from .. import canonical
from ..values.codecs import Codec
from ..errors import CorruptFactError, InvalidInputError
from .values import (
    MAX_PAGE_BYTES, MAX_PAGE_ROWS, MAX_SAFE_INTEGER, PAGE_KIND, Occurrence, PageDraft,
    SourceIdentity, _decode_occurrence, as_occurrence, check_fingerprint,
)


# -- stored forms ------------------------------------------------------------------------------


def stored_row(occurrence: Occurrence, path: str) -> dict:
    """The occurrence exactly as jsonb stores it (raises `InvalidInputError` naming the path)."""
    row = {"data": canonical.normalize(occurrence.data, f"{path}.data")}
    identity = occurrence.source_identity
    if identity is not None:
        row["source_identity"] = {
            "dataset_id": canonical.normalize(identity.dataset_id, f"{path}.source_identity.dataset_id"),
            "row_index": identity.row_index,
        }
    return row


# The fast path. `canonical.normalize` rebuilds every value in Python; most rows are already
# normalized, and proving that is cheaper: `canonical.is_canonical(data, False)` walks the
# containers checking everything but the two string rules, sharing the caller's objects instead
# of copying them. The string rules (no NUL, no lone surrogate) are checked once on the encoded
# text of a whole row or page: the encoder escapes NUL as \u0000 and a lone surrogate makes
# UTF-8 encoding fail. Anything unusual falls back to `normalize`, so the stored text is always
# exactly `stable_dumps(normalize(...))`.
_ESCAPED_NUL = b"\\u0000"


def _plain_row(occurrence: Occurrence) -> dict | None:
    """The stored form sharing the occurrence's objects, or None when it needs `normalize`."""
    if not canonical.is_canonical(occurrence.data, False):
        return None
    identity = occurrence.source_identity
    if identity is None:
        return {"data": occurrence.data}
    if type(identity.dataset_id) is not str:
        return None
    return {"data": occurrence.data,
            "source_identity": {"dataset_id": identity.dataset_id, "row_index": identity.row_index}}


def _encoded(text: str) -> bytes | None:
    """UTF-8 of canonical text, or None when a string in it breaks a jsonb rule."""
    try:
        encoded = text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return None
    # Searching one byte is a memchr; most pages hold no backslash at all.
    if b"\\" in encoded and _ESCAPED_NUL in encoded:
        return None
    return encoded


def canonical_row(occurrence: Occurrence, path: str) -> bytes:
    """The UTF-8 canonical text of one occurrence's stored form."""
    plain = _plain_row(occurrence)
    if plain is not None:
        encoded = _encoded(canonical.stable_dumps(plain))
        if encoded is not None:
            return encoded
    return canonical.stable_dumps(stored_row(occurrence, path)).encode()


def canonical_rows(rows: Sequence[Occurrence]) -> tuple[str, bytes]:
    """Canonical text (and its UTF-8) of a page's stored rows, normalizing only when needed."""
    stored = []
    for index, occurrence in enumerate(rows):
        plain = _plain_row(occurrence)
        stored.append(plain if plain is not None else stored_row(occurrence, f"rows[{index}]"))
    text = canonical.stable_dumps(stored)
    encoded = _encoded(text)
    if encoded is None:
        stored = [stored_row(occurrence, f"rows[{i}]") for i, occurrence in enumerate(rows)]
        text = canonical.stable_dumps(stored)
        encoded = text.encode()
    return text, encoded


def source_fingerprint(occurrences: Iterable[Occurrence | dict]) -> str:
    """SHA-256 hex of the source, hashed incrementally one occurrence at a time."""
    hasher = hashlib.sha256()
    for index, value in enumerate(occurrences):
        path = f"occurrences[{index}]"
        hasher.update(canonical_row(as_occurrence(value, path), path))
        hasher.update(b"\n")
    return hasher.hexdigest()


def fact_overhead(ordinal: int, offset: int, row_count: int) -> int:
    """Bytes of a page fact's canonical text outside its rows' own texts and separators."""
    head = f'{{"digest":"{"0" * 64}","kind":"{PAGE_KIND}","offset":{offset},"ordinal":{ordinal},' \
           f'"row_count":{row_count},"rows":[],"source_fingerprint":"{"0" * 64}"}}'
    return len(head)


def paginate(occurrences: Iterable[Occurrence | dict]) -> list[PageDraft]:
    """Cut a source into page drafts within both limits (rows and canonical bytes per page)."""
    pages: list[PageDraft] = []
    current: list[Occurrence] = []
    current_bytes = 0  # rows' canonical bytes plus the commas between them
    offset = 0

    def flush() -> None:
        nonlocal current, current_bytes, offset
        pages.append(PageDraft(len(pages), offset, current))
        offset += len(current)
        current, current_bytes = [], 0

    for index, value in enumerate(occurrences):
        path = f"occurrences[{index}]"
        occurrence = as_occurrence(value, path)
        size = len(canonical_row(occurrence, path))
        if current and (
            len(current) >= MAX_PAGE_ROWS
            or fact_overhead(len(pages), offset, len(current) + 1) + current_bytes + 1 + size
            > MAX_PAGE_BYTES
        ):
            flush()
        if not current and fact_overhead(len(pages), offset, 1) + size > MAX_PAGE_BYTES:
            raise InvalidInputError(
                f"{path} alone needs {size} bytes of canonical JSON; a page fact holds at most "
                f"{MAX_PAGE_BYTES} bytes"
            )
        current_bytes += size + (1 if current else 0)
        current.append(occurrence)
    if current:
        flush()
    return pages


# -- page facts --------------------------------------------------------------------------------


@attrs.frozen
class EncodedPage:
    """A page fact as this module encodes it: canonical text, digest and row count."""

    text: str  # the page fact's canonical JSON, as stored
    digest: str
    row_count: int

    def is_page(self, source_fingerprint: str, ordinal: int, offset: int) -> bool:
        """Whether the fact's header names this page (canonical text has one exact shape)."""
        head = (f'{{"digest":"{self.digest}","kind":"{PAGE_KIND}","offset":{offset},'
                f'"ordinal":{ordinal},"row_count":{self.row_count},"rows":[')
        return self.text.startswith(head) and self.text.endswith(
            f'],"source_fingerprint":"{source_fingerprint}"}}')


def _envelope_parts(source_fingerprint: str, ordinal: int, offset: int) -> tuple[bytes, bytes]:
    head = f'{{"offset":{offset},"ordinal":{ordinal},"rows":'
    tail = f',"source_fingerprint":"{source_fingerprint}"}}'
    return head.encode(), tail.encode()


def page_digest(source_fingerprint: str, ordinal: int, offset: int, rows_utf8: bytes) -> str:
    """SHA-256 of the canonical `{source_fingerprint, ordinal, offset, rows}`, hashed in parts."""
    head, tail = _envelope_parts(source_fingerprint, ordinal, offset)
    hasher = hashlib.sha256(head)
    hasher.update(rows_utf8)
    hasher.update(tail)
    return hasher.hexdigest()


def encode_page(
    source_fingerprint: str, ordinal: int, offset: int, rows: Sequence[Occurrence | dict]
) -> EncodedPage:
    """Validate and encode a page; `InvalidInputError` for bad rows or a fact over the limit."""
    if not isinstance(rows, (list, tuple)) or not 1 <= len(rows) <= MAX_PAGE_ROWS:
        count = len(rows) if isinstance(rows, (list, tuple)) else type(rows).__name__
        raise InvalidInputError(f"rows must be a list of 1 to {MAX_PAGE_ROWS} occurrences, got {count}")
    occurrences = [as_occurrence(row, f"rows[{i}]") for i, row in enumerate(rows)]
    rows_text, rows_utf8 = canonical_rows(occurrences)
    digest = page_digest(source_fingerprint, ordinal, offset, rows_utf8)
    head = (f'{{"digest":"{digest}","kind":"{PAGE_KIND}","offset":{offset},"ordinal":{ordinal},'
            f'"row_count":{len(occurrences)},"rows":')
    tail = f',"source_fingerprint":"{source_fingerprint}"}}'
    size = len(head) + len(rows_utf8) + len(tail)  # head and tail are ASCII
    if size > MAX_PAGE_BYTES:
        raise InvalidInputError(
            f"rows: the page fact needs {size} bytes of canonical JSON; the limit is {MAX_PAGE_BYTES}"
        )
    return EncodedPage(head + rows_text + tail, digest, len(occurrences))


def _encode_encoded_page(value: object, path: str) -> dict:
    if not isinstance(value, EncodedPage):
        raise InvalidInputError(f"{path} must be an EncodedPage")
    return {"text": value.text, "digest": value.digest, "row_count": value.row_count}


def _decode_encoded_page(value: object, path: str) -> EncodedPage:
    """An encoded page from the wire is re-encoded from its rows (as `put_page` encodes rows)
    and must come out identical, so the store only ever receives this module's encoding."""
    if type(value) is not dict or value.keys() != {"text", "digest", "row_count"} \
            or type(value["text"]) is not str:
        raise InvalidInputError(f"{path} must be an object with text, digest and row_count")
    try:
        fact = json.loads(value["text"])
    except ValueError as exc:
        raise InvalidInputError(f"{path}.text is not JSON") from exc
    if type(fact) is not dict or fact.keys() != _PAGE_FIELDS \
            or not is_count(fact["ordinal"]) or not is_count(fact["offset"]) \
            or type(fact["rows"]) is not list or type(fact["source_fingerprint"]) is not str:
        raise InvalidInputError(f"{path}.text is not a page fact")
    check_fingerprint(fact["source_fingerprint"], f"{path}.text.source_fingerprint")
    page = encode_page(fact["source_fingerprint"], fact["ordinal"], fact["offset"],
                       [_decode_occurrence(row, f"{path}.text.rows[{i}]")
                        for i, row in enumerate(fact["rows"])])
    if (page.text, page.digest, page.row_count) != (value["text"], value["digest"], value["row_count"]):
        raise InvalidInputError(f"{path} is not the canonical encoding of its rows")
    return page


ENCODED_PAGE = Codec("encoded page", _encode_encoded_page, _decode_encoded_page)


_PAGE_FIELDS = frozenset({"kind", "source_fingerprint", "ordinal", "offset", "row_count", "rows", "digest"})


def is_count(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_SAFE_INTEGER


def _trusted(cls, **fields):
    """Build a frozen value whose fields were already checked (stored rows after their shape
    check), skipping the validators: replaying a page builds a thousand of these."""
    value = object.__new__(cls)
    for name, field_value in fields.items():
        object.__setattr__(value, name, field_value)
    return value


def decode_rows(rows: list, where: str, *, build: bool = True) -> tuple[list[Occurrence], bool]:
    """Stored rows → occurrences (when `build`) and whether any carries a source identity;
    `CorruptFactError` for a malformed row. Rows come from `json.loads`, so types are exact."""
    occurrences = []
    append = occurrences.append
    any_identity = False
    for row in rows:
        if type(row) is not dict:
            raise CorruptFactError(f"{where}: a stored row is not an object")
        data = row.get("data")
        if type(data) is not dict:
            raise CorruptFactError(f"{where}: a stored row's data is not an object")
        if len(row) == 1:
            if build:
                append(_trusted(Occurrence, data=data, source_identity=None))
            continue
        identity = row.get("source_identity")
        if len(row) != 2 or type(identity) is not dict or len(identity) != 2:
            raise CorruptFactError(f"{where}: a stored row has unexpected fields")
        dataset_id = identity.get("dataset_id")
        row_index = identity.get("row_index")
        if type(dataset_id) is not str or not dataset_id or type(row_index) is not int \
                or not 0 <= row_index <= MAX_SAFE_INTEGER:
            raise CorruptFactError(f"{where}: a stored source identity is corrupt")
        any_identity = True
        if build:
            append(_trusted(Occurrence, data=data, source_identity=_trusted(
                SourceIdentity, dataset_id=dataset_id, row_index=row_index)))
    return occurrences, any_identity


@attrs.frozen
class VerifiedPage:
    offset: int
    rows: list[Occurrence]
    row_count: int
    digest: str
    has_source_identities: bool


def verify_page(
    fact: object, *, source_fingerprint: str, ordinal: int, offset: int | None = None,
    build: bool = True,
) -> VerifiedPage:
    """Check a decoded page fact's header and recompute its digest; `CorruptFactError` if not.

    `offset=None` accepts the stored offset (a reader); a sealer passes the offset the previous
    pages imply, so gaps and overlaps are caught. `build=False` (a sealer) checks the rows
    without building `Occurrence`s.
    """
    where = f"array input page {ordinal}"
    if type(fact) is not dict or fact.keys() != _PAGE_FIELDS or fact["kind"] != PAGE_KIND:
        raise CorruptFactError(f"{where} is missing or malformed")
    rows, row_count = fact["rows"], fact["row_count"]
    if (
        fact["source_fingerprint"] != source_fingerprint
        or fact["ordinal"] != ordinal
        or type(fact["ordinal"]) is not int
        or not is_count(fact["offset"])
        or (offset is not None and fact["offset"] != offset)
        or type(rows) is not list
        or type(row_count) is not int
        or not 1 <= row_count <= MAX_PAGE_ROWS
        or len(rows) != row_count
        or type(fact["digest"]) is not str
    ):
        raise CorruptFactError(f"{where} does not match the source (missing, misordered or altered)")
    try:  # decoded jsonb holds no NUL and no lone surrogate; a forged fact might
        rows_utf8 = canonical.stable_dumps(rows).encode()
    except UnicodeEncodeError as exc:
        raise CorruptFactError(f"{where} holds a string jsonb cannot store") from exc
    digest = page_digest(source_fingerprint, ordinal, fact["offset"], rows_utf8)
    if digest != fact["digest"]:
        raise CorruptFactError(f"{where} fails its digest check")
    occurrences, any_identity = decode_rows(rows, where, build=build)
    return VerifiedPage(fact["offset"], occurrences, row_count, digest, any_identity)
