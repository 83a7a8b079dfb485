"""The operators' view: failed rows, run ids that are never lost, `runs`, waking."""

from __future__ import annotations

import re
import signal

from runplane.cli import main

from .cli_helpers import (
    cli_env,
    pasted,
    schema,  # noqa: F401 - fixture
    start_cli,
    wait_for_text,
    write_play,
)

START = re.compile(r"^run (\S+) of play ops started \(epoch (\d+)\); to resume it: (runplane .+)$",
                   re.MULTILINE)


def started(out: str) -> tuple[str, str]:
    match = START.search(out)
    assert match, out
    return match.group(1), match.group(3)


def test_failed_rows_end_the_run_with_the_top_errors_and_failures_lists_them(
        schema, capsys, tmp_path):
    play, rows = write_play(tmp_path, ["a", "bad1", "bb", "bad2", "slow1"])
    args = ["run", str(play), "--input", str(rows), "--schema", schema]
    assert main(args) == 0
    out = capsys.readouterr().out
    first, _ = started(out)
    assert "admitted 5, cached 0, completed 2, failed 3, blocked 0, fenced 0" in out
    assert "3 failed rows in table things, 2 causes (top 2):" in out
    assert re.search(r"^  count  error\n      2  quota exceeded\n      1  timed out after 2 s$",
                     out, re.MULTILINE), out
    assert f"  see them: runplane failures ops things --run {first}" in out
    # Column counters add up with the table's: a failed row's output cells count as failed.
    assert main(["status", "ops", "things", "--schema", schema]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == [
        "table things: total 5, queued 0, running 0, leased 0, completed 2, failed 3",
        "  column shout: completed 2, failed 3",
        "  column size: completed 2, failed 3",
    ]
    # The failed rows run again, fail again, and now the exit status says so.
    assert main([*args, "--fail-on-row-errors"]) == 3
    second, _ = started(capsys.readouterr().out)

    assert main(["failures", "ops", "things", "--schema", schema]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 failed rows in table things of play ops:\n"), out
    assert re.search(r"^  key +attempts +error +inputs$", out, re.MULTILINE), out
    for name, error in (("bad1", "quota exceeded"), ("bad2", "quota exceeded"),
                        ("slow1", "timed out after 2 s")):
        assert re.search(rf"^  [0-9a-f]+ +\S+ +{error} +{{\"name\": \"{name}\"}}$", out,
                         re.MULTILINE), out
    assert "most common errors (2 causes, top 2):" in out
    assert main(["failures", "ops", "things", "--schema", schema, "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 failed rows in table things of play ops (first 1):\n"), out
    assert '{"name": "bad1"}' in out and "bad2" not in out.split("most common")[0]
    # The second run re-ran (and failed) those rows: they are its rows now, none the first's.
    assert main(["failures", "ops", "things", "--schema", schema, "--run", second]) == 0
    assert capsys.readouterr().out.startswith(f"3 failed rows of run {second} in table things")
    assert main(["failures", "ops", "things", "--schema", schema, "--run", first]) == 0
    assert capsys.readouterr().out == f"no failed rows of run {first} in table things of play ops\n"
    assert main(["failures", "ops", "nothing", "--schema", schema]) == 1
    assert capsys.readouterr().err == "runplane: play 'ops' has no table 'nothing'\n"


def test_the_demo_ends_with_the_top_errors_and_fail_on_row_errors_exits_3(schema, capsys):
    args = ["demo", "--rows", "60", "--schema", schema, "--fail-rate", "1", "--latency-ms", "0"]
    assert main([*args, "--fail-on-row-errors"]) == 3
    out = capsys.readouterr().out
    assert "60 failed rows in table companies, 1 cause (top 1):" in out
    assert re.search(r"^     60  enrichment API timed out$", out, re.MULTILINE), out


def test_a_run_id_survives_kill_9_and_its_resume_command_finishes_the_run(schema, tmp_path,
                                                                         capsys):
    play, rows = write_play(tmp_path, ["a", "bb", "ccc", "dddd"])
    log = tmp_path / "run.log"
    proc = start_cli("run", str(play), "--input", str(rows), "--schema", schema,
                     stdout_path=log, env=cli_env(PLAY_HOLD="1"))
    try:
        content = wait_for_text(log, "held", proc)
    finally:
        proc.kill()
        proc.wait()
    run_id, command = started(content)
    assert command == (f"runplane run {play} --input {rows} --schema {schema} --run-id {run_id}")

    assert main(["runs", "ops", "--schema", schema]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"run id +epoch +started +state +took +admitted +cached +completed +failed "
                    r"+retried +unfinished$", lines[0])
    assert re.match(rf"{run_id} +\d+ +\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d +open +\S+ s +4 +0 +4 +0 +0 +0$",
                    lines[1]), lines
    assert lines[2] == f"resume {run_id}: {command}"

    import subprocess

    resumed = subprocess.run(pasted(command), capture_output=True, text=True, env=cli_env(),
                             timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert started(resumed.stdout)[0] == run_id
    assert "admitted 4, cached 4, completed 0, failed 0" in resumed.stdout
    assert main(["runs", "ops", "--schema", schema]) == 0
    listing = capsys.readouterr().out
    assert re.search(rf"^{run_id} +\d+ +\S+ \S+ +done +\S+ s +4 +4 +0 +0 +0 +0$", listing,
                     re.MULTILINE), listing  # the wake's own counts: every row was cached
    assert "resume" not in listing


def test_sigterm_and_a_store_failure_print_the_resume_command(schema, tmp_path, capsys,
                                                               monkeypatch):
    play, rows = write_play(tmp_path, ["a", "bb"])
    log = tmp_path / "run.log"
    proc = start_cli("run", str(play), "--input", str(rows), "--schema", schema,
                     stdout_path=log, env=cli_env(PLAY_HOLD="1"))
    try:
        content = wait_for_text(log, "held", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run_id, command = started(content)
    assert err == (f"runplane: interrupted\n"
                   f"runplane: resume run {run_id} with: {command}\n")

    monkeypatch.setenv("PLAY_STORE_FAILS", "1")
    assert main(["run", str(play), "--input", str(rows), "--schema", schema]) == 1
    captured = capsys.readouterr()
    run_id, command = started(captured.out)
    assert captured.err == (
        "runplane: StoreUnavailableError: the store went away (simulated)\n"
        f"runplane: resume run {run_id} with: {command}\n")


def test_run_id_wakes_existing_runs_only_and_a_finished_run_wakes_all_cached(
        schema, capsys, tmp_path):
    play, rows = write_play(tmp_path, ["a", "bb", "ccc"])
    args = ["run", str(play), "--input", str(rows), "--schema", schema]
    assert main([*args, "--run-id", "typo"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("runplane: no run 'typo' of play 'ops' to wake "
                            "(`--new-run-id typo` starts a new run with that id)\n")
    assert main(["runs", "ops", "--schema", schema]) == 1  # nothing was registered
    assert capsys.readouterr().err == "runplane: play 'ops' has no runs\n"

    assert main([*args, "--new-run-id", "nightly"]) == 0
    out = capsys.readouterr().out
    assert started(out)[0] == "nightly"
    assert "admitted 3, cached 0, completed 3" in out
    assert main([*args, "--new-run-id", "nightly"]) == 2
    assert capsys.readouterr().err == ("runplane: run 'nightly' of play 'ops' already exists "
                                       "(`--run-id nightly` wakes it)\n")
    # The run finished and retired its staged input: waking it is not an error, every row is
    # a cache hit, and the run ends done as it did.
    assert main([*args, "--run-id", "nightly"]) == 0
    out = capsys.readouterr().out
    assert started(out)[0] == "nightly"
    assert "admitted 3, cached 3, completed 0, failed 0" in out
    assert main(["runs", "ops", "--schema", schema]) == 0
    assert re.search(r"^nightly +\d+ +\S+ \S+ +done +\S+ s +3 +3 +0 +0 +0 +0$",
                     capsys.readouterr().out, re.MULTILINE)


def test_ctrl_c_in_the_demo_prints_a_resume_command_that_finishes_with_cache_hits(
        schema, dsn, tmp_path):
    import subprocess

    import trio

    from runplane.engine import PlayScope, open_tenant, sheets

    log = tmp_path / "demo.log"
    proc = start_cli("demo", "--rows", "1000", "--schema", schema, "--fail-rate", "0",
                     "--latency-ms", "50", "--concurrency", "4", stdout_path=log, env=cli_env())

    scope = PlayScope("local", "demo")

    async def enriched() -> int:
        async with open_tenant("local", dsn, schema=schema, bootstrap=False) as tenant:
            return (await sheets.summary(tenant, scope, "companies")).completed

    async def wait_for_rows() -> None:
        async with open_tenant("local", dsn, schema=schema, bootstrap=False) as tenant:
            with trio.fail_after(120):
                while (await sheets.summary(tenant, scope, "companies")).completed < 20:
                    await trio.sleep(0.1)

    try:
        wait_for_text(log, "to resume it:", proc)
        trio.run(wait_for_rows)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run_id = re.search(r"^run (\S+) of play demo started", log.read_text(), re.MULTILINE).group(1)
    lines = err.splitlines()
    assert lines[0] == "runplane: interrupted", err
    prefix = f"runplane: resume run {run_id} with: "
    assert lines[1].startswith(prefix) and len(lines) == 2, err
    finished = trio.run(enriched)
    assert 20 <= finished < 1000
    # Pasted (made fast: later options win), it finishes the run; finished rows are cache hits.
    resumed = subprocess.run([*pasted(lines[1][len(prefix):]), "--latency-ms", "0",
                              "--concurrency", "32"], capture_output=True, text=True,
                             env=cli_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert (f"demo: run {run_id} admitted 1000 cached {finished} executed {1000 - finished} "
            f"completed {1000 - finished} failed 0") in resumed.stdout
