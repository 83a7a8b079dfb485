"""`runplane serve`, `runplane token` and a runner pointed at a gateway: two processes, the
runner with no DSN and no way to reach the database."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import trio

from runplane.cli import main
from runplane.engine import open_tenant
from runplane.engine.gateway import verify_token

from .conftest import fresh_schema
from .test_cli import demo_line

SECRET = "cli-gateway-secret-" + "q" * 24


def test_serve_refuses_to_start_without_a_secret(monkeypatch, capsys):
    monkeypatch.delenv("RUNPLANE_GATEWAY_SECRET", raising=False)
    assert main(["serve", "--bind", "127.0.0.1:0"]) == 2
    assert "RUNPLANE_GATEWAY_SECRET is not set" in capsys.readouterr().err
    assert main(["token", "--org", "acme"]) == 2


def test_token_prints_a_token_with_the_asked_claims(monkeypatch, capsys):
    monkeypatch.setenv("RUNPLANE_GATEWAY_SECRET", SECRET)
    assert main(["token", "--org", "acme", "--play", "demo", "--action", "sheets.*",
                 "--ttl", "60"]) == 0
    claims = verify_token(SECRET, capsys.readouterr().out.strip())
    assert (claims.org, claims.plays, claims.actions) == ("acme", ("demo",), ("sheets.*",))
    assert claims.exp - claims.iat == 60


@pytest.fixture
def gateway_process(dsn, tmp_path):
    """`runplane serve` in a child process over a fresh schema; yields its URL."""
    schema = fresh_schema()
    env = {**os.environ, "RUNPLANE_GATEWAY_SECRET": SECRET, "RUNPLANE_DSN": dsn}
    child = subprocess.Popen(
        [sys.executable, "-m", "runplane.cli", "serve", "--bind", "127.0.0.1:0",
         "--schema", schema],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = child.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + child.stderr.read()
        yield match.group(1)
    finally:
        child.terminate()
        child.wait(timeout=30)

        async def drop():
            async with open_tenant("local", dsn, schema=schema) as tenant:
                async with tenant.connection("sheet") as conn:
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

        trio.run(drop)


def runner(args: list[str], url: str, token: str, home) -> subprocess.CompletedProcess:
    """A runner process that knows no DSN and whose embedded-server home is empty."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RUNPLANE_DSN", "RUNPLANE_TEST_DSN")}
    env.update(RUNPLANE_GATEWAY_URL=url, RUNPLANE_TOKEN=token, RUNPLANE_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "runplane.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_runner_with_only_a_token_runs_the_main_job_and_sees_the_cache(gateway_process, tmp_path):
    token = subprocess.run(
        [sys.executable, "-m", "runplane.cli", "token", "--org", "local", "--play", "demo"],
        env={**os.environ, "RUNPLANE_GATEWAY_SECRET": SECRET}, capture_output=True, text=True,
        check=True).stdout.strip()
    first = runner(["demo", "--rows", "300", "--fail-rate", "0.05", "--latency-ms", "0"],
                   gateway_process, token, tmp_path)
    assert first.returncode == 0, first.stderr
    done = demo_line(first.stdout)
    assert done["admitted"] == 300 and done["completed"] + done["failed"] == 300
    second = runner(["demo", "--rows", "300", "--latency-ms", "0"], gateway_process, token, tmp_path)
    assert second.returncode == 0, second.stderr
    again = demo_line(second.stdout)
    assert again["cached"] == done["completed"] and again["executed"] == done["failed"]
    status = runner(["status", "demo"], gateway_process, token, tmp_path)
    assert status.returncode == 0, status.stderr
    assert "table companies: total 300" in status.stdout
    assert not (tmp_path / "pg").exists()  # the runner never started a database of its own
    denied = runner(["status", "other-play"], gateway_process, token, tmp_path)
    assert denied.returncode == 1 and "plays claim" in denied.stderr
    assert token not in denied.stderr
