"""Progress of `runplane run` (bars on a terminal, lines in a log), `status --watch` from another
terminal, and the run history of `runplane runs` — through subprocesses, as a user runs them."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import time

from .cli_helpers import (
    RUNPLANE,
    ROOT,
    cli_env,
    run_cli,
    schema,  # noqa: F401 - fixture
    start_cli,
    wait_for_text,
)

SLOW_PLAY = '''
import os

import trio

from runplane.engine.sheets import SheetContract

PLAY = "slow"
CONTRACT = SheetContract(inputs=("name",), outputs=("size",))
DELAY = float(os.environ.get("ROW_DELAY_S", "0.05"))


async def measure(row):
    await trio.sleep(DELAY)
    if row["name"].startswith("bad") and not os.environ.get("FIXED"):
        raise ValueError(f"no size for {row['name']}")
    return {"size": len(row["name"])}


async def play(run, rows):
    return await run.map("things", rows, measure, contract=CONTRACT, concurrency=2)
'''


def slow_play(tmp_path, names: list[str]):
    play = tmp_path / "slow_play.py"
    play.write_text(SLOW_PLAY)
    rows = tmp_path / "rows.csv"
    rows.write_text("name\n" + "".join(f"{name}\n" for name in names))
    return play, rows


def test_a_run_in_a_log_prints_a_progress_line_every_interval(schema, tmp_path):
    play, rows = slow_play(tmp_path, [f"n{i}" for i in range(40)])
    done = run_cli("run", str(play), "--input", str(rows), "--schema", schema,
                   "--progress-every", "0.2")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("progress things:")]
    assert len(lines) >= 2, done.stderr
    assert re.fullmatch(r"progress things: \d+/40 rows \(admitted \d+, running \d+, completed \d+, "
                        r"failed 0, cached 0, retries 0\); [\d,]+ rows/s, ETA .+", lines[0])
    assert lines[-1].startswith("progress things: 40/40 rows (admitted 40, running 0, "
                                "completed 40,")
    assert "progress things" not in done.stdout  # stdout stays the command's


def test_a_run_on_a_terminal_shows_live_bars_on_stderr(schema, tmp_path):
    play, rows = slow_play(tmp_path, [f"n{i}" for i in range(20)])
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*RUNPLANE, "run", str(play), "--input", str(rows),
                             "--schema", schema], stdout=subprocess.PIPE, stderr=follower,
                            text=True, env=cli_env(COLUMNS="160"), cwd=ROOT)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    text = shown.decode(errors="replace")
    assert "things" in text and "━" in text, text  # a rich bar, on the terminal (stderr)
    assert "20/20" in text and "completed 20" in text, text
    assert "━" not in out and "admitted 20, cached 0, completed 20" in out


def test_status_watch_shows_rows_in_flight_with_rate_and_eta(schema, tmp_path):
    play, rows = slow_play(tmp_path, [f"n{i}" for i in range(80)])
    run_log = tmp_path / "run.log"
    runner = start_cli("run", str(play), "--input", str(rows), "--schema", schema,
                       stdout_path=run_log, env=cli_env(ROW_DELAY_S="0.2"))
    watch_log = tmp_path / "watch.log"
    watcher = None
    try:
        wait_for_text(run_log, "input rows", runner)
        watcher = start_cli("status", "slow", "--schema", schema, "--watch",
                            stdout_path=watch_log, env=cli_env())
        seen = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            seen = watch_log.read_text()
            if re.search(r"running [1-9]\d*, leased \d+, completed \d+, failed 0; "
                         r"[\d.,]*[1-9][\d.,]* "
                         r"rows/s, ETA \d", seen):  # in flight, a rate and a time left
                break
            time.sleep(0.2)
        else:
            raise AssertionError(seen)
        assert seen.count("(Ctrl-C to stop)") >= 2, seen  # it refreshes by itself
    finally:
        runner.wait(timeout=120)
        if watcher is not None:
            watcher.send_signal(signal.SIGINT)
    assert watcher.wait(timeout=30) == 0, watcher.stderr.read()
    assert watcher.stderr.read() == ""
    final = json.loads(run_cli("status", "slow", "--schema", schema, "--json").stdout)
    assert final["tables"]["things"]["running"] == 0  # nothing in flight once the run ended
    assert final["tables"]["things"]["completed"] == 80


def test_runs_keeps_what_each_run_did_and_shows_one_in_detail(schema, tmp_path):
    play, rows = slow_play(tmp_path, ["a", "bad1", "bb", "bad2", "ccc"])
    first = run_cli("run", str(play), "--input", str(rows), "--schema", schema, "--json",
                    env=cli_env(ROW_DELAY_S="0"))
    fixed = run_cli("run", str(play), "--input", str(rows), "--schema", schema, "--json",
                    env=cli_env(ROW_DELAY_S="0", FIXED="1"))
    first_id, fixed_id = (json.loads(done.stdout)["run_id"] for done in (first, fixed))
    listing = run_cli("runs", "slow", "--schema", schema)
    assert listing.returncode == 0, listing.stderr
    # The first run still reads as what it did (2 failed), after the second fixed those rows.
    assert re.search(rf"^{first_id} .* done +\S+ s +5 +0 +3 +2 +0 +0$", listing.stdout,
                     re.MULTILINE), listing.stdout
    assert re.search(rf"^{fixed_id} .* done +\S+ s +5 +3 +2 +0 +0 +0$", listing.stdout,
                     re.MULTILINE), listing.stdout
    documents = json.loads(run_cli("runs", "slow", "--schema", schema, "--json").stdout)
    by_id = {run["run_id"]: run for run in documents["runs"]}
    assert (by_id[first_id]["failed"], by_id[fixed_id]["completed"]) == (2, 2)

    detail = run_cli("runs", "slow", first_id, "--schema", schema)
    assert detail.returncode == 0, detail.stderr
    assert detail.stdout.startswith(f"run {first_id} of play slow: done, epoch ")
    assert re.search(r"^  map-0 +things +finished +5 +0 +3 +2 +0 +0 +\S+ s$", detail.stdout,
                     re.MULTILINE), detail.stdout
    one = json.loads(run_cli("runs", "slow", first_id, "--schema", schema, "--json").stdout)
    assert one["maps"][0]["failed"] == 2 and one["maps"][0]["duration_s"] >= 0
    missing = run_cli("runs", "slow", "nope", "--schema", schema)
    assert (missing.returncode, missing.stderr) == (1, "runplane: play 'slow' has no run 'nope'\n")
