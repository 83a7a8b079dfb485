"""A `PagedRows` source (a read-only sequence kept outside memory) is encoded page by page, and
gives exactly what a list of the same rows gives: fingerprint, page cuts, page facts, rows and
texts (so a rerun from a list or from the file reuses rows and staged input)."""

from __future__ import annotations

import pytest

from runplane.engine.array_input import (
    MAX_PAGE_BYTES, Occurrence, PagedRows, PagedSource, SourceIdentity, encode_source,
    scan_source,
)
from runplane.engine.errors import InvalidInputError


class CountingRows(PagedRows):
    """Rows held by the test, read span by span (each read counted)."""

    def __init__(self, rows, shape=None):
        self._rows = rows
        self._shape = shape
        self.reads: list[tuple[int, int]] = []

    def __len__(self):
        return len(self._rows)

    def read_span(self, low, high):
        self.reads.append((low, high))
        return [dict(row) if isinstance(row, dict) else row for row in self._rows[low:high]]

    def shape(self):
        return self._shape


def mixed_rows(count: int) -> list:
    """Small rows, rows of 300 KB (so pages are cut by bytes) and rows to normalize."""
    rows: list = []
    for i in range(count):
        if i % 250 == 5:
            rows.append({"name": f"big{i}", "blob": "x" * 300_000})
        elif i % 13 == 0:
            rows.append({"name": f"n{i}", "score": 1.0, "nfd": "e\u0301"})
        else:
            rows.append({"name": f"n{i}", "n": i})
    return rows


def test_a_paged_source_matches_the_list_of_its_rows():
    rows = mixed_rows(3500)
    listed = encode_source(rows)
    paged_rows = CountingRows(rows)
    paged = encode_source(paged_rows)
    assert isinstance(paged, PagedSource)
    assert (paged.fingerprint, paged.cuts, paged.source_rows, paged.has_source_identities) == (
        listed.fingerprint, listed.cuts, listed.source_rows, listed.has_source_identities)
    assert listed.page_count > 4  # cut by bytes and by rows
    for ordinal in range(listed.page_count):
        assert paged.page(ordinal) == listed.page(ordinal)
        assert paged.draft(ordinal) == listed.draft(ordinal)
    for low, high in [(0, 1), (3, 2000), (999, 1001), (2990, 3500), (0, 3500)]:
        assert paged.span(low, high) == listed.span(low, high)


def test_a_paged_source_uses_a_given_shape_without_scanning():
    rows = mixed_rows(1200)
    shape = scan_source(iter(rows))
    paged_rows = CountingRows(rows, shape)
    paged = encode_source(paged_rows)
    assert paged_rows.reads == []
    assert paged.fingerprint == encode_source(rows).fingerprint
    paged.span(0, 10)
    assert paged_rows.reads == [paged.cuts[0] and (0, paged.cuts[0][1])]
    with pytest.raises(InvalidInputError, match="counts 1199 rows but it holds 1200"):
        encode_source(CountingRows(rows, scan_source(rows[:-1])))


def test_identities_and_refusals_are_those_of_a_list():
    rows = [Occurrence({"a": i}, SourceIdentity("ds", i)) for i in range(5)]
    assert encode_source(CountingRows(rows)).fingerprint == encode_source(rows).fingerprint
    assert encode_source(CountingRows(rows)).has_source_identities
    too_big = [{"a": 1}, {"blob": "x" * MAX_PAGE_BYTES}]
    with pytest.raises(InvalidInputError, match=r"rows\[1\] alone needs"):
        scan_source(too_big)


def test_paged_rows_index_slice_and_iterate_by_spans():
    rows = [{"i": i} for i in range(2500)]
    paged_rows = CountingRows(rows)
    assert len(paged_rows) == 2500 and not isinstance(paged_rows, list)
    assert paged_rows[-1] == {"i": 2499} and paged_rows[7] == {"i": 7}
    assert paged_rows[10:13] == rows[10:13] and paged_rows[5:1] == []
    assert paged_rows[0:10:3] == rows[0:10:3]
    paged_rows.reads.clear()
    assert list(paged_rows) == rows
    assert paged_rows.reads == [(0, 1000), (1000, 2000), (2000, 2500)]
    with pytest.raises(IndexError):
        paged_rows[2500]


def test_a_page_that_reads_back_differently_from_its_scan_is_refused():
    rows = [{"i": i} for i in range(2500)]
    paged_rows = CountingRows(rows, scan_source(rows))
    paged = encode_source(paged_rows)
    assert paged.span(0, 3) == ([{"i": 0}, {"i": 1}, {"i": 2}], ['{"i":0}', '{"i":1}', '{"i":2}'])
    rows[1500] = {"i": -1}  # the storage changed after the scan
    with pytest.raises(InvalidInputError, match="rows 1000 to 1999 of the source read back"):
        paged.page(1)
