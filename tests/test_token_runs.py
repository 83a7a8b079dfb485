"""A token whose `runs` claim names some runs acts for those runs only: any other run an
action names is refused (403) before any query, and nothing is written for it."""

from __future__ import annotations

import jwt
import pytest

from runplane.engine import receipts, runs, sheets
from runplane.engine.errors import ScopeError
from runplane.cli import main
from runplane.engine.gateway import mint_token, open_gateway, verify_token
from runplane.engine.gateway.db_sessions import token_operations
from runplane.engine.values.scopes import PlayScope, RunScope
from runplane.engine.sheets import RowOutcome

from .gateway_support import FAST_RETRY, SECRET, count_rows, server, token_for  # noqa: F401

PLAY = "p"
NS = "scored"
CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("score",))


async def test_a_token_for_run_a_acts_for_a_and_is_refused_for_b(tenant, server):
    token = token_for(tenant, runs=["A"])
    assert jwt.decode(token, options={"verify_signature": False})["runs"] == ["A"]
    run_b = await runs.register(tenant, RunScope(tenant.org_id, PLAY, "B"))
    async with open_gateway(server.url, token, retry=FAST_RETRY) as gw:
        run_a = await runs.register(gw, RunScope(tenant.org_id, PLAY, "A"))
        assert (await receipts.claim(gw, run_a, "k")).disposition == "claimed"
        assert (await receipts.complete(gw, run_a, "k", 1)).output == 1
        await sheets.ensure_sheet(gw, PlayScope(tenant.org_id, PLAY), NS, CONTRACT)  # no run named
        admitted = await sheets.admit(gw, run_a, NS, CONTRACT, [{"name": "x"}])
        [row] = admitted.pending
        done = await sheets.complete(gw, run_a, NS, CONTRACT, [
            RowOutcome(row.key, "completed", data={"score": 7}, input_index=row.input_index)])
        assert done.committed_keys == (row.key,)
        lookups, denied = server.run_check.lookups, server.errors["scope_denied"]
        refusals = [
            lambda: receipts.claim(gw, run_b, "k"),
            lambda: sheets.admit(gw, run_b, NS, CONTRACT, [{"name": "y"}]),
            lambda: sheets.complete(gw, run_b, NS, CONTRACT, [
                RowOutcome(row.key, "completed", data={"score": 1})]),
            lambda: runs.register(gw, RunScope(tenant.org_id, PLAY, "C")),
            lambda: sheets.read_rows(gw, PlayScope(tenant.org_id, PLAY), NS, run_id="B"),
        ]
        for call in refusals:
            with pytest.raises(ScopeError, match="runs claim does not allow run"):
                await call()
        assert server.errors["scope_denied"] == denied + len(refusals)
        assert server.run_check.lookups == lookups  # refused before the run was even looked up
    assert await count_rows(tenant, "work_receipts") == 1  # A's only
    stored = await sheets.read_rows(tenant, PlayScope(tenant.org_id, PLAY), NS)
    assert [(r["name"], r["score"]) for r in stored] == [("x", 7)]
    assert await runs.get(tenant, RunScope(tenant.org_id, PLAY, "C")) is None


def test_a_token_limited_to_runs_mints_no_database_session():
    assert token_operations(mint_token(SECRET, "o")) != ()
    assert token_operations(mint_token(SECRET, "o", runs=["A"])) == ()


def test_the_token_command_names_runs(monkeypatch, capsys):
    monkeypatch.setenv("RUNPLANE_GATEWAY_SECRET", SECRET)
    assert main(["token", "--org", "acme", "--run", "A", "--run", "B"]) == 0
    assert verify_token(SECRET, capsys.readouterr().out.strip()).runs == ("A", "B")
    assert main(["token", "--org", "acme"]) == 0
    assert verify_token(SECRET, capsys.readouterr().out.strip()).runs is None


def test_the_servers_verified_tokens_check_expiry_on_every_use():
    """A remembered token is verified again once its claims say it expired, a forged one never
    gets in, and what is remembered stays bounded."""
    import attrs

    from runplane.engine.errors import AuthError
    from runplane.engine.tokens import VerifiedTokens

    secret = "a-secret-long-enough-for-hmac-sha256"
    verified = VerifiedTokens(secret, capacity=2)
    token = mint_token(secret, "org")
    assert verified.verify(token) == verify_token(secret, token)
    assert verified.verify(token).org == "org"  # remembered
    with pytest.raises(AuthError, match="InvalidSignature"):
        verified.verify(mint_token("another-secret-long-enough-for-hmac", "org"))
    with pytest.raises(AuthError, match="missing"):
        verified.verify(None)
    verified._known[token] = attrs.evolve(verified._known[token], exp=1)  # as if it expired
    assert verified.verify(token) == verify_token(secret, token)  # verified again, not trusted
    for org in ("o1", "o2", "o3"):
        verified.verify(mint_token(secret, org))
    assert len(verified._known) == 2
