"""The README's Python snippet runs as printed, and `runplane status` then finds its play."""

from __future__ import annotations

import re
import subprocess
import sys

import trio

from runplane.engine import open_tenant

from .cli_helpers import ROOT, cli_env, run_cli

SCHEMA = "runplane"  # the snippet's (default) schema; no other test uses it


def test_the_readme_snippet_and_runplane_status_agree_on_the_org(dsn, tmp_path):
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Using it from Python\n\n```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    env = cli_env(RUNPLANE_DSN=dsn)
    for name in ("RUNPLANE_ORG", "RUNPLANE_SCHEMA"):
        env.pop(name, None)

    async def drop() -> None:
        async with open_tenant("local", dsn, schema=SCHEMA) as tenant:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')

    trio.run(drop)
    try:
        ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=120)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout == "2 0 0\n"  # completed, cached, failed
        status = run_cli("status", "enrich", env=env)
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith(
            "table companies: total 2, queued 0, running 0, leased 0, completed 2, failed 0\n")
    finally:
        trio.run(drop)
