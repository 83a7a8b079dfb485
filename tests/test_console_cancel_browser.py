"""Cancel from the console in a real browser (Debian's chromium): a `runplane demo` running in
another process stops and exits 130 once the run page's "Cancel run" button is clicked."""

from __future__ import annotations

import queue
import re
import threading

import pytest
import trio

from runplane.engine.console import open_console

from .cli_helpers import cli_env, start_cli, wait_for_text
from .conftest import fresh_schema
from .test_console_browser import browser  # noqa: F401 - fixture
from .browser_support import chromium_path

pytestmark = pytest.mark.browser


def console_in_background(dsn: str, schema: str):
    """`open_console` served from a trio run in a thread; returns (login link, stop)."""
    ready: queue.Queue = queue.Queue()
    handles: dict = {}

    async def main() -> None:
        handles["token"] = trio.lowlevel.current_trio_token()
        handles["stop"] = stop = trio.Event()
        try:
            async with open_console(dsn=dsn, schema=schema, bind="127.0.0.1:0") as server:
                ready.put(server.login_url())
                await stop.wait()
        except BaseException as exc:
            ready.put(exc)
            raise

    thread = threading.Thread(target=lambda: trio.run(main), daemon=True)
    thread.start()
    got = ready.get(timeout=120)
    if isinstance(got, BaseException):
        raise got

    def stop() -> None:
        trio.from_thread.run_sync(handles["stop"].set, trio_token=handles["token"])
        thread.join(timeout=60)

    return got, stop


@pytest.fixture(scope="module")
def world(dsn):
    """(chromium, the test server's DSN), as the `browser` fixture expects its world."""
    yield chromium_path(), dsn  # a skip (a failure under CI=true) without chromium


def test_cancel_from_the_console_stops_a_runplane_demo(world, browser, tmp_path, monkeypatch):
    _, dsn = world
    monkeypatch.setenv("RUNPLANE_DSN", dsn)
    schema = fresh_schema()
    log = tmp_path / "demo.log"
    proc = start_cli("demo", "--rows", "100000", "--latency-ms", "40", "--concurrency", "4",
                     "--schema", schema, stdout_path=log, env=cli_env(RUNPLANE_DSN=dsn))
    stop = None
    context = browser.new_context()
    try:
        content = wait_for_text(log, "started (epoch", proc)
        run_id = re.search(r"^run (\S+) of play demo started", content, re.MULTILINE).group(1)
        link, stop = console_in_background(dsn, schema)
        page = context.new_page()
        page.goto(link)
        page.goto(link.split("/ui/")[0] + f"/ui/runs/demo/{run_id}")
        page.click("button[name=cancel]")
        page.wait_for_url(re.compile(r"done=requested"))
        assert "Cancellation requested" in page.inner_text("main")
        page.screenshot(path=str(tmp_path / "cancelled.png"), full_page=True)
        status = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        context.close()
        if stop is not None:
            stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 130, err
    assert f"run {run_id} was cancelled" in err
