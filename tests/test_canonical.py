"""canonical JSON: the normalize rules, and the jsonb round-trip law against the real server."""

from __future__ import annotations

import decimal
import math

import pytest
import trio
from hypothesis import given, settings, strategies as st

from engine import canonical, open_tenant
from engine.errors import InvalidInputError

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
