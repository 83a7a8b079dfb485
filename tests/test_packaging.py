"""One import package: only `runplane` is installed, and the layers hold.

These run in fresh interpreters from a folder outside the repository, so the checkout's own
folders cannot be found on `sys.path` by accident.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def test_only_runplane_is_importable(tmp_path):
    ok = python("import runplane.engine, runplane.actors, runplane.simulations, runplane.cli", tmp_path)
    assert ok.returncode == 0, ok.stderr
    for name in ("engine", "actors", "simulations", "cli"):
        missing = python(f"import {name}", tmp_path)
        assert missing.returncode != 0 and "ModuleNotFoundError" in missing.stderr, name


def test_actors_never_import_the_simulations_or_hypothesis(tmp_path):
    out = python("import runplane.actors, runplane.engine, sys; "
                 "print([m for m in sys.modules if 'simulations' in m or m.startswith('hypothesis')"
                 " or m.startswith('runplane.cli')])", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_play_with_its_own_engine_module_runs(tmp_path, dsn):
    play_dir = tmp_path / "myplay"
    play_dir.mkdir()
    (play_dir / "engine.py").write_text("def shout(text):\n    return text.upper()\n")
    (play_dir / "play.py").write_text(
        "from engine import shout\n"
        "from runplane.engine.sheets import SheetContract\n"
        "PLAY = 'own-engine'\n"
        "async def loud(row):\n"
        "    return {'loud': shout(row['word'])}\n"
        "async def play(run, rows):\n"
        "    return await run.map('words', rows, loud,\n"
        "                         contract=SheetContract(inputs=('word',), outputs=('loud',)))\n"
    )
    (play_dir / "rows.jsonl").write_text('{"word": "hi"}\n{"word": "there"}\n')
    schema = f"t_pkg_{os.getpid()}"
    env = {**os.environ, "RUNPLANE_DSN": dsn}
    done = subprocess.run(
        [sys.executable, "-m", "runplane.cli", "run", "play.py", "--input", "rows.jsonl",
         "--schema", schema],
        cwd=play_dir, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "admitted 2, cached 0, completed 2, failed 0" in done.stdout
