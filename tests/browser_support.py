"""A console to drive from a real browser: a gateway over a fresh schema, seeded runs of two
orgs and one slow map still running, all served from a trio run in a background thread (the
browser tests use playwright's synchronous API on the main thread)."""

from __future__ import annotations

import os
import queue
import shutil
import threading

import attrs
import pytest
import trio

from runplane.actors import open_run
from runplane.engine import open_tenant
from runplane.engine.console import open_console
from runplane.engine.gateway import mint_token, open_server

from .conftest import fresh_schema
from .console_support import CONTRACT, OTHER_ORG, SECRET, seed

ORG = "org-test"
LIVE_ROWS = 50_000


def chromium_path() -> str:
    """Debian's chromium, or a skip (a failure under CI=true) saying how to install it."""
    found = os.environ.get("RUNPLANE_CHROMIUM") or shutil.which("chromium")
    if found:
        return found
    message = "the browser tests need Debian's chromium: apt-get install -y chromium"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@attrs.frozen
class LiveConsole:
    url: str
    token: str
    other_token: str
    alpha_run: str
    other_run: str
    live_run: str
    console_link: str  # `runplane console`'s one-time login link (a console of every org)


async def _slow(row: dict) -> dict:
    await trio.sleep(0.02)
    return {"upper": row["name"].upper()}


async def _serve(dsn: str, schema: str, ready: queue.Queue, stop: trio.Event) -> None:
    async with open_tenant(ORG, dsn, schema=schema) as tenant:
        try:
            seeded = await seed(tenant)
            async with open_server(secret=SECRET, dsn=dsn, schema=schema) as server, \
                    open_console(dsn=dsn, schema=schema, bind="127.0.0.1:0") as console:
                async with open_run(tenant, "live", retire_on_exit=False) as run:
                    async with trio.open_nursery() as nursery:
                        rows = [{"name": f"live-{i:06d}"} for i in range(LIVE_ROWS)]
                        nursery.start_soon(lambda: run.map("t", rows, _slow, contract=CONTRACT,
                                                           concurrency=4))
                        ready.put(LiveConsole(
                            server.url, mint_token(SECRET, ORG), mint_token(SECRET, OTHER_ORG),
                            seeded.alpha_run, seeded.other_run, run.run_id, console.login_url()))
                        await stop.wait()
                        nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                async with tenant.connection("sheet") as conn:
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def serve_in_background(dsn: str):
    """Start the console's world in a thread; returns (LiveConsole, stop function)."""
    ready: queue.Queue = queue.Queue()
    handles: dict = {}

    async def main() -> None:
        handles["token"] = trio.lowlevel.current_trio_token()
        handles["stop"] = stop = trio.Event()
        try:
            await _serve(dsn, fresh_schema(), ready, stop)
        except BaseException as exc:
            ready.put(exc)
            raise

    thread = threading.Thread(target=lambda: trio.run(main), daemon=True)
    thread.start()
    got = ready.get(timeout=300)
    if isinstance(got, BaseException):
        raise got

    def stop() -> None:
        trio.from_thread.run_sync(handles["stop"].set, trio_token=handles["token"])
        thread.join(timeout=60)

    return got, stop
