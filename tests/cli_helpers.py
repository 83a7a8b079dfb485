"""Shared helpers for command-line tests: a fresh schema, subprocess runs, a test play."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from runplane.engine import open_tenant

from .conftest import fresh_schema

ROOT = Path(__file__).resolve().parent.parent
RUNPLANE = [sys.executable, "-m", "runplane.cli"]

# A play whose rows fail by name (two distinct messages), that can hold after its map (so a
# test can kill it mid-run) or fail like a lost store.
PLAY_SOURCE = '''
import os

import trio

from runplane.engine.errors import StoreUnavailableError
from runplane.engine.sheets import SheetContract

PLAY = "ops"
CONTRACT = SheetContract(inputs=("name",), outputs=("size", "shout"))


async def measure(row):
    name = row["name"]
    if name.startswith("bad"):
        raise ValueError("quota exceeded")
    if name.startswith("slow"):
        raise TimeoutError("timed out after 2 s")
    if name.startswith("evil"):
        raise RuntimeError("boom\\x1b[2J\\nFAKE LINE")
    return {"size": len(name), "shout": name.upper()}


async def play(run, rows):
    result = await run.map("things", rows, measure, contract=CONTRACT, concurrency=4)
    if os.environ.get("PLAY_HOLD"):
        print("held", flush=True)
        await trio.sleep_forever()
    if os.environ.get("PLAY_STORE_FAILS"):
        raise StoreUnavailableError("the store went away (simulated)")
    return result
'''


def write_play(tmp_path: Path, names: list[str]) -> tuple[Path, Path]:
    """The test play and a CSV of `names`; returns (play file, input file)."""
    play = tmp_path / "ops_play.py"
    play.write_text(PLAY_SOURCE)
    rows = tmp_path / "names.csv"
    rows.write_text("name\n" + "".join(f"{name}\n" for name in names))
    return play, rows


@pytest.fixture
def schema(dsn, monkeypatch):
    """A fresh schema for the CLI, reached through RUNPLANE_DSN; dropped afterwards."""
    name = fresh_schema()
    monkeypatch.setenv("RUNPLANE_DSN", dsn)
    monkeypatch.delenv("RUNPLANE_ORG", raising=False)
    monkeypatch.delenv("RUNPLANE_SCHEMA", raising=False)
    yield name

    async def drop():
        async with open_tenant("local", dsn, schema=name) as tenant:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')

    trio.run(drop)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess; stdout stays block-buffered when redirected, so
    what a test reads from a log file is what runplane flushed itself."""
    env = {**os.environ, **extra}
    env.pop("PYTHONUNBUFFERED", None)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([*RUNPLANE, *args], capture_output=True, text=True,
                          env=env or cli_env(), cwd=ROOT, timeout=timeout)


def start_cli(*args: str, stdout_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start the CLI with stdout redirected to a file (as a log would be)."""
    with stdout_path.open("w") as out:
        return subprocess.Popen([*RUNPLANE, *args], stdout=out, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=ROOT)


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> str:
    """Poll a log file until it holds `text` (the process must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text()
        if text in content:
            return content
        assert proc.poll() is None, f"exited {proc.returncode}: {content} {proc.stderr.read()}"
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}: {path.read_text()}")


def pasted(command: str) -> list[str]:
    """A printed `runplane ...` command as an argv for this interpreter."""
    words = shlex.split(command)
    assert words[0] == "runplane", command
    return [*RUNPLANE, *words[1:]]
