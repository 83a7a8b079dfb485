"""Failed rows' errors grouped by cause: the masking (a pure function, `engine.sheets.causes`)
and `runplane failures`."""

from __future__ import annotations

import json

from runplane.engine.sheets.causes import (MAX_CAUSE_BYTES, CauseCount, ErrorCause, cause_of,
                                          group_causes)

from .cli_helpers import run_cli, schema  # noqa: F401 - fixture


def test_row_specific_parts_are_masked_and_the_cause_is_kept():
    assert cause_of("no data for r13") == "no data for rN"
    assert cause_of("timed out after 2.5 s") == "timed out after N.N s"
    assert cause_of("missing column 'iata' in row 7") == "missing column '…' in row N"
    assert cause_of("'iata'") == "'iata'"  # a KeyError's message: the key is the cause
    assert cause_of('unknown airport "Bangor Intl"') == 'unknown airport "…"'
    assert cause_of("row 0f3a9c2b7d1e4f5a6b7c8d9e0f1a2b3c failed") == "row <key> failed"
    assert (cause_of("run 01a2321b-6c4d-7e8f-9a0b-1c2d3e4f5a6b fenced")
            == "run <id> fenced")
    assert cause_of(None) == "(no message)"
    # The cause's own words stay: two types, or two texts, are two causes.
    assert cause_of("ValueError: bad") != cause_of("TypeError: bad")
    assert cause_of("quota exceeded") != cause_of("quota reset")


def test_messages_fold_into_causes_with_one_example_each():
    causes = group_causes([
        CauseCount(None, "no data for r13", 1), CauseCount(None, "no data for r7", 3),
        CauseCount(None, "no data for r2", 1), CauseCount(None, "quota exceeded", 4),
        CauseCount(None, None, 1),
    ])
    assert causes == [
        ErrorCause("no data for rN", 5, 3, "no data for r7"),  # the commonest message is shown
        ErrorCause("quota exceeded", 4, 1, "quota exceeded"),
        ErrorCause("(no message)", 1, 1, None),
    ]
    assert group_causes([]) == []


def test_the_rows_own_input_values_are_masked_as_whole_tokens():
    row = {"iata": "BGR", "city": "New York", "n": "ab", "size": 1234, "seen": None}
    assert cause_of("geo API: quota exceeded for BGR", row) == "geo API: quota exceeded for <iata>"
    assert (cause_of("geo API: quota exceeded for LAX", {"iata": "LAX"})
            == cause_of("geo API: quota exceeded for BGR", {"iata": "BGR"}))
    # Whole tokens only: inside a longer word (or beside a letter or digit) it stays.
    assert cause_of("BGRX and xBGR and BGR_1", row) == "BGRX and xBGR and BGR_N"
    assert cause_of("(BGR), BGR.", row) == "(<iata>), <iata>."
    # A value of several words is one token; the longest value wins over a shorter one.
    assert (cause_of("no flights to New York", {"a": "York", "b": "New York"})
            == "no flights to <b>")
    # Values under 3 characters are not masked: they would eat the message's own words.
    assert cause_of("ab test failed", row) == "ab test failed"
    # Numbers are the digit rule's (one placeholder whatever the row), not the input rule's.
    assert cause_of("size 1234 too big", row) == "size N too big"
    # Another row's value is not masked; this row's is, wherever it sits.
    assert cause_of("unknown code BGR", {"iata": "LAX"}) == "unknown code BGR"
    # A value holding digits is masked whole, before the digit rule.
    assert cause_of("no seats on A320", {"model": "A320"}) == "no seats on <model>"
    # A KeyError's message (its quoted key): the row's own value as the key is masked too.
    assert cause_of("'BGR'", row) == "'<iata>'"
    assert cause_of("'iata'", row) == "'iata'"
    # Quotes, UUIDs, long hex and digits are masked as before, with or without inputs.
    assert cause_of("missing 'BGR' in 7", row) == "missing '…' in N"
    assert (cause_of("run 01a2321b-6c4d-7e8f-9a0b-1c2d3e4f5a6b key 0f3a9c2b7d1e4f5a6b7c8d9e0f1a2b3c",
                     row) == "run <id> key <key>")
    assert cause_of("ValueError: BGR", row) != cause_of("TypeError: BGR", row)
    # Nested values are not scalars; booleans are, as `str` writes them.
    assert cause_of("flag True for [1]", {"flag": True, "xs": ["flag"]}) == "flag <flag> for [N]"


def test_a_cause_is_bounded_for_its_index():
    long = cause_of("é" * 1000)
    assert len(long.encode("utf-8")) <= MAX_CAUSE_BYTES and long == "é" * (MAX_CAUSE_BYTES // 2)
    assert cause_of("x" * 100) == "x" * 100


def test_stored_causes_and_messages_without_one_fold_together():
    causes = group_causes([
        CauseCount("quota exceeded for <iata>", None, 150, 150, "quota exceeded for BGR"),
        CauseCount(None, "no data for r1", 2),  # failed before causes were stored
        CauseCount("no data for rN", None, 3, 2, "no data for r9"),
    ])
    assert causes == [
        ErrorCause("quota exceeded for <iata>", 150, 150, "quota exceeded for BGR"),
        ErrorCause("no data for rN", 5, 3, "no data for r9"),
    ]


PLAY = '''
from runplane.engine.sheets import SheetContract

CONTRACT = SheetContract(inputs=("code",), outputs=("name",))


async def lookup(row):
    if row["code"].startswith("x"):
        raise KeyError(f"unknown airport code {row['code']!r} in row {row['code'][1:]}")
    return {"name": row["code"].upper()}


async def play(run, rows):
    return await run.map("airports", rows, lookup, contract=CONTRACT, fail_fast=False)
'''


def test_failures_shows_one_line_per_cause(schema, tmp_path):
    play = tmp_path / "airports.py"
    play.write_text(PLAY)
    rows = tmp_path / "codes.csv"
    rows.write_text("code\n" + "".join(f"x{i}\n" for i in range(12)) + "bgr\n")
    done = run_cli("run", str(play), "--input", str(rows), "--schema", schema)
    assert done.returncode == 0, done.stderr
    assert "12 failed rows in table airports, 1 cause (top 1):" in done.stdout, done.stdout
    shown = run_cli("failures", "airports", "airports", "--schema", schema)
    assert "most common errors (1 cause, top 1):" in shown.stdout, shown.stdout
    line = [line for line in shown.stdout.splitlines() if "(+11 like it)" in line]
    assert len(line) == 1 and line[0].lstrip().startswith("12  "), shown.stdout
    assert "unknown airport code 'x" in line[0]
    document = json.loads(run_cli("failures", "airports", "airports", "--schema", schema,
                                  "--json").stdout)
    assert [(e["count"], e["variants"], e["pattern"]) for e in document["errors"]] == [
        (12, 12, "\"unknown airport code '…' in row N\"")]
