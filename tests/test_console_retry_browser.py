"""Retry from the console in a real browser (Debian's chromium): `runplane console` (a
subprocess) starts a retry of a table's failed rows, a `runplane worker` runs them, and the
table's failures page empties. Plus the refusals of the retry POST without its CSRF token."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from .cli_helpers import cli_env, run_cli, start_cli, wait_for_text
from .conftest import fresh_schema
from .test_console_browser import browser  # noqa: F401 - fixture
from .browser_support import chromium_path
from .test_retry import PLAY, PLAY_FILE

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def world(dsn):
    """(chromium, the test server's DSN), as the `browser` fixture expects its world."""
    yield chromium_path(), dsn  # a skip (a failure under CI=true) without chromium


def _failing_first_run(dsn: str, schema: str, tmp_path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(60)))
    done = run_cli("run", str(PLAY_FILE), "--input", str(rows), "--schema", schema,
                   env=cli_env(RUNPLANE_DSN=dsn, RUNPLANE_TEST_BROKEN="1"))
    assert done.returncode == 0, done.stderr
    assert "failed 20" in done.stdout + done.stderr, done.stdout + done.stderr


def test_retry_failed_from_the_console_is_run_by_a_worker(world, browser, tmp_path):
    _, dsn = world
    schema = fresh_schema()
    _failing_first_run(dsn, schema, tmp_path)
    env = cli_env(RUNPLANE_DSN=dsn)
    console = start_cli("console", "--schema", schema, "--bind", "127.0.0.1:0",
                        stdout_path=tmp_path / "console.log", env=env)
    worker = start_cli("worker", str(PLAY_FILE), "--schema", schema, "--exit-when-idle",
                       stdout_path=tmp_path / "worker.log", env=env)
    context = browser.new_context()
    try:
        content = wait_for_text(tmp_path / "console.log", "login?once=", console)
        link = re.search(r"(http://\S+/ui/login\?once=\S+)", content).group(1)
        base = link.split("/ui/")[0]
        page = context.new_page()
        page.goto(link)
        page.goto(f"{base}/ui/tables/{PLAY}/nums")
        page.screenshot(path=str(tmp_path / "table-retry.png"), full_page=True)
        # a POST without the session's CSRF token is refused, whatever its cookie
        cookies = {c["name"]: c["value"] for c in context.cookies()}
        forged = httpx.post(f"{base}/ui/tables/{PLAY}/nums/retry", data={"kind": "failed"},
                            cookies=cookies, headers={"accept": "application/json"})
        assert forged.status_code == 403, forged.text
        page.click("button[name=retry]")
        page.wait_for_url(re.compile(r"done=retry_started"))
        assert "Retry started" in page.inner_text("main")
        page.screenshot(path=str(tmp_path / "retry-run.png"), full_page=True)
        assert worker.wait(timeout=120) == 0, worker.stderr.read()
        page.goto(f"{base}/ui/failures/{PLAY}/nums")
        assert "No failed rows." in page.inner_text("main")
        page.screenshot(path=str(tmp_path / "failures-after-retry.png"), full_page=True)
        page.goto(f"{base}/ui/tables/{PLAY}/nums")
        assert page.locator("button[name=retry]").count() == 0  # nothing failed is left
    finally:
        context.close()
        for proc in (console, worker):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
