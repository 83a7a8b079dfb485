"""The runplane command line: demo (cache, crash and resume), run, status, supervise, errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from runplane.cli import main
from runplane.engine import open_tenant

from .conftest import fresh_schema

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def schema(dsn, monkeypatch):
    """A fresh schema for the CLI, reached through RUNPLANE_DSN; dropped afterwards."""
    name = fresh_schema()
    monkeypatch.setenv("RUNPLANE_DSN", dsn)
    yield name

    async def drop():
        async with open_tenant("local", dsn, schema=name) as tenant:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')

    trio.run(drop)


def demo_line(out: str) -> dict[str, int | str]:
    match = re.search(r"demo: run (\S+) admitted (\d+) cached (\d+) executed (\d+) "
                      r"completed (\d+) failed (\d+)", out)
    assert match, out
    keys = ("run", "admitted", "cached", "executed", "completed", "failed")
    return {k: (v if k == "run" else int(v)) for k, v in zip(keys, match.groups())}


def test_demo_runs_and_a_rerun_shows_the_cache(schema, capsys):
    assert main(["demo", "--rows", "200", "--schema", schema, "--fail-rate", "0.05"]) == 0
    first = demo_line(capsys.readouterr().out)
    assert first["admitted"] == 200 and first["executed"] == 200
    assert first["completed"] + first["failed"] == 200
    assert main(["demo", "--rows", "200", "--schema", schema, "--fail-rate", "0"]) == 0
    second = demo_line(capsys.readouterr().out)
    assert second["run"] != first["run"]
    assert second["cached"] == first["completed"]
    assert second["executed"] == first["failed"] and second["failed"] == 0


def test_demo_crash_after_then_resume_does_not_redo_rows(schema, capsys):
    args = ["demo", "--rows", "300", "--schema", schema, "--fail-rate", "0", "--concurrency", "8"]
    assert main([*args, "--crash-after", "100"]) == 1  # a run that ends unfinished
    captured = capsys.readouterr()
    out = captured.out
    match = re.search(r"demo: crashed after (\d+) executed rows \(simulated\); run id (\S+)", out)
    assert match, out
    executed_before, run_id = int(match.group(1)), match.group(2)
    assert 100 <= executed_before < 300
    resume = f"with: runplane demo --rows 300 --schema {schema} --fail-rate 0 " \
             f"--concurrency 8 --resume {run_id}\n"
    assert captured.err.endswith(resume), captured.err
    assert main([*args, "--resume", run_id]) == 0
    resumed = demo_line(capsys.readouterr().out)
    assert resumed["run"] == run_id
    assert resumed["cached"] == executed_before  # everything executed before the crash was kept
    assert resumed["executed"] == 300 - executed_before  # and nothing ran twice
    assert main(["status", "demo", "--schema", schema]) == 0
    status = capsys.readouterr().out
    assert "total 300, queued 0, running 0, leased 0, completed 300, failed 0" in status
    assert f"run {run_id} epoch" in status and "outbox done" in status


def test_resume_of_an_unknown_run_is_one_clear_line(schema, capsys):
    assert main(["demo", "--rows", "10", "--schema", schema, "--resume", "nope"]) == 2
    err = capsys.readouterr().err
    assert err == "runplane: no run 'nope' of play 'demo' to resume\n"


def test_run_a_play_file_with_csv_and_jsonl_input(schema, capsys):
    play = str(ROOT / "examples" / "enrich_companies.py")
    assert main(["run", play, "--input", str(ROOT / "examples" / "companies.csv"),
                 "--schema", schema]) == 0
    out = capsys.readouterr().out
    assert "8 input rows" in out
    assert "admitted 8, cached 0, completed 7, failed 1, blocked 0, fenced 0" in out
    assert main(["run", play, "--input", str(ROOT / "examples" / "companies.jsonl"),
                 "--schema", schema]) == 0
    assert "admitted 3, cached 1, completed 1, failed 1" in capsys.readouterr().out
    assert main(["status", "enrich-companies", "companies", "--schema", schema]) == 0
    out = capsys.readouterr().out
    assert "table companies: total 9, queued 0, running 0, leased 0, completed 8, failed 1" in out
    assert "column tld: completed 8, failed 1" in out  # the failed row's cell counts as failed
    assert main(["status", "enrich-companies", "nope", "--schema", schema]) == 1
    assert capsys.readouterr().err == "runplane: play 'enrich-companies' has no table 'nope'\n"


def test_play_errors_and_bad_files_are_one_line(schema, capsys, tmp_path):
    assert main(["run", str(tmp_path / "missing.py"), "--schema", schema]) == 2
    assert capsys.readouterr().err.strip().endswith("missing.py: no such file")
    no_play = tmp_path / "no_play.py"
    no_play.write_text("x = 1\n")
    assert main(["run", str(no_play), "--schema", schema]) == 2
    assert "defines no `async def play(run, rows)`" in capsys.readouterr().err
    failing = tmp_path / "failing.py"
    failing.write_text("async def play(run, rows):\n    raise ValueError('bad config')\n")
    assert main(["run", str(failing), "--schema", schema, "--no-input"]) == 1
    captured = capsys.readouterr()
    run_id = re.search(r"^run (\S+) of play failing started", captured.out, re.MULTILINE).group(1)
    assert captured.err == (
        "runplane: the play failed: ValueError: bad config\n"
        f"runplane: resume run {run_id} with: runplane run {failing} --schema {schema} "
        f"--no-input --run-id {run_id}\n")
    bad_input = tmp_path / "rows.jsonl"
    bad_input.write_text('{"a": 1}\n[1, 2]\n')
    assert main(["run", str(failing), "--input", str(bad_input), "--schema", schema]) == 2
    assert "rows.jsonl:2: each line must be a JSON object" in capsys.readouterr().err
    assert main(["status", "nothing", "--schema", schema]) == 1
    assert "play 'nothing' has no sheets and no runs" in capsys.readouterr().err


def test_supervise_runs_until_interrupted(schema, dsn):
    env = {**os.environ, "RUNPLANE_DSN": dsn}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runplane.cli", "supervise", "--schema", schema, "--poll", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("supervising org local in schema"), line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert proc.stderr.read().strip() == "runplane: interrupted"
    finally:
        if proc.poll() is None:
            proc.kill()
