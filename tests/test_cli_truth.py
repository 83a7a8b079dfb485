"""What the command line tells about a run is the truth (§27, issue 35): its log lines' rate and
total, its history after Ctrl-C, the input columns it does not store and `--infer-types`."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest

from runplane.cli import main
from runplane.cli.progress import Rates

from .cli_helpers import (
    ROOT,
    RUNPLANE,
    cli_env,
    run_cli,
    schema,  # noqa: F401 - fixture
    start_cli,
    wait_for_text,
)

TRUTH_PLAY = '''
import os

import trio

from runplane.engine.sheets import SheetContract

PLAY = "truth"
CONTRACT = SheetContract(inputs=("name",), outputs=("size",))
DELAY = float(os.environ.get("ROW_DELAY_S", "0.01"))


async def measure(row):
    await trio.sleep(DELAY)
    return {"size": len(row["name"])}


async def play(run, rows):
    return await run.map("things", rows, measure, contract=CONTRACT, concurrency=2)
'''


def truth_play(tmp_path, rows: int):
    play = tmp_path / "truth_play.py"
    play.write_text(TRUTH_PLAY)
    names = tmp_path / "rows.csv"
    names.write_text("name\n" + "".join(f"n{i}\n" for i in range(rows)))
    return play, names


# -- item 7: log lines ------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rates_are_completions_over_the_last_minute_never_negative():
    clock = Clock()
    rates = Rates(clock=clock)
    assert rates.add(0) == 0.0  # one sample: no rate yet, and no time left from it
    assert Rates.eta(10, 0.0) is None
    rate = None
    for second in range(1, 121):
        clock.now = float(second)
        rate = rates.add(10 * second if second <= 90 else 900)
    # The last minute (60 s .. 120 s) held 300 completions (60 .. 90 s at 10 a second).
    assert rate == 300 / 60
    clock.now = 200.0
    assert rates.add(900) == 0.0  # none in the last minute: 0, and no time left
    clock.now = 201.0
    assert rates.add(850) == 0.0  # a count that went back never reads as a negative rate


def test_a_log_line_shows_the_rate_before_it_and_the_input_length_as_total(schema, tmp_path):
    play, rows = truth_play(tmp_path, 20_000)
    log = tmp_path / "progress.log"
    with log.open("w") as err:
        proc = subprocess.Popen([*RUNPLANE, "run", str(play), "--input", str(rows),
                                 "--schema", schema, "--progress-every", "2.5"],
                                stdout=subprocess.DEVNULL, stderr=err, text=True,
                                env=cli_env(ROW_DELAY_S="0.01"), cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while "progress things:" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    lines = [line for line in log.read_text().splitlines() if line.startswith("progress things:")]
    first = re.fullmatch(r"progress things: ([\d,]+)/([\d,]+) rows \(.*\); ([\d,]+) rows/s, "
                         r"ETA (.+)", lines[0])
    assert first is not None, lines[0]
    settled, total, rate, eta = first.groups()
    assert total == "20,000", lines[0]  # the file's length, not the rows admitted so far
    assert int(settled.replace(",", "")) > 0 and int(rate.replace(",", "")) > 0, lines[0]
    assert eta != "-", lines[0]


# -- item 8: history after Ctrl-C -------------------------------------------------------------
def completed_rows(schema: str) -> int:
    status = run_cli("status", "truth", "--schema", schema, "--json")
    if status.returncode != 0:  # no sheet yet
        return 0
    return json.loads(status.stdout)["tables"].get("things", {}).get("completed", 0)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_runs_history_counts_what_a_rerun_finds_cached(schema, tmp_path, stop):
    play, rows = truth_play(tmp_path, 3000)
    run_log = tmp_path / "run.log"
    runner = start_cli("run", str(play), "--input", str(rows), "--schema", schema,
                       "--progress-every", "0.5", stdout_path=run_log,
                       env=cli_env(ROW_DELAY_S="0.005"))
    try:
        wait_for_text(run_log, "input rows", runner)
        deadline = time.monotonic() + 60
        while completed_rows(schema) < 200:  # some rows written: interrupt it mid-map
            assert runner.poll() is None and time.monotonic() < deadline
    finally:
        runner.send_signal(stop)
        assert runner.wait(timeout=60) == 130, runner.stderr.read()
    runs = json.loads(run_cli("runs", "truth", "--schema", schema, "--json").stdout)["runs"]
    assert len(runs) == 1
    interrupted = runs[0]
    rerun = run_cli("run", str(play), "--input", str(rows), "--schema", schema, "--json",
                    env=cli_env(ROW_DELAY_S="0"))
    assert rerun.returncode == 0, rerun.stderr
    cached = json.loads(rerun.stdout)["result"]["cached"]
    assert 0 < cached < 3000
    assert interrupted["completed"] == cached, (interrupted, cached)


# -- item 10: input columns not stored, --infer-types -----------------------------------------
TYPED_PLAY = '''
from runplane.engine.sheets import SheetContract

PLAY = "typed"
CONTRACT = SheetContract(inputs=("id", "n", "flag", "zip", "blank", "word"), outputs=("kinds",))


async def kinds(row):
    return {"kinds": [type(row[name]).__name__ for name in CONTRACT.inputs]}


async def play(run, rows):
    return await run.map("cells", rows, kinds, contract=CONTRACT)
'''

TYPED_CSV = ("id,n,flag,zip,blank,word,note,extra\n"
             "1,-3.5,true,007,,abc,a note,x\n"
             "2,1e3,false,00.5,,TRUE,,\n")


def exported(schema: str, capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["export", "typed", "cells", "--schema", schema]) == 0
    return sorted((json.loads(line) for line in capsys.readouterr().out.splitlines()),
                  key=lambda row: str(row["id"]))


def test_run_names_the_input_columns_no_contract_stores_before_it_starts(schema, capsys,
                                                                           tmp_path):
    play, rows = tmp_path / "typed_play.py", tmp_path / "typed.csv"
    play.write_text(TYPED_PLAY)
    rows.write_text(TYPED_CSV)
    assert main(["run", str(play), "--input", str(rows), "--schema", schema]) == 0
    out = capsys.readouterr().out.splitlines()
    named = [line for line in out if "not stored" in line]
    assert named == [f"{rows}: 2 columns not stored (no contract of {play} names them as "
                     "inputs): note, extra"], out
    assert out[0] == named[0]  # before the run starts (and registers)
    jsonl = tmp_path / "typed.jsonl"
    jsonl.write_text('{"id": 1, "n": 2, "zip": "1", "flag": true, "blank": null, "word": "w", '
                     '"why": 1}\n')
    assert main(["run", str(play), "--input", str(jsonl), "--schema", schema]) == 0
    assert (f"{jsonl}: 1 column not stored (no contract of {play} names them as inputs): why"
            in capsys.readouterr().out.splitlines())


def test_infer_types_reads_numbers_booleans_and_empty_cells_and_keeps_007_as_text(
        schema, capsys, tmp_path):
    play, rows = tmp_path / "typed_play.py", tmp_path / "typed.csv"
    play.write_text(TYPED_PLAY)
    rows.write_text(TYPED_CSV)
    assert main(["run", str(play), "--input", str(rows), "--schema", schema]) == 0
    assert [row["kinds"] for row in exported(schema, capsys)] == [["str"] * 6] * 2  # default
    # Typed inputs are other rows (other keys): the sheet then holds both readings.
    assert main(["run", str(play), "--input", str(rows), "--schema", schema,
                 "--infer-types"]) == 0
    typed = [row for row in exported(schema, capsys) if not isinstance(row["id"], str)]
    assert [(row["id"], row["n"], row["flag"], row["zip"], row["blank"], row["word"])
            for row in typed] == [(1, -3.5, True, "007", None, "abc"),
                                  (2, 1000, False, "00.5", None, "TRUE")]
    assert typed[0]["kinds"] == ["int", "float", "bool", "str", "NoneType", "str"]
