"""Pure sheet logic (no database): the canonical fast path agrees with `engine.canonical`,
physical names are deterministic, bounded and never system columns, row keys are stable."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from runplane.engine import canonical
from runplane.engine.sheets import row_key
from runplane.engine.sheets.layout import SYSTEM_COLUMNS, column_name, table_name
from runplane.engine.sheets.inputs import canonical_dumps, is_canonical, normalize_fast, patch_dumps

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(), st.binary(max_size=3), st.just(10**4001),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=4),
    ),
    max_leaves=12,
)


def same_types(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_types(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_types(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@settings(max_examples=400)
@given(values)
def test_fast_check_agrees_with_normalize(value):
    try:
        normalized = canonical.normalize(value)
    except Exception:
        assert not is_canonical(value)
        return
    if is_canonical(value):
        assert same_types(normalized, value)
        assert canonical_dumps(value) == canonical.stable_dumps(normalized)
        assert canonical.loads(patch_dumps(value)) == normalized
    assert same_types(normalize_fast(value, "v"), normalized)


def test_deep_nesting_is_not_canonical():
    deep = current = {}
    for _ in range(canonical.MAX_DEPTH):
        current["x"] = {}
        current = current["x"]
    assert not is_canonical(deep)


@given(st.text(min_size=1))
def test_column_names_are_bounded_and_never_system(field):
    name = column_name(field)
    assert name == column_name(field)
    assert len(name.encode()) <= 63 and name not in SYSTEM_COLUMNS and not name.startswith("_")


def test_names_distinguish_spellings():
    assert column_name("Name") != column_name("name")
    assert table_name("o", "p", "a_b") != table_name("o", "p_", "b")
    assert len(table_name("o" * 500, "p" * 500, "n" * 500).encode()) <= 63


def test_row_key_is_stable_and_namespace_normalized():
    row = {"b": 1.0, "a": [1, "x"]}
    assert row_key(row, "Companies!") == row_key({"a": [1, "x"], "b": 1}, "companies_")
    assert row_key(row, "one") != row_key(row, "two")
    assert len(row_key(row, "one")) == 32
