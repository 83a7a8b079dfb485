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


def test_runs_prints_each_runs_console_page_when_a_console_is_configured(dsn, monkeypatch,
                                                                           capsys):
    import trio

    from runplane.actors import open_run
    from runplane.engine import open_tenant

    from .conftest import fresh_schema
    from .console_support import CONTRACT, upper

    schema = fresh_schema()

    async def make() -> str:
        async with open_tenant("acme", dsn, schema=schema) as tenant:
            async with open_run(tenant, "my play") as run:
                await run.map("t", [{"name": "a"}], upper, contract=CONTRACT)
                return run.run_id

    async def drop() -> None:
        async with open_tenant("acme", dsn, schema=schema) as tenant:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    run_id = trio.run(make)
    try:
        args = ["runs", "my play", "--dsn", dsn, "--org", "acme", "--schema", schema]
        monkeypatch.delenv("RUNPLANE_CONSOLE_URL", raising=False)
        assert main(args) == 0
        assert "console" not in capsys.readouterr().out
        monkeypatch.setenv("RUNPLANE_CONSOLE_URL", "http://127.0.0.1:8788/")
        assert main(args) == 0
        out = capsys.readouterr().out
        assert f"console {run_id}: http://127.0.0.1:8788/ui/runs/my%20play/{run_id}?org=acme" in out
    finally:
        trio.run(drop)


async def test_serve_believes_https_only_from_a_forwarded_allow_proxy(dsn):
    """`runplane serve --forwarded-allow 127.0.0.1`: the console's cookie is Secure when that
    proxy says `X-Forwarded-Proto: https`."""
    from runplane.engine.gateway import mint_token

    from .conftest import fresh_schema
    from .console_support import SECRET, cookie_header

    schema = fresh_schema()
    env = {**os.environ, "RUNPLANE_GATEWAY_SECRET": SECRET, "RUNPLANE_DSN": dsn}
    child = subprocess.Popen([sys.executable, "-m", "runplane.cli", "serve", "--bind",
                              "127.0.0.1:0", "--schema", schema, "--forwarded-allow",
                              "192.0.2.1,127.0.0.1"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + child.stderr.read()
        async with httpx.AsyncClient(base_url=match.group(1), trust_env=False) as http:
            login = await http.post(
                "/ui/login", data={"token": mint_token(SECRET, "acme")},
                headers={"x-forwarded-proto": "https", "x-forwarded-host": "console.example",
                         "origin": "https://console.example"})
            assert login.status_code == 303, login.text
            assert "Secure" in cookie_header(login) and "runplane_console=" in cookie_header(login)
    finally:
        child.terminate()
        child.wait(timeout=30)
        from runplane.engine import open_tenant
        async with open_tenant("local", dsn, schema=schema) as tenant:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
