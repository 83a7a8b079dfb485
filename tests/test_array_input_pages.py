"""Pure array-input logic: occurrences, fingerprints, pagination and page encoding (no I/O)."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings, strategies as st

from runplane.engine import array_input as A, canonical
from runplane.engine.array_input import pages as P
from runplane.engine.errors import CorruptFactError, InvalidInputError

FP = "a" * 64


def test_public_constants():
    assert (A.MAX_PAGE_ROWS, A.MAX_PAGE_BYTES, A.RETIRE_BATCH_ROWS) == (1000, 1048576, 128)


def test_occurrence_validates_data_and_identity():
    with pytest.raises(InvalidInputError):
        A.Occurrence([1, 2])
    with pytest.raises(InvalidInputError):
        A.SourceIdentity("", 1)
    with pytest.raises(InvalidInputError):
        A.SourceIdentity("d", -1)
    with pytest.raises(InvalidInputError):
        A.SourceIdentity("d", 2**53)
    with pytest.raises(InvalidInputError):
        A.SourceIdentity("d", True)
    with pytest.raises(InvalidInputError):
        A.Occurrence({"a": 1}, source_identity="d:1")
    assert A.Occurrence({"a": 1}, {"dataset_id": "d", "row_index": 3}).source_identity == \
        A.SourceIdentity("d", 3)


def test_fingerprint_is_incremental_canonical_and_order_sensitive():
    rows = [A.Occurrence({"b": 1.0, "a": "x"}), A.Occurrence({"c": 2}, A.SourceIdentity("d", 0))]
    expected = hashlib.sha256()
    for row in ({"data": {"a": "x", "b": 1}},
                {"data": {"c": 2}, "source_identity": {"dataset_id": "d", "row_index": 0}}):
        expected.update(canonical.stable_dumps(row).encode() + b"\n")
    assert A.source_fingerprint(rows) == expected.hexdigest()
    assert A.source_fingerprint(iter(rows)) == expected.hexdigest()  # any iterable, one pass
    assert A.source_fingerprint(rows[::-1]) != expected.hexdigest()
    assert A.source_fingerprint([{"a": "x", "b": 1}]) == A.source_fingerprint([rows[0]])
    with pytest.raises(InvalidInputError, match=r"occurrences\[0\]\.data\.x"):
        A.source_fingerprint([{"x": float("nan")}])


def test_paginate_cuts_by_rows():
    drafts = A.paginate([{"i": i} for i in range(2001)])
    assert [(d.ordinal, d.offset, len(d.rows)) for d in drafts] == [(0, 0, 1000), (1, 1000, 1000),
                                                                    (2, 2000, 1)]
    assert A.paginate([]) == []


def test_paginate_cuts_by_bytes_and_every_page_fits():
    source = [{"i": i, "pad": "é" * 3000} for i in range(400)]  # ~6 KB of UTF-8 each
    drafts = A.paginate(source)
    assert len(drafts) > 2
    offset = 0
    for draft in drafts:
        assert draft.offset == offset
        page = P.encode_page(FP, draft.ordinal, draft.offset, draft.rows)
        assert len(page.text.encode()) <= A.MAX_PAGE_BYTES
        offset += len(draft.rows)
    # Greedy: the next row would not have fit.
    first = drafts[0]
    with pytest.raises(InvalidInputError):
        P.encode_page(FP, 0, 0, [*first.rows, drafts[1].rows[0]])


def test_paginate_refuses_an_occurrence_over_one_mib():
    with pytest.raises(InvalidInputError, match=r"occurrences\[1\]"):
        A.paginate([{"ok": 1}, {"huge": "x" * A.MAX_PAGE_BYTES}])


def test_encoded_page_is_the_canonical_fact_and_digest():
    rows = [A.Occurrence({"z": 1, "a": [1.5, "é"]}, A.SourceIdentity("ds", 7)), {"q": None}]
    page = P.encode_page(FP, 3, 10, rows)
    stored = [{"data": {"a": [1.5, "é"], "z": 1},
               "source_identity": {"dataset_id": "ds", "row_index": 7}}, {"data": {"q": None}}]
    digest = canonical.digest({"source_fingerprint": FP, "ordinal": 3, "offset": 10, "rows": stored})
    assert page.digest == digest
    assert page.text == canonical.stable_dumps({
        "kind": "array_input_page", "source_fingerprint": FP, "ordinal": 3, "offset": 10,
        "row_count": 2, "rows": stored, "digest": digest,
    })
    verified = P.verify_page(json.loads(page.text), source_fingerprint=FP, ordinal=3, offset=10)
    assert verified.rows == [A.Occurrence(rows[0].data, rows[0].source_identity), A.Occurrence({"q": None})]
    assert verified.has_source_identities


@pytest.mark.parametrize("rows", [[], [{"i": i} for i in range(1001)], "abc", None])
def test_encode_page_refuses_empty_or_overfull(rows):
    with pytest.raises(InvalidInputError):
        P.encode_page(FP, 0, 0, rows)


def test_verify_page_catches_every_kind_of_damage():
    good = json.loads(P.encode_page(FP, 0, 0, [{"a": 1}, {"a": 2}]).text)
    P.verify_page(good, source_fingerprint=FP, ordinal=0, offset=0)
    damaged = [
        dict(good, rows=[{"data": {"a": 1}}, {"data": {"a": 3}}]),
        dict(good, offset=1),
        dict(good, ordinal=1),
        dict(good, row_count=3),
        dict(good, source_fingerprint="b" * 64),
        dict(good, kind="array_input_seal"),
        dict(good, extra=1),
        {k: v for k, v in good.items() if k != "digest"},
        dict(good, rows=[{"data": [1]}, {"data": {"a": 2}}]),
    ]
    for fact in damaged:
        with pytest.raises(CorruptFactError):
            P.verify_page(fact, source_fingerprint=FP, ordinal=0, offset=0)
    with pytest.raises(CorruptFactError):
        P.verify_page(good, source_fingerprint=FP, ordinal=0, offset=5)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**60, 2**60) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=4), min_size=1, max_size=30))
def test_paginate_then_encode_round_trips(source):
    drafts = A.paginate(source)
    assert sum(len(d.rows) for d in drafts) == len(source)
    for draft in drafts:
        page = P.encode_page(FP, draft.ordinal, draft.offset, draft.rows)
        verified = P.verify_page(json.loads(page.text), source_fingerprint=FP,
                                 ordinal=draft.ordinal, offset=draft.offset)
        assert [o.data for o in verified.rows] == [canonical.normalize(o.data) for o in draft.rows]


awkward_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats()
    | st.sampled_from([1.0, -0.0, 1e16, 2.5e300, float("inf"), float("nan"), 10**4001, 10**3999])
    | st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=4)
    | st.sampled_from(["\x00", "a\ud800b", "\udfff", "\\u0000", "é", "1.0,"]),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3) | st.integers(0, 3) | st.sampled_from(["\x00", "\ud800"]),
                      inner, max_size=3),
    max_leaves=8,
)


def _slow_rows_text(rows):
    return canonical.stable_dumps([P.stored_row(o, f"rows[{i}]") for i, o in enumerate(rows)])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=3), awkward_values, max_size=3), min_size=1,
                max_size=4),
       st.booleans())
def test_the_fast_canonical_path_equals_normalize_exactly(datas, with_identity):
    rows = [A.Occurrence(d, A.SourceIdentity("d\x00s" if i == 1 else "ds", i) if with_identity else None)
            for i, d in enumerate(datas)]
    try:
        expected = _slow_rows_text(rows)
    except InvalidInputError:
        with pytest.raises(InvalidInputError):
            P.canonical_rows(rows)
        return
    text, utf8 = P.canonical_rows(rows)
    assert text == expected and utf8 == expected.encode()
    for i, row in enumerate(rows):
        assert P.canonical_row(row, "r") == canonical.stable_dumps(P.stored_row(row, "r")).encode()


def test_deep_nesting_takes_the_slow_path_and_is_refused():
    deep: dict = {}
    node = deep
    for _ in range(70):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(InvalidInputError, match="deeper"):
        P.canonical_rows([A.Occurrence(deep)])
