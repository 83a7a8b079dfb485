"""`runplane psql`: the README's recipe, on the embedded default, kept up while psql runs."""

from __future__ import annotations

import re
import shlex
import time

from runplane.engine.embedded import embedded_server

from .cli_helpers import ROOT, cli_env, run_cli, write_play


def readme_psql_command() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Connecting with psql", 1)[1]
    line = re.search(r"^runplane psql -- .+$", section, re.MULTILINE).group(0)
    return shlex.split(line)[1:]


def test_the_readme_psql_recipe_works_on_the_embedded_default(tmp_path):
    home = tmp_path / "home"
    env = cli_env(RUNPLANE_HOME=str(home))
    env.pop("RUNPLANE_DSN", None)
    play, rows = write_play(tmp_path, ["a", "bad1", "bb"])
    done = run_cli("run", str(play), "--input", str(rows), env=env)
    assert done.returncode == 0, done.stderr
    wait_until_stopped(home / "pg")  # the run ended: nothing keeps the server up

    # The README's line as written: psql gets a server that stays up for its session, and the
    # tenant's tables without a schema prefix.
    words = readme_psql_command()
    session = run_cli(*words, "-XA", "-F", ",", env=env)
    assert session.returncode == 0, session.stderr
    assert re.search(r"^[0-9a-f-]+,things,finished,3,2,1$", session.stdout, re.MULTILINE), \
        session.stdout
    failing = run_cli("psql", "--", "-Xc", "SELECT 1/0", env=env)
    assert failing.returncode != 0 and "division by zero" in failing.stderr  # psql's status
    wait_until_stopped(home / "pg")  # the last user left: the server stopped


def wait_until_stopped(pgdata) -> None:
    deadline = time.monotonic() + 30
    while embedded_server(pgdata) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert embedded_server(pgdata) is None
