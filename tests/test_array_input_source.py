"""`encode_source`: one encoding pass equals the per-call helpers it replaces (pure, no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from runplane.engine import array_input as A
from runplane.engine import canonical
from runplane.engine.array_input.pages import encode_page
from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import row_key
from runplane.engine.sheets.inputs import text_key

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
datas = st.dictionaries(st.text(max_size=5), st.one_of(scalars, st.lists(scalars, max_size=3)),
                        max_size=4)
items = st.one_of(
    datas,
    st.builds(A.Occurrence, datas, st.none() | st.builds(A.SourceIdentity, st.text(min_size=1, max_size=6),
                                                         st.integers(0, 10**9))),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(items, max_size=40))
def test_encode_source_equals_fingerprint_paginate_and_encode_page(source):
    encoded = A.encode_source(source)
    assert encoded.fingerprint == A.source_fingerprint(source)
    drafts = A.paginate(source)
    assert encoded.page_count == len(drafts)
    for draft in drafts:
        assert encoded.cuts[draft.ordinal] == (draft.offset, len(draft.rows))
        assert encoded.page(draft.ordinal) == encode_page(
            encoded.fingerprint, draft.ordinal, draft.offset, draft.rows)
        again = encoded.draft(draft.ordinal)
        assert (again.ordinal, again.offset) == (draft.ordinal, draft.offset)
        assert encode_page(encoded.fingerprint, again.ordinal, again.offset, again.rows) == \
            encoded.page(draft.ordinal)
    rows, texts = encoded.span(0, len(source))
    assert texts == encoded.texts
    for item, row, text in zip(source, rows, texts):
        data = item if isinstance(item, dict) else item.data
        assert row == canonical.normalize(data) and row is not data  # a map function's own copy
        assert text == canonical.stable_dumps(row)
        assert text_key("ns", text) == row_key(data, "ns")
    assert encoded.has_source_identities == any(
        isinstance(i, A.Occurrence) and i.source_identity is not None for i in source)


def test_page_cuts_follow_both_limits():
    rows = [{"i": i, "pad": "x" * 3000} for i in range(1200)]
    encoded = A.encode_source(rows)
    assert [count for _, count in encoded.cuts] == [len(d.rows) for d in A.paginate(rows)]
    assert all(len(encoded.page(n).text.encode()) <= A.MAX_PAGE_BYTES for n in range(encoded.page_count))
    with pytest.raises(InvalidInputError, match=r"rows\[1\]"):
        A.encode_source([{"ok": 1}, {"big": "x" * A.MAX_PAGE_BYTES}])
    with pytest.raises(InvalidInputError, match=r"rows\[0\]"):
        A.encode_source(["not a row"])
    with pytest.raises(InvalidInputError, match=r"rows\[0\]\.data"):
        A.encode_source([{"bad": float("nan")}])


def test_an_encoded_page_travels_only_as_its_canonical_encoding():
    from runplane.engine.array_input.pages import ENCODED_PAGE

    encoded = A.encode_source([{"name": f"n{i}", "v": [i, 1.5]} for i in range(5)])
    page = encoded.page(0)
    assert ENCODED_PAGE.decode(ENCODED_PAGE.encode(page, "page"), "page") == page
    assert page.is_page(encoded.fingerprint, 0, 0) and not page.is_page(encoded.fingerprint, 1, 0)
    wire = ENCODED_PAGE.encode(page, "page")
    for forged in (
        dict(wire, text=wire["text"].replace('"n1"', '"n9"')),   # rows no longer hash to digest
        dict(wire, text=wire["text"].replace(":", ": ", 1)),    # not the canonical text
        dict(wire, row_count=4),
        dict(wire, text="[1]"),
        dict(wire, text="{"),
    ):
        with pytest.raises(InvalidInputError):
            ENCODED_PAGE.decode(forged, "page")


def _both_paths(rows, monkeypatch):
    """`encode_source(rows)` by the column path as far as it goes, and by the row loop alone;
    and the offset the column path reached."""
    from runplane.engine.array_input import source_pass

    reached = []
    column = source_pass._plain_prefix

    def spy(items, pages):
        reached.append(column(items, pages))
        return reached[-1]

    monkeypatch.setattr(source_pass, "_plain_prefix", spy)
    first = A.encode_source(rows)
    monkeypatch.setattr(source_pass, "_plain_prefix", lambda items, pages: 0)
    second = A.encode_source(rows)
    assert len(reached) == 1
    return first, second, reached[0]


def _same(a, b):
    assert (a.fingerprint, a.cuts, a.source_rows, a.has_source_identities) == \
        (b.fingerprint, b.cuts, b.source_rows, b.has_source_identities)
    assert a.texts == b.texts and list(a.rows) == list(b.rows)
    assert [a.page(n) for n in range(a.page_count)] == [b.page(n) for n in range(b.page_count)]


@pytest.mark.parametrize("pad", ["", "é" * 3, "日本"])
def test_a_list_of_plain_rows_is_cut_a_column_at_a_time_as_the_row_loop_cuts_it(pad,
                                                                                monkeypatch):
    rows = [{"i": i, "name": f"row-{i}{pad}", "tags": [i % 3, 1.5]} for i in range(2345)]
    column, loop, reached = _both_paths(rows, monkeypatch)
    assert reached == 2345 and [count for _, count in column.cuts] == [1000, 1000, 345]
    _same(column, loop)
    drafts = A.paginate(rows)
    assert [d.offset for d in drafts] == [offset for offset, _ in column.cuts]
    assert column.page(2) == encode_page(column.fingerprint, 2, 2000, drafts[2].rows)


@pytest.mark.parametrize("size, reached", [(1000, 2100), (1100, 0)])
def test_pages_near_the_byte_limit_are_cut_where_the_row_loop_cuts_them(size, reached,
                                                                         monkeypatch):
    # 1,000 rows of ~1,000 bytes fit a page; of ~1,100 bytes they do not (the loop cuts by
    # bytes, and the column path leaves such a list to it)
    rows = [{"i": i, "pad": "x" * (size - 20)} for i in range(2100)]
    column, loop, offset = _both_paths(rows, monkeypatch)
    assert offset == reached
    _same(column, loop)
    assert [count for _, count in column.cuts] == [len(d.rows) for d in A.paginate(rows)]


@pytest.mark.parametrize("odd", [
    {"f": 1.0},  # normalized to 1: not its own canonical data
    {"t": (1, 2)},
    A.Occurrence({"a": 1}, A.SourceIdentity("d", 1)),
    {"s": "nul\x00"},  # cleaned: not its own canonical data either
])
@pytest.mark.parametrize("at", [700, 2700])
def test_from_the_page_of_a_row_that_is_not_plain_the_list_goes_row_by_row(odd, at,
                                                                          monkeypatch):
    rows = [{"i": i} for i in range(3500)]
    rows[at] = odd
    column, loop, reached = _both_paths(rows, monkeypatch)
    assert reached == at // 1000 * 1000  # the pages before it went a column at a time
    _same(column, loop)
    assert column.has_source_identities == isinstance(odd, A.Occurrence)
