"""A whole list source encoded once: what staging, admission and replay all need, from one pass.

How it works
- `encode_source(items)` walks the source once. Each item (an `Occurrence`, or a bare dict as
  an occurrence without identity) has its data normalized (`canonical.normalize_fast`; a copy is
  kept, never the caller's dict) and encoded to canonical text exactly once. Everything else is
  assembled from those texts without encoding again:
    * the stored form of an occurrence is `{"data":<text>}` (plus `,"source_identity":{...}` —
      keys in sorted order), so its canonical text is a concatenation;
    * the source fingerprint hashes those texts, each followed by a newline, one at a time
      (equal to `source_fingerprint`);
    * page cuts follow the same rule as `paginate` (≤ `MAX_PAGE_ROWS` rows, ≤ `MAX_PAGE_BYTES`
      of page fact), from the texts' exact UTF-8 sizes;
    * `page(ordinal)` builds one page fact's canonical text and digest on demand (equal to
      `encode_page` of that draft), so a whole source's facts never sit in memory at once.
- `texts[i]` is the canonical text of row `i`'s data — what a sheet's row key hashes — and
  `rows[i]` the normalized data a map function receives: byte-identical to what a page fact of
  this source stores, so running `rows[i]` *is* replaying the staged input.
This module does no I/O.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import attrs

from .. import canonical
from ..errors import InvalidInputError
from .pages import (
    MAX_PAGE_BYTES,
    MAX_PAGE_ROWS,
    PAGE_KIND,
    EncodedPage,
    Occurrence,
    PageDraft,
    fact_overhead,
    page_digest,
)


@attrs.frozen
class EncodedSource:
    """A list source after one encoding pass (see the module docstring)."""

    fingerprint: str
    rows: list[dict] = attrs.field(repr=False)
    texts: list[str] = attrs.field(repr=False)
    identities: list[str | None] = attrs.field(repr=False)
    cuts: tuple[tuple[int, int], ...]  # (offset, row_count) of each page
    has_source_identities: bool

    @property
    def source_rows(self) -> int:
        return len(self.rows)

    @property
    def page_count(self) -> int:
        return len(self.cuts)

    def _stored_texts(self, offset: int, count: int) -> list[str]:
        texts, identities = self.texts, self.identities
        return [
            f'{{"data":{texts[i]}}}' if identities[i] is None
            else f'{{"data":{texts[i]},"source_identity":{identities[i]}}}'
            for i in range(offset, offset + count)
        ]

    def page(self, ordinal: int) -> EncodedPage:
        """Page `ordinal`'s fact: its canonical text and digest (as `encode_page` makes them)."""
        offset, count = self.cuts[ordinal]
        rows_text = "[" + ",".join(self._stored_texts(offset, count)) + "]"
        rows_utf8 = rows_text.encode()
        digest = page_digest(self.fingerprint, ordinal, offset, rows_utf8)
        head = (f'{{"digest":"{digest}","kind":"{PAGE_KIND}","offset":{offset},'
                f'"ordinal":{ordinal},"row_count":{count},"rows":')
        tail = f',"source_fingerprint":"{self.fingerprint}"}}'
        return EncodedPage(head + rows_text + tail, digest, count)

    def draft(self, ordinal: int) -> PageDraft:
        """Page `ordinal` as occurrences (for callers of the public `put_page`)."""
        offset, count = self.cuts[ordinal]
        return PageDraft(ordinal, offset, [
            Occurrence(self.rows[i], None if self.identities[i] is None else
                       canonical.loads(self.identities[i]))
            for i in range(offset, offset + count)
        ])


def _identity_text(occurrence: Occurrence, path: str) -> str | None:
    identity = occurrence.source_identity
    if identity is None:
        return None
    dataset_id = identity.dataset_id
    if not canonical.is_clean_str(dataset_id):
        dataset_id = canonical.normalize(dataset_id, f"{path}.source_identity.dataset_id")
    return canonical.stable_dumps({"dataset_id": dataset_id, "row_index": identity.row_index})


def encode_source(items: Sequence[Occurrence | dict]) -> EncodedSource:
    """Encode a list source once; `InvalidInputError` naming the item for anything malformed or
    a row that alone exceeds a page.

    The hot path per row: one canonical check, one copy, one encoding; the page's bytes limit
    is checked against a bound of the fact's overhead fixed per page (the exact overhead is
    computed only for a row near the limit), and the fingerprint hashes a page's rows at once.
    """
    if not isinstance(items, (list, tuple)):
        raise InvalidInputError(f"a list source must be a list, got {type(items).__name__}")
    hasher = hashlib.sha256()
    rows: list[dict] = []
    texts: list[str] = []
    identities: list[str | None] = []
    cuts: list[tuple[int, int]] = []
    page: list[bytes] = []  # the stored rows of the page being cut
    offset = size = 0  # the page being cut: first row, rows' bytes + commas
    room = MAX_PAGE_BYTES - fact_overhead(0, 0, MAX_PAGE_ROWS)  # for rows, whatever the count
    dumps = canonical.stable_dumps
    is_canonical = canonical.is_canonical

    def cut() -> None:
        nonlocal offset, size, room, page
        hasher.update(b"\n".join(page) + b"\n")
        cuts.append((offset, len(page)))
        offset, size, page = offset + len(page), 0, []
        room = MAX_PAGE_BYTES - fact_overhead(len(cuts), offset, MAX_PAGE_ROWS)

    for index, item in enumerate(items):
        if type(item) is dict:
            data, identity = item, None
        elif isinstance(item, Occurrence):
            data, identity = item.data, _identity_text(item, f"rows[{index}]")
        elif isinstance(item, dict):
            data, identity = item, None
        else:
            raise InvalidInputError(
                f"rows[{index}] must be a dict or an Occurrence, got {type(item).__name__}"
            )
        clean = dict(data) if is_canonical(data) else canonical.normalize_fast(
            data, f"rows[{index}].data")
        text = dumps(clean)
        stored = (f'{{"data":{text}}}' if identity is None else
                  f'{{"data":{text},"source_identity":{identity}}}').encode()
        row_bytes = len(stored)
        count = len(page)
        if count and (count >= MAX_PAGE_ROWS or size + 1 + row_bytes > room and fact_overhead(
                len(cuts), offset, count + 1) + size + 1 + row_bytes > MAX_PAGE_BYTES):
            cut()
            count = 0
        if not count and row_bytes > room and \
                fact_overhead(len(cuts), offset, 1) + row_bytes > MAX_PAGE_BYTES:
            raise InvalidInputError(
                f"rows[{index}] alone needs {row_bytes} bytes of canonical JSON; a page fact "
                f"holds at most {MAX_PAGE_BYTES} bytes"
            )
        size += row_bytes + (1 if count else 0)
        page.append(stored)
        rows.append(clean)
        texts.append(text)
        identities.append(identity)
    if page:
        cut()
    return EncodedSource(hasher.hexdigest(), rows, texts, identities, tuple(cuts),
                         any(identity is not None for identity in identities))
