"""One encoding pass over a source's rows, and `EncodedSource`, a list held after its pass.

How it works
- The pass (`encode_pass`) walks the rows once. Each item (an `Occurrence`, or a bare dict as
  an occurrence without identity) has its data normalized (`canonical.normalize_fast`: the
  caller's own dict when it is canonical already, so a list is not held twice) and encoded to
  canonical text exactly once. Everything else is assembled from those texts without encoding
  again:
    * the stored form of an occurrence is `{"data":<text>}` (plus `,"source_identity":{...}` —
      keys in sorted order), so its canonical text is a concatenation;
    * the source fingerprint hashes those texts, each followed by a newline, one at a time
      (equal to `source_fingerprint`);
    * page cuts follow the same rule as `paginate` (≤ `MAX_PAGE_ROWS` rows, ≤ `MAX_PAGE_BYTES`
      of page fact), from the texts' exact UTF-8 sizes;
    * `page(ordinal)` builds one page fact's canonical text and digest on demand (equal to
      `encode_page` of that draft), so a whole source's facts never sit in memory at once.
- `texts[i]` is the canonical text of row `i`'s data — what a sheet's row key hashes — and
  `rows[i]` the normalized data (the caller's dict when it was canonical): equal to what a
  page fact of this source stores, so running it *is* replaying the staged input. What is kept
  stays small beside the list: the texts a page to one zlib-packed bytes object (about an
  eighth of their size; unpacked a page at a time when a span or page fact needs them),
  `rows` the caller's list itself when every item is its own canonical dict, and identities
  only when some row has one. `span(low, high)` gives both for a range of rows, the rows as fresh
  shallow copies (what a map function receives: a function that changes its row never changes
  the caller's list, and only the rows of units in flight are ever copied).
- `scan_source` is the same pass keeping only the `SourceShape` (fingerprint, cuts, and each
  page's digest): what a source too large to hold keeps (`source.PagedSource`).
This module does no I/O.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import zlib
from typing import Iterable, Iterator, Sequence

import attrs

from .. import canonical
from ..errors import InvalidInputError
from .values import MAX_PAGE_BYTES, MAX_PAGE_ROWS, PAGE_KIND, Occurrence, PageDraft
from .pages import EncodedPage, fact_overhead, page_digest


@attrs.frozen
class SourceShape:
    """What one encoding pass over a source keeps: its fingerprint, row count, page cuts
    (`(offset, row_count)` of each page) and whether any row has a source identity."""

    fingerprint: str
    source_rows: int
    cuts: tuple[tuple[int, int], ...]
    has_source_identities: bool
    # SHA-256 of each page's stored rows (as the fingerprint hashes them), from a scan: a page
    # read back later must be these very rows.
    page_digests: tuple[bytes, ...] = ()



def page_fact(fingerprint: str, ordinal: int, offset: int, stored: list[str]) -> EncodedPage:
    """A page fact's canonical text and digest from its rows' stored texts."""
    rows_text = "[" + ",".join(stored) + "]"
    digest = page_digest(fingerprint, ordinal, offset, rows_text.encode())
    head = (f'{{"digest":"{digest}","kind":"{PAGE_KIND}","offset":{offset},'
            f'"ordinal":{ordinal},"row_count":{len(stored)},"rows":')
    tail = f',"source_fingerprint":"{fingerprint}"}}'
    return EncodedPage(head + rows_text + tail, digest, len(stored))


def pack_texts(text: str) -> bytes:
    """A page's row texts (joined by newlines) as kept: UTF-8, zlib-compressed (canonical
    JSON of similar rows packs to about an eighth, at a few ms per 100,000 rows)."""
    return zlib.compress(text.encode(), 1)


def unpack_texts(packed: bytes) -> list[str]:
    """A page's row texts from what `pack_texts` kept."""
    return zlib.decompress(packed).decode().split("\n")


@attrs.frozen
class EncodedSource:
    """A list source after one encoding pass (see the module docstring)."""

    fingerprint: str
    # The normalized rows: the caller's list itself when every item is a canonical dict (no
    # copy of a million pointers), else a list built by the pass.
    rows: Sequence[dict] = attrs.field(repr=False)
    # Each page's row texts joined by newlines (a canonical text holds none), packed
    # (`pack_texts`): one small bytes object a page instead of one string a row.
    packed_texts: list[bytes] = attrs.field(repr=False)
    # Each row's source identity text (None: none), or None when no row has one.
    identities: list[str | None] | None = attrs.field(repr=False)
    cuts: tuple[tuple[int, int], ...]  # (offset, row_count) of each page
    has_source_identities: bool

    @property
    def source_rows(self) -> int:
        return len(self.rows)

    @property
    def page_count(self) -> int:
        return len(self.cuts)

    @property
    def page_texts(self) -> Iterator[str]:
        """Each page's row texts joined by newlines, page by page."""
        return (zlib.decompress(packed).decode() for packed in self.packed_texts)

    @property
    def texts(self) -> list[str]:
        """Every row's canonical text (a new list; `texts_between` takes a range)."""
        return self.texts_between(0, self.source_rows)

    def texts_between(self, low: int, high: int) -> list[str]:
        """The canonical texts of rows `low` to `high - 1`."""
        texts: list[str] = []
        ordinal = max(0, bisect.bisect_right(self.cuts, (low, math.inf)) - 1)
        while low < high and ordinal < len(self.cuts):
            offset, count = self.cuts[ordinal]
            start, stop = low - offset, min(high, offset + count) - offset
            page = unpack_texts(self.packed_texts[ordinal])
            texts += page if start == 0 and stop == count else page[start:stop]
            low, ordinal = offset + stop, ordinal + 1
        return texts

    def stored_texts(self, offset: int, count: int) -> list[str]:
        """The stored form (`{"data":...}`, with its source identity) of rows `offset` to
        `offset + count - 1`."""
        texts = self.texts_between(offset, offset + count)
        identities = self.identities
        if identities is None:
            return [f'{{"data":{text}}}' for text in texts]
        return [
            f'{{"data":{text}}}' if identities[i] is None
            else f'{{"data":{text},"source_identity":{identities[i]}}}'
            for i, text in enumerate(texts, offset)
        ]

    def span(self, low: int, high: int) -> tuple[list[dict], list[str]]:
        """The normalized rows `low` to `high - 1` (fresh shallow copies) and their canonical
        texts."""
        return list(map(dict, self.rows[low:high])), self.texts_between(low, high)

    def page(self, ordinal: int) -> EncodedPage:
        """Page `ordinal`'s fact: its canonical text and digest (as `encode_page` makes them)."""
        offset, count = self.cuts[ordinal]
        return page_fact(self.fingerprint, ordinal, offset, self.stored_texts(offset, count))

    def draft(self, ordinal: int) -> PageDraft:
        """Page `ordinal` as occurrences (for callers of the public `put_page`)."""
        offset, count = self.cuts[ordinal]
        identities = self.identities
        return PageDraft(ordinal, offset, [
            Occurrence(self.rows[i], None if identities is None or identities[i] is None else
                       canonical.loads(identities[i]))
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


def scan_source(items: Iterable[Occurrence | dict]) -> SourceShape:
    """One encoding pass over `items` (any iterable, read once) that keeps only its shape: the
    fingerprint and page cuts `encode_source` would give a list of the same rows. Refuses what
    `encode_source` refuses, naming the item by its position."""
    return encode_pass(items, keep=False)[0]


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


_STORED_WRAP = len('{"data":}')  # a stored row is {"data":<text>} ...
_IDENTITY_WRAP = len(',"source_identity":')  # ... plus ,"source_identity":<identity>


def encode_pass(items: Iterable[Occurrence | dict], keep: bool
                ) -> tuple[SourceShape, Sequence[dict], list[bytes], list[str | None] | None]:
    """The one encoding pass; rows, packed page texts and identities are kept only with `keep`.

    A list's leading pages of plain canonical rows go a column at a time (`_plain_prefix`);
    from the first page that is not, the hot path per row: one canonical check and one
    encoding (no copy: see `span`); a row's stored form is never built alone (its size is the
    text's plus a constant, and a page's stored rows are hashed as one join). The page's bytes
    limit is checked against a bound of the fact's overhead fixed per page (the exact
    overhead is computed only for a row near the limit). Rows are the caller's objects (`rows` is `items` itself) until an item is not its
    own canonical data; identities are listed only once an item has one.
    """
    pages = _PageCuts(keep)
    start = _plain_prefix(items, pages)  # pages of plain rows, a column at a time
    rows: list[dict] | None = None  # built only once an item is not its own clean data
    identities: list[str | None] | None = None
    page_texts: list[str] = []  # the data texts of the page being cut ...
    page_identities: list[str | None] | None = None  # ... and their identities, if any has one
    size = 0  # the page being cut: its rows' stored bytes + separators
    any_identity = False
    room = pages.room()
    dumps = canonical.stable_dumps
    is_canonical = canonical.is_canonical
    with_rows = keep and type(items) is list

    rest = items if not start else itertools.islice(items, start, None)
    for index, item in enumerate(rest, start):
        if type(item) is dict:
            data, identity = item, None
        else:
            data, identity = _unwrap(index, item)
        clean = data if is_canonical(data) else \
            canonical.normalize_fast(data, f"rows[{index}].data")
        text = dumps(clean)
        row_bytes = _utf8_len(text) + _STORED_WRAP
        if identity is not None:
            row_bytes += _IDENTITY_WRAP + _utf8_len(identity)
        count = len(page_texts)
        if count and (count >= MAX_PAGE_ROWS or size + 1 + row_bytes > room and pages.overhead(
                count + 1) + size + 1 + row_bytes > MAX_PAGE_BYTES):
            pages.cut(page_texts, page_identities)
            size, page_texts, page_identities, room = 0, [], None, pages.room()
            count = 0
        if not count and row_bytes > room and pages.overhead(1) + row_bytes > MAX_PAGE_BYTES:
            raise InvalidInputError(
                f"rows[{index}] alone needs {row_bytes} bytes of canonical JSON; a page fact "
                f"holds at most {MAX_PAGE_BYTES} bytes"
            )
        size += row_bytes + (1 if count else 0)
        page_texts.append(text)
        if identity is not None:
            any_identity = True
            if page_identities is None:
                page_identities = [None] * count
            if keep and identities is None:
                identities = [None] * index
        if page_identities is not None:
            page_identities.append(identity)
        if keep:
            if identities is not None:
                identities.append(identity)
            if rows is None and (clean is not item or not with_rows):
                rows = list(items[:index]) if with_rows else []  # else index is 0
            if rows is not None:
                rows.append(clean)
    if page_texts:
        pages.cut(page_texts, page_identities)
    kept: Sequence[dict] = rows if rows is not None else (items if keep else [])
    shape = SourceShape(pages.hasher.hexdigest(), pages.rows, tuple(pages.cuts), any_identity,
                        tuple(pages.digests))
    return shape, kept, pages.packed, identities


def _plain_prefix(items: Iterable[Occurrence | dict], pages: _PageCuts) -> int:
    """The pass's column path over a list: page after page while its next `MAX_PAGE_ROWS`
    items (or its last ones) are dicts, each its own canonical data, that fit one page's
    bytes — their texts in one encoding pass in C (`canonical.canonical_texts`), the page cut
    as the row loop would cut it. Returns the offset reached: the row loop goes on from
    there (from 0 for an iterable that is not a list)."""
    if type(items) is not list:
        return 0
    for low in range(0, len(items), MAX_PAGE_ROWS):
        texts = canonical.canonical_texts(items[low:low + MAX_PAGE_ROWS])
        if texts is None:
            return low
        sizes = map(len, texts) if all(map(str.isascii, texts)) else map(_utf8_len, texts)
        stored = sum(sizes) + len(texts) * (_STORED_WRAP + 1) - 1  # with the separators
        if stored > MAX_PAGE_BYTES - fact_overhead(len(pages.cuts), low, MAX_PAGE_ROWS):
            return low  # a page cut by its bytes: the row loop finds where
        pages.cut(texts, None)
    return len(items)


def _unwrap(index: int, item: object) -> tuple[dict, str | None]:
    """An item that is not a plain dict: an `Occurrence`'s data and identity text, or a dict
    subclass's own data (no identity); anything else is refused, naming its position."""
    if isinstance(item, Occurrence):
        return item.data, _identity_text(item, f"rows[{index}]")
    if isinstance(item, dict):
        return item, None
    raise InvalidInputError(
        f"rows[{index}] must be a dict or an Occurrence, got {type(item).__name__}"
    )


@attrs.define(eq=False)
class _PageCuts:
    """The pages one encoding pass has cut so far: their (offset, count) cuts, the fingerprint
    hasher fed each page's stored rows, and each page's packed texts (`keep`) or else its
    digest. `rows` counts the rows cut: the next page's offset."""

    keep: bool
    hasher: hashlib._Hash = attrs.field(init=False, factory=hashlib.sha256)
    cuts: list[tuple[int, int]] = attrs.field(init=False, factory=list)
    packed: list[bytes] = attrs.field(init=False, factory=list)
    digests: list[bytes] = attrs.field(init=False, factory=list)
    rows: int = attrs.field(init=False, default=0)

    def room(self) -> int:
        """The bytes the next page holds for its rows, whatever their count."""
        return MAX_PAGE_BYTES - fact_overhead(len(self.cuts), self.rows, MAX_PAGE_ROWS)

    def overhead(self, count: int) -> int:
        """The next page's fact overhead with `count` rows (exact, for a row near the limit)."""
        return fact_overhead(len(self.cuts), self.rows, count)

    def cut(self, texts: list[str], identities: list[str | None] | None) -> None:
        """Close a page of these data texts (and identities, when any row has one): its stored
        rows, as one text, feed the fingerprint."""
        if identities is None:
            blob = ('{"data":' + '}\n{"data":'.join(texts) + '}\n').encode()
        else:
            blob = "".join(
                f'{{"data":{text}}}\n' if identity is None
                else f'{{"data":{text},"source_identity":{identity}}}\n'
                for text, identity in zip(texts, identities)).encode()
        self.hasher.update(blob)
        if self.keep:
            self.packed.append(pack_texts("\n".join(texts)))
        else:
            self.digests.append(hashlib.sha256(blob).digest())
        self.cuts.append((self.rows, len(texts)))
        self.rows += len(texts)

