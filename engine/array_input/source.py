"""A map's source encoded: `encode_source` and the sources too large to hold, read page by page.

How it works
- `encode_source(items)` encodes a list source once (`source_pass`: the one encoding pass,
  giving an `EncodedSource`: fingerprint, page cuts, page facts on demand, each row's
  canonical text).
- A source too large to hold (a `PagedRows`: a read-only sequence backed by a file, say) is
  encoded as a `PagedSource` instead: one pass (`scan_source`, or the shape the source's own
  checking pass computed) keeps only the fingerprint and the page cuts — the same ones a list
  of the same rows gets, so a list and the file share keys, pages and staged input — and a
  page's rows and texts are read and encoded again when a page or span is asked for (a few
  recent pages are kept), and must hash as that page did in the scan (`InvalidInputError`
  otherwise: the staged input is never other rows than the fingerprint's). Memory is then
  bounded by a few pages whatever the source's size.
This module does no I/O of its own (a `PagedRows` may read its storage).
"""

from __future__ import annotations

import abc
import bisect
import collections
import hashlib
import operator
import threading
from typing import Iterator, Sequence

import attrs

from ..errors import InvalidInputError
from .values import MAX_PAGE_ROWS, Occurrence, PageDraft
from .pages import EncodedPage
from .source_pass import (
    EncodedSource, SourceShape, encode_pass, pack_texts, page_fact, scan_source, unpack_texts,
)

CACHED_PAGES = 8  # pages of a PagedSource kept encoded (admission units and putters share them)


class PagedRows(Sequence):
    """A read-only sequence of rows kept outside memory (a file, say), read a span at a time.

    A subclass gives `__len__` and `read_span(low, high)` (rows `low` to `high - 1`, as dicts
    or `Occurrence`s), and may give `shape()`, the `SourceShape` its own checking pass
    computed (None: `encode_source` scans it). Indexing, slicing and iteration read spans."""

    SPAN_ROWS = MAX_PAGE_ROWS

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def read_span(self, low: int, high: int) -> list[Occurrence | dict]: ...

    def shape(self) -> SourceShape | None:
        return None

    def __getitem__(self, index: int | slice) -> Occurrence | dict | list[Occurrence | dict]:
        size = len(self)
        if isinstance(index, slice):
            low, high, step = index.indices(size)
            if step == 1:
                return self.read_span(low, high) if high > low else []
            return [self[i] for i in range(low, high, step)]
        position = operator.index(index)
        if position < 0:
            position += size
        if not 0 <= position < size:
            raise IndexError("row index out of range")
        return self.read_span(position, position + 1)[0]

    def __iter__(self) -> Iterator[Occurrence | dict]:
        size = len(self)
        for low in range(0, size, self.SPAN_ROWS):
            yield from self.read_span(low, min(size, low + self.SPAN_ROWS))



def encode_source(items: Sequence[Occurrence | dict]) -> EncodedSource | PagedSource:
    """Encode a list source once; `InvalidInputError` naming the item for anything malformed or
    a row that alone exceeds a page. A `PagedRows` source becomes a `PagedSource` (its shape
    from its own checking pass, or from one scan)."""
    if isinstance(items, PagedRows):
        shape = items.shape()
        if shape is None:
            shape = scan_source(items)
        if shape.source_rows != len(items):
            raise InvalidInputError(
                f"the source's shape counts {shape.source_rows} rows but it holds {len(items)}")
        return PagedSource(shape, items)
    if not isinstance(items, (list, tuple)):
        raise InvalidInputError(f"a list source must be a list, got {type(items).__name__}")
    shape, rows, packed, identities = encode_pass(items, keep=True)
    return EncodedSource(shape.fingerprint, rows, packed, identities, shape.cuts,
                         shape.has_source_identities)



@attrs.define(eq=False)
class PagedSource:
    """A `PagedRows` source encoded page by page (see the module docstring): the same
    fingerprint, cuts, page facts, rows and texts as an `EncodedSource` of the same rows,
    with only `CACHED_PAGES` pages held at a time."""

    shape: SourceShape
    rows_source: PagedRows = attrs.field(repr=False)
    _offsets: list[int] = attrs.field(init=False, repr=False)
    _pages: collections.OrderedDict = attrs.field(init=False, repr=False,
                                                  factory=collections.OrderedDict)
    _lock: threading.Lock = attrs.field(init=False, repr=False, factory=threading.Lock)

    def __attrs_post_init__(self) -> None:
        self._offsets = [offset for offset, _ in self.shape.cuts]

    @property
    def fingerprint(self) -> str:
        return self.shape.fingerprint

    @property
    def source_rows(self) -> int:
        return self.shape.source_rows

    @property
    def cuts(self) -> tuple[tuple[int, int], ...]:
        return self.shape.cuts

    @property
    def page_count(self) -> int:
        return len(self.shape.cuts)

    @property
    def has_source_identities(self) -> bool:
        return self.shape.has_source_identities

    def _page(self, ordinal: int) -> EncodedSource:
        """Page `ordinal`'s rows read and encoded (kept among the last `CACHED_PAGES`)."""
        with self._lock:
            cached = self._pages.get(ordinal)
            if cached is not None:
                self._pages.move_to_end(ordinal)
                return cached
        offset, count = self.shape.cuts[ordinal]
        items = self.rows_source.read_span(offset, offset + count)
        if len(items) != count:
            raise InvalidInputError(
                f"rows {offset} to {offset + count - 1} of the source read as {len(items)} rows")
        _shape, rows, packed, identities = encode_pass(items, keep=True)
        if len(packed) != 1:  # rows changed since the scan: cut otherwise (refused below)
            packed = [pack_texts("\n".join(text for page in packed for text in unpack_texts(page)))]
        encoded = EncodedSource(self.shape.fingerprint, rows, packed, identities, ((0, count),),
                                self.shape.has_source_identities)
        if self.shape.page_digests:
            stored = "\n".join(encoded.stored_texts(0, count)) + "\n"
            if hashlib.sha256(stored.encode()).digest() != self.shape.page_digests[ordinal]:
                raise InvalidInputError(
                    f"rows {offset} to {offset + count - 1} of the source read back "
                    "differently than when it was scanned (was it changed?)")
        with self._lock:
            self._pages[ordinal] = encoded
            while len(self._pages) > CACHED_PAGES:
                self._pages.popitem(last=False)
        return encoded

    def span(self, low: int, high: int) -> tuple[list[dict], list[str]]:
        """The normalized rows `low` to `high - 1` (fresh shallow copies) and their canonical
        texts, page by page."""
        rows: list[dict] = []
        texts: list[str] = []
        ordinal = max(0, bisect.bisect_right(self._offsets, low) - 1)
        while low < high and ordinal < len(self._offsets):
            offset, count = self.shape.cuts[ordinal]
            page = self._page(ordinal)
            start, stop = low - offset, min(high, offset + count) - offset
            rows += map(dict, page.rows[start:stop])
            texts += page.texts_between(start, stop)
            low, ordinal = offset + stop, ordinal + 1
        return rows, texts

    def page(self, ordinal: int) -> EncodedPage:
        """Page `ordinal`'s fact: its canonical text and digest (as `encode_page` makes them)."""
        offset, count = self.shape.cuts[ordinal]
        return page_fact(self.shape.fingerprint, ordinal, offset,
                          self._page(ordinal).stored_texts(0, count))

    def draft(self, ordinal: int) -> PageDraft:
        """Page `ordinal` as occurrences (for callers of the public `put_page`)."""
        offset, _count = self.shape.cuts[ordinal]
        draft = self._page(ordinal).draft(0)
        return PageDraft(ordinal, offset, draft.rows)

