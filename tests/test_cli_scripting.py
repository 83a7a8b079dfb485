"""The command line in scripts: exit statuses, streams, `--json`, `--version`, closed pipes,
repeated Ctrl-C — each through a subprocess, as a user's shell runs it."""

from __future__ import annotations

import json
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
    write_play,
)


def test_a_simulated_crash_exits_1_with_the_resume_command_on_stderr(schema):
    done = run_cli("demo", "--rows", "200", "--schema", schema, "--fail-rate", "0",
                   "--concurrency", "4", "--crash-after", "50")
    assert done.returncode == 1, done
    run_id = re.search(r"demo: crashed after \d+ executed rows \(simulated\); run id (\S+)",
                       done.stdout).group(1)
    resume = (f"runplane demo --rows 200 --schema {schema} --fail-rate 0 --concurrency 4 "
              f"--resume {run_id}")
    assert f"runplane: resume run {run_id} with: {resume}\n" in done.stderr, done.stderr
    assert "resume with" not in done.stdout  # the resume hint belongs to stderr
    again = run_cli(*resume.split()[1:])
    assert again.returncode == 0, again.stderr


def test_a_run_without_input_says_so_and_exits_2(schema, tmp_path):
    play, _ = write_play(tmp_path, ["a"])
    done = run_cli("run", str(play), "--schema", schema)
    assert done.returncode == 2
    assert done.stderr.startswith("runplane: no input: pass --input FILE.csv|.jsonl"), done.stderr
    assert "started" not in done.stdout  # no run was opened
    assert run_cli("run", str(play), "--schema", schema, "--no-input").returncode == 0


def test_json_documents_of_run_status_runs_and_failures(schema, tmp_path):
    play, rows = write_play(tmp_path, ["a", "bad1", "bb"])
    done = run_cli("run", str(play), "--input", str(rows), "--schema", schema, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # stdout is one JSON document, nothing else
    run_id = document["run_id"]
    assert document["result"]["completed"] == 2 and document["result"]["failed"] == 1
    assert document["failed_rows"] == 1 and document["status"] == "finished"
    assert f"run {run_id} of play ops started" in done.stderr  # human lines went to stderr

    status = json.loads(run_cli("status", "ops", "--schema", schema, "--json").stdout)
    assert status["tables"]["things"]["completed"] == 2
    assert status["tables"]["things"]["columns"]["size"] == {"completed": 2, "failed": 1}
    assert [entry["run_id"] for entry in status["runs"]] == [run_id]

    runs = json.loads(run_cli("runs", "ops", "--schema", schema, "--json").stdout)
    assert runs["runs"][0]["run_id"] == run_id and runs["runs"][0]["failed"] == 1

    failures = json.loads(run_cli("failures", "ops", "things", "--schema", schema,
                                  "--json").stdout)
    assert failures["failed"] == 1
    assert failures["rows"][0]["inputs"] == {"name": "bad1"}
    assert failures["errors"] == [{"count": 1, "error": "quota exceeded", "pattern": "quota exceeded",
                                   "variants": 1}]


def test_an_unfinished_run_with_json_still_prints_one_document(schema, tmp_path):
    play, rows = write_play(tmp_path, ["a"])
    done = run_cli("run", str(play), "--input", str(rows), "--schema", schema, "--json",
                   env=cli_env(PLAY_STORE_FAILS="1"))
    assert done.returncode == 1
    document = json.loads(done.stdout)
    assert document["status"] == "unfinished" and "--run-id" in document["resume_command"]


def test_version():
    done = run_cli("--version")
    assert done.returncode == 0 and re.fullmatch(r"runplane \S+\n", done.stdout), done


def run_with_stdout_closed(*args: str, env=None) -> subprocess.CompletedProcess:
    """Run the CLI with a reader that went away before the first line (`| head -0`)."""
    proc = subprocess.Popen([*RUNPLANE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env or cli_env(), cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read()
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=120), "", err)


def test_a_closed_pipe_ends_quietly_and_a_run_still_finishes(schema, tmp_path):
    play, rows = write_play(tmp_path, ["a", "bb", "ccc"])
    done = run_with_stdout_closed("run", str(play), "--input", str(rows), "--schema", schema)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no "Broken pipe", no resume hint as if the run had failed
    status = run_with_stdout_closed("status", "ops", "--schema", schema)
    assert (status.returncode, status.stderr) == (0, "")
    assert "completed 3, failed 0" in run_cli("status", "ops", "--schema", schema).stdout


def test_repeated_ctrl_c_prints_no_traceback(schema, tmp_path):
    play, rows = write_play(tmp_path, ["a", "bb"])
    log = tmp_path / "out.log"
    proc = start_cli("run", str(play), "--input", str(rows), "--schema", schema,
                     stdout_path=log, env=cli_env(PLAY_HOLD="1"))
    wait_for_text(log, "held", proc)
    for _ in range(3):
        try:
            proc.send_signal(signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "runplane: interrupted" in err and "resume run" in err


BROKEN_PLAY = '''
import threading

from runplane.engine.sheets import SheetContract

PLAY = "broken"
CONTRACT = SheetContract(inputs=("name",), outputs=("size",))


def measure(row):  # a plain def: it runs in a worker thread
    assert threading.current_thread() is not threading.main_thread()
    if row["name"].startswith("x"):
        return len(row["name"])  # a bad return value: not a dict
    return {"size": len(row["name"])}


async def play(run, rows):
    return await run.map("things", rows, measure, contract=CONTRACT, concurrency=4)
'''


def test_a_plain_function_runs_and_a_function_broken_for_every_row_stops_early(schema, tmp_path):
    play = tmp_path / "broken_play.py"
    play.write_text(BROKEN_PLAY)
    good = tmp_path / "good.csv"
    good.write_text("name\n" + "".join(f"n{i}\n" for i in range(30)))
    done = run_cli("run", str(play), "--input", str(good), "--schema", schema)
    assert done.returncode == 0, done.stderr
    assert "completed 30, failed 0" in done.stdout

    bad = tmp_path / "bad.csv"
    bad.write_text("name\n" + "".join(f"x{i}\n" for i in range(300)))
    done = run_cli("run", str(play), "--input", str(bad), "--schema", schema)
    assert done.returncode == 1, done
    assert done.stderr.count("stopped early") == 1, done.stderr
    assert ("runplane: map things stopped early: the first 20 rows all failed with map "
            "function returned int, expected a dict of outputs") in done.stderr
    assert "resume" not in done.stderr  # the run finished; the next run runs the rows left
    assert "(top " not in done.stdout  # the error is shown once, not as a table
    status = run_cli("status", "broken", "things", "--schema", schema, "--json")
    table = json.loads(status.stdout)["tables"]["things"]
    assert table["total"] == 330 and table["completed"] == 30 and table["failed"] < 100
