"""`runplane console`: a child process prints a one-time login link with its bound port; the link
works once; a network bind is refused."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx

from runplane.cli.main import main

from .console_support import seed


def test_console_refuses_a_network_bind(capsys):
    assert main(["console", "--bind", "0.0.0.0:8788"]) == 1
    assert "loopback only" in capsys.readouterr().err


async def test_console_command_prints_a_link_that_works_once(tenant):
    seeded = await seed(tenant)
    env = {**os.environ, "RUNPLANE_DSN": tenant.dsn, "RUNPLANE_SCHEMA": tenant.schema}
    child = subprocess.Popen([sys.executable, "-m", "runplane.cli", "console", "--bind",
                              "127.0.0.1:0"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        first = child.stdout.readline()
        link = child.stdout.readline().strip()
        assert "console listening on http://127.0.0.1:" in first, first + child.stderr.read()
        match = re.fullmatch(r"(http://127\.0\.0\.1:\d+)/ui/login\?once=[\w-]+", link)
        assert match, link
        base = match.group(1)
        async with httpx.AsyncClient(base_url=base, trust_env=False) as http:
            assert (await http.get("/ui/")).status_code == 303
            assert (await http.get(link)).status_code == 303
            page = await http.get("/ui/")
            assert page.status_code == 200 and seeded.alpha_run in page.text
        async with httpx.AsyncClient(base_url=base, trust_env=False) as http:
            assert (await http.get(link)).status_code == 401
    finally:
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=30) == 130
