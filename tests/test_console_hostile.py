"""The console against a hostile probe (issue 34): sessions capped per org, run-scoped tokens,
live streams that end with their session and an exact stream cap, forged logins, Secure cookies
behind a trusted proxy, malformed parameters, and play or run ids holding `/`."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
import trio

from runplane.actors import open_run
from runplane.engine.console import auth
from runplane.engine.gateway import ServerOptions, mint_token, open_server

from .console_support import (CONTRACT, SECRET, client, cookie_header, login_token, run_ids,
                              seed, upper)
from .gateway_support import serving


@pytest.fixture
async def seeded(tenant):
    return await seed(tenant)


@pytest.fixture
async def server(tenant):
    async with serving(tenant) as server:
        yield server


# -- 5: sessions are capped and evicted per org ---------------------------------------------------
def test_one_orgs_logins_never_log_out_another_orgs_session(monkeypatch):
    monkeypatch.setattr(auth, "MAX_SESSIONS", 4)  # every org's sessions together
    monkeypatch.setattr(auth, "MAX_ORG_SESSIONS", 3, raising=False)
    sessions = auth.Sessions(SECRET)
    mine = sessions.login(mint_token(SECRET, "org-a"))
    theirs = [sessions.login(mint_token(SECRET, "org-b")) for _ in range(10)]
    assert sessions.viewer(mine) is not None
    assert [sessions.viewer(s) is not None for s in theirs] == [False] * 7 + [True] * 3
    # past the bound on every org's sessions, the org holding the most loses its oldest
    third = [sessions.login(mint_token(SECRET, "org-c")) for _ in range(2)]
    assert sessions.viewer(mine) is not None and all(sessions.viewer(s) for s in third)
    assert sum(sessions.viewer(s) is not None for s in [mine, *theirs, *third]) == 4


# -- 7: a run-scoped token sees its runs only ----------------------------------------------------
async def test_a_run_scoped_token_sees_only_its_runs(tenant, server, seeded):
    token = mint_token(SECRET, tenant.org_id, runs=(seeded.alpha_run,))
    async with client(server.url) as http:
        assert (await login_token(http, token)).status_code == 303
        assert run_ids((await http.get("/ui/")).text) == {seeded.alpha_run}
        listed = (await http.get("/ui/api/runs")).json()["runs"]
        assert [r["run_id"] for r in listed] == [seeded.alpha_run]
        assert (await http.get("/ui/api/runs?play=beta")).json()["runs"] == []
        for path in (f"/ui/runs/beta/{seeded.beta_run}", f"/ui/api/runs/beta/{seeded.beta_run}",
                     f"/ui/live/runs/beta/{seeded.beta_run}"):
            assert (await http.get(path)).status_code == 404, path
        assert (await http.get(f"/ui/api/runs/alpha/{seeded.alpha_run}")).status_code == 200
        assert (await http.get(f"/ui/runs/alpha/{seeded.alpha_run}")).status_code == 200


# -- 8: a live stream ends with its session; the stream cap is exact -----------------------------
async def read_events(stream, first: trio.Event, events: list) -> None:
    async for line in stream.aiter_lines():
        if line.startswith("data:"):
            events.append(json.loads(line[5:]))
            first.set()


async def test_a_live_stream_ends_at_logout(tenant, server, seeded):
    async with client(server.url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        events: list = []
        first, ended = trio.Event(), trio.Event()

        async def read_to_the_end(stream) -> None:
            await read_events(stream, first, events)
            ended.set()

        async with http.stream("GET", f"/ui/live/runs/alpha/{seeded.alpha_run}") as stream:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_to_the_end, stream)
                with trio.fail_after(20):
                    await first.wait()
                assert (await http.post("/ui/logout")).status_code == 303
                with trio.fail_after(5):  # the server ends it; the client never closes it
                    await ended.wait()
        assert (await http.get("/ui/api/runs")).status_code == 401


async def test_a_live_stream_ends_when_its_token_expires(tenant, server, seeded):
    async with client(server.url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id, ttl_s=2))
        events: list = []
        with trio.fail_after(10):  # at most 2 s of token life, then 5 s to close
            async with http.stream("GET", f"/ui/live/runs/alpha/{seeded.alpha_run}") as stream:
                await read_events(stream, trio.Event(), events)
        assert (await http.get("/ui/api/runs")).status_code == 401


async def test_the_live_stream_cap_is_exact_under_a_burst(tenant, seeded, monkeypatch):
    from runplane.engine.console import routes
    from runplane.engine.tenant import DEFAULT_LANES

    wide = {"lanes": {**DEFAULT_LANES, "console": 40}, "max_connections": 56}

    monkeypatch.setattr(routes, "MAX_STREAMS", 16)
    path = f"/ui/live/runs/alpha/{seeded.alpha_run}"
    answers: list[int] = []
    everyone = trio.Event()
    burst = 150
    async with serving(tenant, tenant_options=wide) as server, httpx.AsyncClient(
            base_url=server.url, trust_env=False, timeout=60,
            limits=httpx.Limits(max_connections=None)) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))

        async def open_one() -> None:
            async with http.stream("GET", path) as stream:
                answers.append(stream.status_code)
                if len(answers) == burst:
                    everyone.set()
                await everyone.wait()  # hold every accepted stream open until all have answers

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(burst):
                    nursery.start_soon(open_one)
    assert answers.count(200) == 16 and answers.count(503) == burst - 16, answers.count(200)


async def test_a_stream_counts_against_the_cap_before_its_answer_starts(tenant, server, seeded,
                                                                       monkeypatch):
    """Drives the console's ASGI application directly: the first stream's answer is held at its
    very first `send`, so a second request arrives while the first is accepted but not started."""
    from runplane.engine.console import console_app, routes

    monkeypatch.setattr(routes, "MAX_STREAMS", 1)
    app = console_app(server.console)
    session = server.console.sessions.login(mint_token(SECRET, tenant.org_id))
    path = f"/ui/live/runs/alpha/{seeded.alpha_run}"
    statuses: list[int] = []
    answered, release = trio.Event(), trio.Event()

    async def request(hold: bool) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "root_path": "/ui", "query_string": b"", "server": ("127.0.0.1", 80),
                 "client": ("127.0.0.1", 40000),
                 "headers": [(b"host", b"127.0.0.1"),
                             (b"cookie", f"{auth.COOKIE}={session}".encode())]}

        async def receive() -> dict:
            await trio.sleep_forever()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
                answered.set()
                if hold:
                    await release.wait()

        await app(scope, receive, send)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, True)
            await answered.wait()
            await request(False)  # the second answer is complete: a 503, never a stream
            nursery.cancel_scope.cancel()
    assert statuses == [200, 503]


# -- 9: a login is not forgeable across sites ----------------------------------------------------
async def test_a_cross_site_login_is_refused(tenant, server):
    token = mint_token(SECRET, tenant.org_id)
    async with client(server.url) as http:
        for headers in ({"origin": "http://evil.example", "sec-fetch-site": "cross-site"},
                        {"origin": "http://evil.example"}, {"sec-fetch-site": "cross-site"},
                        {"sec-fetch-site": "same-site"}, {"origin": "null"}, {}):
            forged = await http.post("/ui/login", data={"token": token}, headers=headers)
            assert forged.status_code == 403, headers
            assert "runplane_console=" not in cookie_header(forged), headers
        for headers in ({"origin": server.url}, {"sec-fetch-site": "same-origin"}):
            http.cookies.clear()
            same = await http.post("/ui/login", data={"token": token}, headers=headers)
            assert same.status_code == 303 and "runplane_console=" in cookie_header(same), headers
        # the login form's own token: bound to the cookie the form set, in this browser only
        http.cookies.clear()
        form = await http.get("/ui/login")
        field = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
        ok = await http.post("/ui/login", data={"token": token, "csrf": field})
        assert ok.status_code == 303 and "runplane_console=" in cookie_header(ok)
        async with client(server.url) as victim:  # the attacker's own form token, elsewhere
            forged = await victim.post("/ui/login", data={"token": token, "csrf": field})
            assert forged.status_code == 403


async def test_a_trusted_proxys_host_and_scheme_are_the_origin(tenant, server):
    token = mint_token(SECRET, tenant.org_id)
    proxied = {"origin": "https://console.example", "x-forwarded-host": "console.example",
               "x-forwarded-proto": "https"}
    async with client(server.url) as http:
        untrusted = await http.post("/ui/login", data={"token": token}, headers=proxied)
        assert untrusted.status_code == 403
        server.console.forwarded_allow = ("127.0.0.1",)
        trusted = await http.post("/ui/login", data={"token": token}, headers=proxied)
        assert trusted.status_code == 303
        assert "Secure" in cookie_header(trusted)


# -- 10: the cookie is Secure when a trusted proxy says https ------------------------------------
async def test_the_cookie_is_secure_only_when_a_trusted_proxy_says_https(tenant, server):
    token = mint_token(SECRET, tenant.org_id)
    https = {"x-forwarded-proto": "https", "sec-fetch-site": "same-origin"}
    async with client(server.url) as http:
        plain = await http.post("/ui/login", data={"token": token}, headers=https)
        assert plain.status_code == 303 and "Secure" not in cookie_header(plain)
        server.console.forwarded_allow = ("192.0.2.7",)  # another peer is the proxy
        other = await http.post("/ui/login", data={"token": token}, headers=https)
        assert other.status_code == 303 and "Secure" not in cookie_header(other)
        server.console.forwarded_allow = ("127.0.0.1",)
        secure = await http.post("/ui/login", data={"token": token}, headers=https)
        assert secure.status_code == 303 and "Secure" in cookie_header(secure)


# -- 13: malformed parameters are 400, before any query ------------------------------------------
async def test_malformed_parameters_are_refused_before_any_query(tenant, server, seeded, caplog):
    caplog.set_level(logging.WARNING, logger="runplane.console")
    async with client(server.url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        for path in ("/ui/api/runs?before=99999999999999999999", "/ui/?before=99999999999999999999",
                     "/ui/api/runs?before=-1", "/ui/api/runs?play=a%00b",
                     "/ui/api/tables/al%00pha/t", "/ui/tables/alpha/t%00", "/ui/api/tables/alpha/t?key=a%00b",
                     "/ui/tables/alpha/t?key=%00",
                     f"/ui/api/runs/alpha/{seeded.alpha_run}%00",
                     '/ui/api/tables/alpha/t?after=[1,"garbage","k"]',
                     '/ui/api/tables/alpha/t?after=[99999999999999999999,"2024-01-01 00:00:00+00","k"]',
                     '/ui/api/failures/alpha/t?after=[1,"2024-01-01 00:00:00+00","k%00"]',
                     '/ui/tables/alpha/t?after=[null,"2024-13-01 00:00:00+00","k"]'):
            response = await http.get(path)
            assert response.status_code == 400, (path, response.status_code)
        assert not [r for r in caplog.records if "read failed" in r.getMessage()]


# -- a play or run id holding `/` works in every console URL -------------------------------------
async def test_a_play_and_run_id_holding_a_slash_work_everywhere(tenant, server):
    async with open_run(tenant, "team/etl", "2024/06/run-1") as run:
        await run.map("t", [{"name": "a"}, {"name": "bad1"}], upper, contract=CONTRACT)
    async with client(server.url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        runs = (await http.get("/ui/")).text
        link = "/ui/runs/team%2Fetl/2024%2F06%2Frun-1"
        assert f'href="{link}"' in runs
        page = await http.get(link)
        assert page.status_code == 200 and "2024/06/run-1" in page.text
        for kind in ("tables", "failures"):
            assert f'href="/ui/{kind}/team%2Fetl/t"' in page.text
            assert (await http.get(f"/ui/{kind}/team%2Fetl/t")).status_code == 200
        assert 'data-live="/ui/live/runs/team%2Fetl/2024%2F06%2Frun-1"' in page.text
        assert (await http.get("/ui/api/runs/team%2Fetl/2024%2F06%2Frun-1")).json()["run"][
            "play"] == "team/etl"
        rows = (await http.get("/ui/api/tables/team%2Fetl/t")).json()["rows"]
        assert sorted(json.loads(r["name"]) for r in rows) == ["a", "bad1"]
        failed = (await http.get("/ui/failures/team%2Fetl/t")).text
        assert "bad1" in failed
        table = (await http.get("/ui/tables/team%2Fetl/t")).text
        assert 'href="/ui/export/team%2Fetl/t.csv"' in table
        assert (await http.get("/ui/export/team%2Fetl/t.jsonl")).status_code == 200
        with trio.fail_after(20):
            async with http.stream("GET", "/ui/live/runs/team%2Fetl/2024%2F06%2Frun-1") as live:
                assert live.status_code == 200
                async for line in live.aiter_lines():
                    if line.startswith("data:"):
                        assert json.loads(line[5:])["tables"][0]["table"] == "t"
                        break
        # a literal `%` in a name stays itself: `%2F` in a segment is a `/` only once decoded
        assert (await http.get("/ui/runs/team%252Fetl/2024%2F06%2Frun-1")).status_code == 404


def _self_signed(folder) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_served_over_tls_the_cookie_is_secure(tenant, tmp_path):
    """`runplane serve --tls-cert/--tls-key`: HTTPS with Hypercorn's TLS, and a Secure cookie
    (was: no TLS option; the cookie was never Secure under `runplane serve`)."""
    from runplane.engine.errors import InvalidInputError

    cert, key = _self_signed(tmp_path)
    async with open_server(secret=SECRET, dsn=tenant.dsn, schema=tenant.schema,
                           options=ServerOptions(tls_cert=cert, tls_key=key)) as tls:
        assert tls.url.startswith("https://")
        async with httpx.AsyncClient(base_url=tls.url, verify=False) as http:
            assert (await http.get("/v1/health")).status_code == 200
            answer = await login_token(http, mint_token(SECRET, tenant.org_id))
            assert answer.status_code == 303 and "Secure" in cookie_header(answer)
    with pytest.raises(InvalidInputError):
        async with open_server(secret=SECRET, dsn=tenant.dsn, schema=tenant.schema,
                               options=ServerOptions(tls_cert=cert)):
            pass
