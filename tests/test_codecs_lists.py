"""A list of strings or integers is checked a column at a time (`codecs._COLUMN_CHECKS`); it
must answer what the check of each item answers: the same list, or the same error naming the
item."""

from __future__ import annotations

import pytest

from runplane.engine.errors import InvalidInputError
from runplane.engine.values.codecs import INT, INT32, STR, list_of


@pytest.mark.parametrize("inner, values", [
    (STR, ["a", "é", "", "\x00"]),  # NUL is a STR's to carry (TEXT refuses it)
    (INT, [0, -(2**63), 2**63 - 1]),
    (INT32, [-(2**31), 2**31 - 1]),
    (STR, []),
])
def test_a_good_list_comes_back_as_it_was(inner, values):
    codec = list_of(inner)
    assert codec.decode(values, "p") == values and codec.encode(tuple(values), "p") == values
    assert list_of(inner, as_tuple=True).decode(values, "p") == tuple(values)


@pytest.mark.parametrize("inner, values, decoded, encoded", [
    (STR, ["a", 1], "p[1] must be a string, got int", "p[1] must be a string, got int"),
    (STR, ["a", None], "p[1] must be a string, got NoneType", "p[1] must be a string, got NoneType"),
    (STR, ["a", "x\ud800"], "p[1] holds a lone surrogate", None),  # encode checks the type only
    (INT, [1, True], "p[1] must be an integer, got bool", "p[1] must be an integer, got bool"),
    (INT, [1, 1.0], "p[1] must be an integer, got float", "p[1] must be an integer, got float"),
    (INT, [2**63, 1], "p[0] must be a 64-bit integer", "p[0] must be a 64-bit integer"),
    (INT32, [0, -(2**31) - 1], "p[1] must be a 32-bit integer", "p[1] must be a 32-bit integer"),
])
def test_a_bad_list_is_refused_naming_the_item(inner, values, decoded, encoded):
    codec = list_of(inner)
    with pytest.raises(InvalidInputError, match=decoded.replace("[", r"\[").replace("]", r"\]")):
        codec.decode(values, "p")
    if encoded is None:
        assert codec.encode(values, "p") == values
    else:
        with pytest.raises(InvalidInputError,
                           match=encoded.replace("[", r"\[").replace("]", r"\]")):
            codec.encode(values, "p")
