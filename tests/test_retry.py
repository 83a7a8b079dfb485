"""Retrying a table (`runplane retry`, `actors.retrying`): the failed rows run again on a
`runplane worker`, under their stored keys, with the stored inputs; a recompute with force."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from runplane.actors import open_run
from runplane.actors.retrying import RetrySelection, prepare_retry, retry_table
from runplane.engine.errors import InvalidInputError
from runplane.engine.sheets import summary

from .cli_helpers import cli_env
from .gateway_support import server  # noqa: F401  (a fixture)
from .plays import retry_play
from .sheet_helpers import counters_match, play_scope, raw_rows
from .test_shared_workers import PLAY_FILE as _SCALE_PLAY, ROOT, worker_env

PLAY = retry_play.PLAY
PLAY_FILE = _SCALE_PLAY.parent / "retry_play.py"
ROWS = [{"n": i} for i in range(300)]
FAILING = {i for i in range(300) if i % 3 == 0}


async def _first_run(tenant, monkeypatch) -> None:
    """The play's first run, in this process, with every third row failing."""
    monkeypatch.setenv("RUNPLANE_TEST_BROKEN", "1")
    async with open_run(tenant, PLAY) as run:
        result = await retry_play.play(run, ROWS)
    assert (result.completed, result.failed) == (200, 100)
    monkeypatch.delenv("RUNPLANE_TEST_BROKEN")


async def _worker(tenant, dsn, **env: str) -> trio.Process:
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "runplane.cli", "worker", str(PLAY_FILE), "--exit-when-idle",
         "--concurrency", "8"], env={**worker_env(tenant, dsn), **env},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)


async def _stored(tenant) -> dict:
    return await raw_rows(tenant, play_scope(tenant, PLAY), "nums", ("n", "product"))


async def test_retry_failed_runs_only_the_failed_rows_on_a_worker_under_their_keys(
        tenant, dsn, monkeypatch):
    """`runplane retry PLAY nums` (a subprocess) publishes the 100 failed rows; a `runplane
    worker` runs them with the fixed function. Every row ends enriched, no row is added (the
    stored keys were reused), the rows that had finished were not written again, and the
    retry is a run of its own, exit 0."""
    await _first_run(tenant, monkeypatch)
    before = await _stored(tenant)
    worker = await _worker(tenant, dsn)
    with trio.fail_after(120):
        retried = await trio.run_process(
            [sys.executable, "-m", "runplane.cli", "retry", PLAY, "nums",
             "--progress-every", "0.5"], env=cli_env(**worker_env(tenant, dsn)),
            stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False,
            cwd=ROOT)
        await worker.wait()
    out = retried.stdout.decode() + retried.stderr.decode()
    assert retried.returncode == 0, out
    assert "admitted 100, cached 0, completed 100, failed 0" in out, out
    after = await _stored(tenant)
    assert after.keys() == before.keys()
    assert all(row["_status"] == "enriched" for row in after.values())
    assert {row["n"]: row["product"] for row in after.values()} == {i: 2 * i for i in range(300)}
    for key, row in after.items():
        if before[key]["n"] in FAILING:
            assert row["_run_id"] != before[key]["_run_id"]  # written by the retry's run
        else:
            assert row["_version"] == before[key]["_version"]  # not written again
    counts = await summary(tenant, play_scope(tenant, PLAY), "nums")
    assert (counts.completed, counts.failed, counts.total) == (300, 0, 300)
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why


async def test_a_forced_recompute_of_every_row_writes_every_row_again(tenant, dsn, monkeypatch):
    """With force and every row chosen, a worker whose function now multiplies by 3 writes
    all 300 rows again, in place."""
    await _first_run(tenant, monkeypatch)
    worker = await _worker(tenant, dsn, RUNPLANE_TEST_FACTOR="3")
    plan = await prepare_retry(tenant, PLAY, "nums", RetrySelection(None, force=True))
    with trio.fail_after(120):
        async with open_run(tenant, PLAY) as run:
            result = await retry_table(run, plan)
        await worker.wait()
    assert (result.admitted, result.completed, result.failed) == (300, 300, 0)
    after = await _stored(tenant)
    assert len(after) == 300
    assert {row["n"]: row["product"] for row in after.values()} == {i: 3 * i for i in range(300)}
    ok, why = await counters_match(tenant, play_scope(tenant, PLAY), "nums")
    assert ok, why


async def test_a_retry_is_refused_before_anything_is_written(tenant, monkeypatch):
    """Finished rows without force, an unknown status, and a table whose map recorded no
    function workers can find (a lambda) are refused with `InvalidInputError`; no run is
    registered by a refused `prepare_retry`."""
    with pytest.raises(InvalidInputError, match="needs force"):
        RetrySelection("enriched")
    with pytest.raises(InvalidInputError, match="status must be one of"):
        RetrySelection("done", force=True)
    async with open_run(tenant, PLAY) as run:
        await run.map("anon", ROWS[:3], lambda row: {"product": 1}, contract=retry_play.CONTRACT)
    with pytest.raises(InvalidInputError, match="recorded a function"):
        await prepare_retry(tenant, PLAY, "anon", RetrySelection())
    with pytest.raises(InvalidInputError, match="recorded a function"):
        await prepare_retry(tenant, PLAY, "never-mapped", RetrySelection())


async def test_the_console_starts_a_retry_and_says_when_no_worker_came(tenant, monkeypatch):
    """The local console (with a `RetryHost`): the table page offers both buttons; a recompute
    of every row starts a run of its own (JSON answer: its id), whose page says no worker has
    come (the 30 s shortened by its setting); a retry of a table never mapped is a 400. The
    gateway's console, which hosts no retry, refuses with 403, and a token without
    `maps.force` may not recompute."""
    from runplane.actors.retrying import RetryHost
    from runplane.engine.console import actions as console_actions
    from runplane.engine.console import open_console
    from runplane.engine.console.auth import CONSOLE_ACTIONS
    from runplane.engine.gateway import mint_token

    from .console_support import SECRET, client, login_token
    from .gateway_support import serving
    from .test_console_actions import CSRF

    await _first_run(tenant, monkeypatch)
    monkeypatch.setattr(console_actions, "NO_WORKER_S", 0.2)
    org = {"org": tenant.org_id}
    json_answer = {"accept": "application/json"}
    async with trio.open_nursery() as nursery:
        host = RetryHost(tenant.dsn, tenant.schema, nursery)
        async with open_console(dsn=tenant.dsn, schema=tenant.schema, bind="127.0.0.1:0",
                                start_retry=host.start) as server, client(server.url) as http:
            assert (await http.get(server.login_url().removeprefix(server.url))).status_code == 303
            page = await http.get(f"/ui/tables/{PLAY}/nums", params=org)
            assert "Retry 100 failed rows" in page.text and "Recompute" in page.text
            csrf = CSRF.search(page.text).group(1)
            path = f"/ui/tables/{PLAY}/nums/retry"
            started = await http.post(path, params=org, headers=json_answer,
                                      data={"csrf": csrf, "kind": "recompute", "status": "all"})
            assert started.status_code == 200, started.text
            run_id = started.json()["run_id"]
            await trio.sleep(0.5)  # past the shortened no-worker wait
            run_page = await http.get(f"/ui/runs/{PLAY}/{run_id}", params=org)
            assert "No worker of play retrying has been seen" in run_page.text
            never = await http.post(f"/ui/tables/{PLAY}/nums/retry", params=org,
                                    headers=json_answer, data={"csrf": csrf, "kind": "bogus"})
            assert never.status_code == 400
        nursery.cancel_scope.cancel()
    no_force = mint_token(SECRET, tenant.org_id,
                          actions=(*CONSOLE_ACTIONS, "runs.cancel", "maps.retry_failed"))
    async with serving(tenant) as server, client(server.url) as http, \
            open_run(tenant, PLAY, retire_on_exit=False) as live:
        assert (await login_token(http, no_force)).status_code == 303
        page = await http.get(f"/ui/tables/{PLAY}/nums")
        assert "Recompute" not in page.text and "Retry 100" not in page.text  # hosts no retry
        csrf = CSRF.search((await http.get(f"/ui/runs/{PLAY}/{live.run_id}")).text).group(1)
        path = f"/ui/tables/{PLAY}/nums/retry"
        refused = await http.post(path, headers=json_answer,
                                  data={"csrf": csrf, "kind": "recompute", "status": "all"})
        assert refused.status_code == 403 and "maps.force" in refused.text
        refused = await http.post(path, data={"csrf": csrf, "kind": "failed"})
        assert refused.status_code == 403 and "cannot start retries" in refused.text


async def test_a_retry_through_a_gateway_needs_its_claim(tenant, dsn, server, monkeypatch):
    """Through a gateway: a token without `maps.retry_failed` is refused before anything is
    written; with it (and the shared-map actions), the retry runs like a direct one."""
    from runplane.engine.errors import ScopeError
    from runplane.engine.gateway import open_gateway

    from .gateway_support import FAST_RETRY, token_for

    await _first_run(tenant, monkeypatch)
    reader = token_for(tenant, actions=("runs.*", "sheets.*", "shared_maps.*", "history.*"))
    async with open_gateway(server.url, reader, retry=FAST_RETRY) as gateway:
        with pytest.raises(ScopeError, match="maps.retry_failed"):
            await prepare_retry(gateway, PLAY, "nums", RetrySelection())
    worker = await _worker(tenant, dsn)
    allowed = token_for(tenant, actions=(
        "array_input.*", "history.*", "outbox.*", "row_calls.*", "runs.*", "sheets.*",
        "shared_maps.*", "maps.retry_failed"))
    async with open_gateway(server.url, allowed, retry=FAST_RETRY) as gateway:
        plan = await prepare_retry(gateway, PLAY, "nums", RetrySelection())
        with trio.fail_after(120):
            async with open_run(gateway, PLAY) as run:
                result = await retry_table(run, plan)
            await worker.wait()
    assert (result.admitted, result.completed, result.failed) == (100, 100, 0)
    counts = await summary(tenant, play_scope(tenant, PLAY), "nums")
    assert (counts.completed, counts.failed, counts.total) == (300, 0, 300)
