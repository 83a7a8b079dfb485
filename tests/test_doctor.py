"""`runplane doctor`: a report when the database is reachable, one line and exit 1 when not."""

from __future__ import annotations

import subprocess
import sys

from .conftest import fresh_schema


def run_doctor(*args: str, env_dsn: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    env.pop("RUNPLANE_DSN", None)
    if env_dsn is not None:
        env["RUNPLANE_DSN"] = env_dsn
    return subprocess.run(
        [sys.executable, "-m", "runplane.cli", "doctor", *args],
        capture_output=True, text=True, env=env, timeout=60,
    )


def test_doctor_reports_version_schema_and_lanes(dsn):
    result = run_doctor("--schema", fresh_schema(), env_dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert "PostgreSQL" in result.stdout
    assert "version 1 (ok)" in result.stdout
    for lane in ("sheet", "receipts", "retirement"):
        assert f"lane        {lane}" in result.stdout


def test_doctor_fails_with_one_line_when_unreachable():
    result = run_doctor(env_dsn="postgresql://me:hunter2@127.0.0.1:9/nowhere")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "TenantUnavailableError" in lines[0]
    assert "127.0.0.1:9/nowhere" in lines[0] and "hunter2" not in lines[0]
