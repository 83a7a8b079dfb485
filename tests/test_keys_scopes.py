"""Scopes and receipt keys: stripping, empties, namespaces, injectivity and prefix safety."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from runplane.engine import MapScope, PlayScope, RunScope
from runplane.engine.errors import InvalidInputError, ScopeError
from runplane.engine.values.keys import decode_key, fact_key, receipt_key, run_key_range

# Identifiers: no control characters or lone surrogates, no surrounding whitespace.
parts = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=12).filter(
    lambda s: s.strip() == s and s.strip())


def test_scope_parts_are_stripped_and_never_empty():
    assert PlayScope("  org ", "\tplay\n") == PlayScope("org", "play")
    for bad in ("", "   "):
        with pytest.raises(ScopeError, match="play"):
            PlayScope("org", bad)
    with pytest.raises(ScopeError, match="run_id"):
        RunScope("org", "play", " ")


def test_table_namespaces_normalize_alike():
    a = MapScope("o", "p", "r", "Companies List!", "m1")
    b = MapScope("o", "p", "r", " companies  list?", "m1")
    assert a.table_namespace == b.table_namespace == "companies_list_"
    assert RunScope("o", "p", "r").map("X", "m") == MapScope("o", "p", "r", "x", "m")


def test_user_keys_are_bounded():
    scope = PlayScope("o", "p")
    receipt_key(scope, "k" * 1024)
    with pytest.raises(InvalidInputError, match="1 to 1024"):
        receipt_key(scope, "k" * 1025)
    with pytest.raises(InvalidInputError):
        receipt_key(scope, "")


@given(parts, parts, st.lists(parts, min_size=1, max_size=3), parts, parts, st.lists(parts, min_size=1, max_size=3))
def test_keys_are_injective(org1, play1, rest1, org2, play2, rest2):
    k1 = fact_key(PlayScope(org1, play1), "page", *rest1)
    k2 = fact_key(PlayScope(org2, play2), "page", *rest2)
    assert (k1 == k2) == ((org1, play1, rest1) == (org2, play2, rest2))
    assert decode_key(k1) == [org1, play1, "page", *rest1]


@given(parts, parts, parts, parts, st.lists(parts | st.integers(0, 10**6), max_size=3))
def test_run_ranges_hold_exactly_that_runs_facts(org, play, run, other_run, tail):
    scope = PlayScope(org, play)
    low, high = run_key_range(scope, "page", run)
    mine = fact_key(scope, "page", run, *tail, "x")
    theirs = fact_key(scope, "page", other_run, *tail, "x")
    guard = fact_key(scope, "page", run)
    assert low <= mine < high
    assert (low <= theirs < high) == (run == other_run)
    assert not (low <= guard < high)  # a fact without further parts (a guard) stays out


@given(parts, parts, parts)
def test_user_and_internal_keys_are_disjoint(org, play, key):
    scope = PlayScope(org, play)
    user = receipt_key(scope, key)
    assert decode_key(user)[2] == "receipt"
    for kind in ("array_input_page", "array_input_guard", "run"):
        assert fact_key(scope, kind, key) != user
    with pytest.raises(ValueError):
        fact_key(scope, "receipt", key)
