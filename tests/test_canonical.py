"""canonical JSON: the normalize rules, and the jsonb round-trip law against the real server."""

from __future__ import annotations

import decimal
import math

import pytest
import trio
from hypothesis import given, settings, strategies as st

from runplane.engine import canonical, open_tenant
from runplane.engine.errors import InvalidInputError

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=4)
    | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def test_integral_floats_become_ints():
    assert canonical.normalize(1.0) == 1 and type(canonical.normalize(1.0)) is int
    assert canonical.normalize(-0.0) == 0
    assert canonical.normalize(1e20) == 10**20
    assert canonical.normalize(0.5) == 0.5


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused_with_their_path(bad):
    with pytest.raises(InvalidInputError, match=r"rows\[3\]\.data\.score"):
        canonical.normalize({"data": {"score": bad}}, "rows[3]")


@pytest.mark.parametrize("bad", [b"x", decimal.Decimal("1.5"), {1, 2}, object(), complex(1, 2)])
def test_non_json_types_are_refused(bad):
    with pytest.raises(InvalidInputError):
        canonical.normalize({"k": [bad]})


def test_non_string_keys_are_refused():
    with pytest.raises(InvalidInputError, match="key 1"):
        canonical.normalize({1: "x"})


def test_nul_and_lone_surrogates_become_replacement_characters():
    assert canonical.normalize({"a\x00": "b\ud800c"}) == {"a\ufffd": "b\ufffdc"}


def test_nesting_deeper_than_64_is_refused():
    ok: object = "leaf"
    for _ in range(64):
        ok = [ok]
    canonical.normalize(ok)
    with pytest.raises(InvalidInputError, match="deeper than 64"):
        canonical.normalize([ok])


def test_tuples_become_lists_and_dumps_is_compact_sorted_and_utf8():
    assert canonical.stable_dumps(canonical.normalize({"b": (1, 2.5), "a": "é"})) == '{"a":"é","b":[1,2.5]}'


def test_digest_is_sha256_of_the_canonical_text():
    import hashlib

    assert canonical.digest({"b": 1, "a": 1.0}) == hashlib.sha256(b'{"a":1,"b":1}').hexdigest()


@given(json_values)
def test_normalize_is_idempotent_and_digest_ignores_key_order(value):
    once = canonical.normalize(value)
    assert canonical.normalize(once) == once
    if isinstance(once, dict):
        reordered = dict(reversed(list(once.items())))
        assert canonical.digest(reordered) == canonical.digest(once)


@settings(max_examples=25, deadline=None)
@given(st.lists(json_values, min_size=1, max_size=40))
def test_jsonb_round_trip_law(dsn, values):
    """For every value normalize accepts, jsonb stores and returns the same canonical text."""
    texts = [canonical.stable_dumps(canonical.normalize(v)) for v in values]

    async def check():
        async with open_tenant("org-law", dsn, schema="canonical_law") as tenant:
            async with tenant.connection("receipts") as conn:
                rows = await conn.fetch(
                    "SELECT (x::jsonb)::text AS stored FROM unnest($1::text[]) WITH ORDINALITY AS u(x, n) ORDER BY n",
                    texts,
                )
        back = [canonical.stable_dumps(canonical.loads(r["stored"])) for r in rows]
        assert back == texts

    trio.run(check)


# -- the fast path: is_canonical and normalize_fast agree with normalize ------------------------


class _Str(str):
    pass


class _Int(int):
    pass


class _Float(float):
    pass


class _Dict(dict):
    pass


class _List(list):
    pass


awkward_strings = st.text(alphabet=st.sampled_from("ab\x00\ud800\udfff\ufffdé😀"), max_size=4)
awkward_leaves = (
    json_leaves
    | awkward_strings
    | st.floats()  # NaN, ±inf, -0.0 and integral floats
    | st.sampled_from([1.0, -0.0, 2.0**60, 10**4000, -(10**4000), 10**4000 - 1, True, False])
    | st.builds(_Str, st.text(max_size=3))
    | st.builds(_Int, st.integers())
    | st.builds(_Float, st.floats())
    | st.binary(max_size=2)
    | st.just(decimal.Decimal("1.5"))
)
awkward_keys = st.text(max_size=3) | awkward_strings | st.integers() | st.builds(_Str, st.text(max_size=2))
awkward_values = st.recursive(
    awkward_leaves,
    lambda children: st.lists(children, max_size=4)
    | st.tuples(children)
    | st.builds(_List, st.lists(children, max_size=2))
    | st.dictionaries(awkward_keys, children, max_size=4)
    | st.builds(_Dict, st.dictionaries(st.text(max_size=2), children, max_size=2)),
    max_leaves=16,
)


def same_types(a, b) -> bool:
    """Equal, with the same exact type at every position (and the same key order)."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return list(a) == list(b) and all(same_types(a[k], b[k]) for k in a)
    if type(a) is list:
        return len(a) == len(b) and all(same_types(x, y) for x, y in zip(a, b))
    return a == b


def _outcome(fn, value):
    try:
        return "ok", fn(value)
    except InvalidInputError as exc:
        return "refused", str(exc)


@settings(max_examples=600)
@given(awkward_values | json_values)
def test_is_canonical_is_true_exactly_when_normalize_returns_the_value_unchanged(value):
    status, normalized = _outcome(lambda v: canonical.normalize(v, "v"), value)
    unchanged = status == "ok" and same_types(normalized, value)
    assert canonical.is_canonical(value) is unchanged
    if unchanged:
        assert canonical.is_canonical(value, strings=False)


@settings(max_examples=600)
@given(awkward_values | json_values)
def test_normalize_fast_equals_normalize_and_returns_canonical_values_themselves(value):
    slow = _outcome(lambda v: canonical.normalize(v, "rows[3].data"), value)
    fast = _outcome(lambda v: canonical.normalize_fast(v, "rows[3].data"), value)
    assert fast[0] == slow[0]
    if slow[0] == "ok":
        assert same_types(fast[1], slow[1])
        assert canonical.stable_dumps(fast[1]) == canonical.stable_dumps(slow[1])
    else:
        assert fast[1] == slow[1]  # the same error, naming the same path
    if canonical.is_canonical(value):
        assert canonical.normalize_fast(value, "v") is value


@settings(max_examples=400)
@given(awkward_values | json_values)
def test_without_string_rules_the_encoded_text_decides(value):
    """`strings=False` plus the encoded-text check (no escaped NUL, encodable as UTF-8) is what
    the page encoder relies on: together they prove the text is `stable_dumps(normalize(v))`."""
    if not canonical.is_canonical(value, strings=False):
        return
    text = canonical.stable_dumps(value)
    try:
        text.encode()
    except UnicodeEncodeError:
        assert not canonical.is_canonical(value)
        return
    if "\\u0000" in text:
        assert not canonical.is_canonical(value)
        return
    assert canonical.is_canonical(value)
    assert canonical.stable_dumps(canonical.normalize(value)) == text


def test_depth_limit_of_the_fast_path():
    ok: object = {"leaf": 1.5}
    for _ in range(63):
        ok = [ok]
    assert canonical.is_canonical(ok) and canonical.normalize_fast(ok, "v") is ok
    assert not canonical.is_canonical([ok]) and not canonical.is_canonical([ok], strings=False)
    with pytest.raises(InvalidInputError, match="deeper than 64"):
        canonical.normalize_fast([ok], "v")
    floaty: object = {"leaf": 2.0}
    for _ in range(63):
        floaty = [floaty]
    assert canonical.normalize_fast(floaty, "v") == canonical.normalize(floaty, "v")
    with pytest.raises(InvalidInputError, match="deeper than 64"):
        canonical.normalize_fast([floaty], "v")


def test_normalize_fast_rebuilds_integral_floats_and_defers_the_rest():
    row = {"a": 1.0, "b": [2.0, "x"], "c": -0.0}
    assert same_types(canonical.normalize_fast(row, "r"), {"a": 1, "b": [2, "x"], "c": 0})
    assert row == {"a": 1.0, "b": [2.0, "x"], "c": -0.0}  # the caller's value is untouched
    assert canonical.normalize_fast({"k\x00": 1.0}, "r") == {"k\ufffd": 1}
    assert canonical.normalize_fast(("a", 3.0), "r") == ["a", 3]
    with pytest.raises(InvalidInputError, match=r"r\.x: nan"):
        canonical.normalize_fast({"x": math.nan, "y": 1.0}, "r")
    with pytest.raises(InvalidInputError, match="collides"):
        canonical.normalize_fast({"a\x00": 1, "a\ufffd": 2.0}, "r")
    assert canonical.is_clean_str("plain é") and not canonical.is_clean_str("a\x00")
    assert not canonical.is_clean_str("\ud800")


_STRING_DEFECTS = ["a\x00", "\ud800", "é\udfff", "\x00é"]
_OTHER_DEFECTS = [1.0, -0.0, 2.0**60, math.nan, math.inf, 10**4000, -(10**4000), (1,), _Str("s"),
                  _Int(1), _Float(1.5), _Dict(), _List(), b"x", decimal.Decimal("1.5"), {1}]
_PLACES = [
    lambda d: d,
    lambda d: {"k": d, "z": "ok"},
    lambda d: ["ok", 1.5, d],
    lambda d: {"a": [1, {"b": d}], "c": None},
]


@pytest.mark.parametrize("place", range(len(_PLACES)))
@pytest.mark.parametrize("defect", _STRING_DEFECTS + _OTHER_DEFECTS, ids=repr)
def test_every_single_defect_anywhere_is_caught(defect, place):
    value = _PLACES[place](defect)
    assert not canonical.is_canonical(value)
    assert canonical.is_canonical(value, False) is (defect in _STRING_DEFECTS)
    slow = _outcome(lambda v: canonical.normalize(v, "p"), value)
    fast = _outcome(lambda v: canonical.normalize_fast(v, "p"), value)
    assert fast[0] == slow[0] and (fast[1] == slow[1] if fast[0] == "refused" else same_types(fast[1], slow[1]))


@pytest.mark.parametrize("defect", _STRING_DEFECTS + [_Str("k"), 1, None, (1,)], ids=repr)
def test_every_key_defect_is_caught(defect):
    for value in ({defect: 1}, [{"a": 1.5, defect: "x"}]):
        assert not canonical.is_canonical(value)
        assert canonical.is_canonical(value, False) is (defect in _STRING_DEFECTS)
        slow = _outcome(lambda v: canonical.normalize(v, "p"), value)
        fast = _outcome(lambda v: canonical.normalize_fast(v, "p"), value)
        assert fast[0] == slow[0] and (fast[1] == slow[1] if fast[0] == "refused" else same_types(fast[1], slow[1]))


def test_canonical_texts_are_each_rows_text_or_none_for_anything_not_plain():
    rows = [{"b": [1, 2.5, "é"], "a": None}, {"x": {"z": True, "y": "s"}}, {}]
    assert canonical.canonical_texts(rows) == [canonical.stable_dumps(row) for row in rows]
    for odd in ({"f": 1.0}, {"t": (1,)}, {"s": "nul\x00"}, {1: "key"}, ["not", "a", "dict"]):
        assert canonical.canonical_texts(rows + [odd]) is None
    assert canonical.canonical_texts(tuple(rows)) is None  # a list only
    assert canonical.canonical_texts([]) is None
