"""Failed rows' errors grouped by cause: the masking (a pure function) and `runplane failures`."""

from __future__ import annotations

import json

from runplane.cli.causes import ErrorCause, error_pattern, group_errors

from .cli_helpers import run_cli, schema  # noqa: F401 - fixture


def test_row_specific_parts_are_masked_and_the_cause_is_kept():
    assert error_pattern("no data for r13") == "no data for rN"
    assert error_pattern("timed out after 2.5 s") == "timed out after N.N s"
    assert error_pattern("missing column 'iata' in row 7") == "missing column '…' in row N"
    assert error_pattern("'iata'") == "'iata'"  # a KeyError's message: the key is the cause
    assert error_pattern('unknown airport "Bangor Intl"') == 'unknown airport "…"'
    assert error_pattern("row 0f3a9c2b7d1e4f5a6b7c8d9e0f1a2b3c failed") == "row <key> failed"
    assert (error_pattern("run 01a2321b-6c4d-7e8f-9a0b-1c2d3e4f5a6b fenced")
            == "run <id> fenced")
    assert error_pattern(None) == "(no message)"
    # The cause's own words stay: two types, or two texts, are two causes.
    assert error_pattern("ValueError: bad") != error_pattern("TypeError: bad")
    assert error_pattern("quota exceeded") != error_pattern("quota reset")


def test_messages_fold_into_causes_with_one_example_each():
    causes = group_errors([
        ("no data for r13", 1), ("no data for r7", 3), ("no data for r2", 1),
        ("quota exceeded", 4), (None, 1),
    ])
    assert causes == [
        ErrorCause("no data for rN", 5, 3, "no data for r7"),  # the commonest message is shown
        ErrorCause("quota exceeded", 4, 1, "quota exceeded"),
        ErrorCause("(no message)", 1, 1, None),
    ]
    assert group_errors([]) == []


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
