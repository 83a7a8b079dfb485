"""Database sessions over time: the schema migration that brings them, cleanup of expired roles,
the password rule of the embedded server and `runplane doctor`, and the encrypted URL."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio

from runplane.engine.sessions import jwe
from runplane.engine import open_tenant, receipts, sessions
from runplane.engine.embedded import HBA_MARKER, SESSION_HBA_LINES, _reload_and_wait, with_session_hba
from runplane.engine.errors import (
    InsufficientPrivilegeError, InvalidInputError, StoreUnavailableError,
)
from runplane.engine.values.keys import receipt_key
from runplane.engine.runs import register
from runplane.engine.schema import SCHEMA_VERSION, schema_status
from runplane.engine.values.scopes import PlayScope, RunScope
from runplane.engine.sheets import admit
from runplane.engine.sql import qualified, quote_ident

from .conftest import fresh_schema
from .session_helpers import (
    CONTRACT, NAMESPACE, admin_tenant, drop_all_sessions, seed, session_roles, session_tenant,
    unique,
)
from .test_sessions import ALL_OPERATIONS, try_to_break_out, victim_rows

FROZEN_SCHEMAS = {"1": "schema_v1.sql", "2": "schema_v2.sql", "3": "schema_v3.sql", "4": "schema_v4.sql",
                  "5": "schema_v5.sql", "6": "schema_v6.sql",
                  "7": "schema_v7.sql", "8": "schema_v8.sql", "9": "schema_v9.sql",
                  "10": "schema_v10.sql", "11": "schema_v11.sql"}  # every older version


# -- migration --------------------------------------------------------------------------------
@pytest.mark.parametrize("version", sorted(FROZEN_SCHEMAS))
async def test_an_older_schema_is_upgraded_in_place_and_keeps_its_data(dsn, version):
    schema, org = fresh_schema(), unique("org")
    ddl = (Path(__file__).parent / FROZEN_SCHEMAS[version]).read_text()
    async with admin_tenant(dsn, org, schema=f"{schema}_scratch") as scratch:
        async with scratch.login_connection() as conn:
            await conn.execute(ddl.format(s=quote_ident(schema)))
            key = receipt_key(PlayScope(org, "play"), "old-receipt")
            await conn.execute(f"INSERT INTO {qualified(schema, 'runs')} (org_id, play, run_id, epoch)"
                               " VALUES ($1, 'play', 'old-run', nextval($2::regclass))",
                               org, qualified(schema, "run_epochs"))
            await conn.execute(f"INSERT INTO {qualified(schema, 'work_receipts')}"
                               " (k, status, output, run_id, epoch) VALUES ($1, 2, '{\"v\": 1}', 'old-run', 1)", key)
            assert await schema_status(conn, schema) == version
        try:
            # Two processes open the old schema at once: both succeed, it is upgraded once.
            opened = []

            async def open_one():
                async with open_tenant(org, dsn, schema=schema) as tenant:
                    opened.append(await register(tenant, RunScope(org, "play", "old-run")))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(open_one)
                nursery.start_soon(open_one)
            assert [ref.epoch for ref in opened] == [1, 1]
            async with admin_tenant(dsn, org, schema=schema) as tenant:
                async with tenant.login_connection() as conn:
                    assert await schema_status(conn, schema) == SCHEMA_VERSION
                assert (await receipts.get(tenant, PlayScope(org, "play"), "old-receipt")).output == {"v": 1}
                # Sessions work on the upgraded schema, and isolate it.
                async with admin_tenant(dsn, unique("other-org"), schema=schema) as other:
                    minted = await sessions.mint(other, PlayScope(other.org_id, "play"), NAMESPACE,
                                                 ALL_OPERATIONS)
                    before = await victim_rows(tenant, org)
                    async with session_tenant(dsn, minted) as session:
                        await try_to_break_out(session, org)
                    assert await victim_rows(tenant, org) == before
        finally:
            async with scratch.login_connection() as conn:
                await conn.execute(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE")


# -- cleanup ----------------------------------------------------------------------------------
_CATALOG = """
SELECT (SELECT count(*) FROM pg_catalog.pg_roles) AS roles,
       (SELECT count(*) FROM pg_catalog.pg_auth_members) AS memberships,
       (SELECT count(*) FROM pg_catalog.pg_shdepend) AS shared_dependencies,
       (SELECT count(*) FROM pg_catalog.pg_largeobject_metadata) AS large_objects,
       (SELECT coalesce(sum(cardinality(c.relacl)), 0) FROM pg_catalog.pg_class c
         WHERE c.relnamespace = $1::regnamespace) AS table_acl_entries,
       (SELECT cardinality(nspacl) FROM pg_catalog.pg_namespace WHERE oid = $1::regnamespace)
           AS schema_acl_entries,
       (SELECT count(*) FROM {m}) AS scope_rows
"""


async def catalog(tenant) -> dict:
    async with tenant.login_connection() as conn:
        row = await conn.fetchrow(_CATALOG.format(m=qualified(tenant.schema, "session_scopes")),
                                  quote_ident(tenant.schema))
    return dict(row)


async def expire_all(tenant) -> None:
    """Move every session role of the schema's VALID UNTIL into the past (as time would)."""
    async with tenant.login_connection() as conn:
        await conn.execute(f"""
            DO $$ DECLARE r record; BEGIN
              FOR r IN SELECT role_name FROM {qualified(tenant.schema, 'session_scopes')} LOOP
                EXECUTE format('ALTER ROLE %I VALID UNTIL %L', r.role_name, '2000-01-01');
              END LOOP; END $$""")


async def mint_many(admin, scope, shapes, count: int) -> None:
    for i in range(count):
        await sessions.mint(admin, scope, NAMESPACE, shapes[i % len(shapes)], max_sessions=1000)


async def test_a_writer_session_minted_before_the_upgrade_to_version_11_still_writes(dsn):
    """Version 11 adds `sheet_summary.writes`, which every sheet write bumps: a writer session
    role minted before the upgrade (no grant on that column) gets it from the upgrade."""
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        seeded = await seed(admin, "play")
        minted = await sessions.mint(admin, seeded["scope"], NAMESPACE, ALL_OPERATIONS)
        summary_table = qualified(admin.schema, "sheet_summary")
        async with admin.login_connection() as conn:  # the role as minted before version 11
            await conn.execute(f"REVOKE SELECT (writes), UPDATE (writes) ON {summary_table}"
                               f" FROM {quote_ident(minted.role)}")
        async with session_tenant(dsn, minted) as session:
            with pytest.raises(InsufficientPrivilegeError):
                await admit(session, seeded["run"], NAMESPACE, CONTRACT, [{"name": "before"}])
        async with admin.login_connection() as conn:
            await conn.execute(f"UPDATE {qualified(admin.schema, 'meta')} SET value = '10'"
                               " WHERE key = 'schema_version'")
        async with open_tenant(org, dsn, schema=admin.schema):  # the upgrade
            pass
        async with session_tenant(dsn, minted) as session:
            admission = await admit(session, seeded["run"], NAMESPACE, CONTRACT,
                                    [{"name": "after"}])
        assert admission.inserted == 1


async def test_a_thousand_mint_and_expire_cycles_leave_the_catalog_as_it_was(dsn, monkeypatch):
    monkeypatch.setenv("RUNPLANE_SESSIONS_PER_SERVER", "10000")  # 1,000 live at once here
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        scope = PlayScope(org, "play")
        shapes = [ALL_OPERATIONS, ["rows.read"], ["receipts"], ["array_input", "rows.upsert"]]
        # Warm up: the sheet table exists, and every object a session is granted on has an
        # explicit ACL (a first grant turns an object's default NULL ACL into its owner's entry).
        await sessions.mint(admin, scope, NAMESPACE, ALL_OPERATIONS)
        await drop_all_sessions(admin)
        before = await catalog(admin)
        for batch in range(10):
            async with trio.open_nursery() as nursery:  # a gateway mints concurrently too
                for worker in range(4):
                    nursery.start_soon(mint_many, admin, scope, shapes, 25)
            assert await sessions.drop_expired(admin) == 0  # none has expired yet
            await expire_all(admin)
            assert await sessions.drop_expired(admin) == 100
            assert await catalog(admin) == before, batch


async def test_cleanup_never_drops_a_live_session_in_use_and_cuts_and_drops_it_once_expired(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        before = await catalog(admin)
        minted = await sessions.mint(admin, PlayScope(org, "play"), NAMESPACE, ["receipts"])
        for acl in ("table_acl_entries", "schema_acl_entries"):  # a first grant makes ACLs explicit
            before.pop(acl)
        async with session_tenant(dsn, minted) as session:
            with pytest.raises(StoreUnavailableError):
                async with session.connection("receipts") as conn:
                    await conn.fetchval("SELECT lo_create(0)")  # something a session can own
                    assert await sessions.drop_expired(admin, include_unexpired=True) == 0
                    assert await session_roles(admin) == [minted.role]
                    await expire_all(admin)
                    assert await sessions.drop_expired(admin) == 1  # its connection is cut
                    await conn.fetchval("SELECT 1")
        assert await session_roles(admin) == []
        after = await catalog(admin)
        assert {name: after[name] for name in before} == before


# -- password authentication ------------------------------------------------------------------
def test_session_lines_go_ahead_of_every_rule_once():
    initdb = ("# PostgreSQL Client Authentication\n# TYPE DATABASE USER ADDRESS METHOD\n\n"
              "local   all   all                 trust\nhost    all   all   127.0.0.1/32  trust\n")
    updated = with_session_hba(initdb)
    rules = [line for line in updated.splitlines() if line.strip() and not line.startswith("#")]
    assert rules[:len(SESSION_HBA_LINES)] == list(SESSION_HBA_LINES)
    assert rules[len(SESSION_HBA_LINES):] == ["local   all   all                 trust",
                                              "host    all   all   127.0.0.1/32  trust"]
    assert with_session_hba(updated) is None
    assert HBA_MARKER in with_session_hba("")


async def test_the_embedded_server_checks_session_passwords_before_any_trust_rule(tenant,
                                                                                  admin_dsn):
    async with open_tenant("org-admin", admin_dsn, schema=tenant.schema) as admin, \
            admin.login_connection() as conn:
        rules = await conn.fetch(
            "SELECT type, user_name, auth_method FROM pg_hba_file_rules ORDER BY rule_number")
    assert [tuple(r) for r in rules[:3]] == [
        ("local", ["+runplane_sessions"], "scram-sha-256"),
        ("host", ["+runplane_sessions"], "scram-sha-256"),
        ("host", ["+runplane_sessions"], "scram-sha-256"),
    ]


def run_doctor(dsn: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNPLANE_DSN": dsn}
    return subprocess.run([sys.executable, "-m", "runplane.cli", "doctor", "--schema", fresh_schema()],
                          capture_output=True, text=True, env=env, timeout=120)


async def test_doctor_warns_when_a_session_role_gets_in_without_its_password(tenant, dsn,
                                                                            admin_dsn):
    database = f"rp_trust_{uuid.uuid4().hex[:10]}"
    async with open_tenant("org-admin", admin_dsn, schema=tenant.schema) as admin, \
            admin.login_connection() as conn:
        hba = Path(await conn.fetchval("SHOW hba_file"))
        await conn.execute(f"CREATE DATABASE {database}")
    original = hba.read_text()
    try:
        with open(hba, "r+") as handle:  # a trust rule for one database only, ahead of ours
            handle.write(f"local {database} all trust\n" + original)
            handle.truncate()
        await trio.to_thread.run_sync(_reload_and_wait, admin_dsn)
        trusting = dsn.replace("/postgres?", f"/{database}?")
        result = await trio.to_thread.run_sync(run_doctor, trusting)
        assert result.returncode == 0, result.stderr
        assert "sessions    WARNING" in result.stdout and "WITHOUT a password" in result.stdout
    finally:
        with open(hba, "r+") as handle:
            handle.write(original)
            handle.truncate()
        await trio.to_thread.run_sync(_reload_and_wait, admin_dsn)
        async with open_tenant("org-admin", admin_dsn, schema=tenant.schema) as admin, \
                admin.login_connection() as conn:
            await conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


# -- the encrypted URL ------------------------------------------------------------------------
def test_the_encrypted_url_decrypts_only_with_the_clients_key_and_authenticates_its_header():
    private, public = jwe.generate_key()
    header = {"org": "acme", "play": "enrich", "expires_at": "2030-01-01T00:00:00+00:00"}
    token = jwe.encrypt(b"postgresql://u:p@host/db", public, header)
    decoded_header, plaintext = jwe.decrypt(token, private)
    assert plaintext == b"postgresql://u:p@host/db"
    assert decoded_header == {"alg": "RSA-OAEP-256", "enc": "A256GCM", **header}
    other, _ = jwe.generate_key()
    with pytest.raises(InvalidInputError, match="does not decrypt"):
        jwe.decrypt(token, other)
    parts = token.split(".")
    forged = jwe.b64url(b'{"alg":"RSA-OAEP-256","enc":"A256GCM","org":"evil","play":"enrich"}')
    for tampered in ([forged, *parts[1:]], [*parts[:3], parts[3][:-2] + "AA", parts[4]]):
        with pytest.raises(InvalidInputError):
            jwe.decrypt(".".join(tampered), private)
    with pytest.raises(InvalidInputError, match="alg"):
        jwe.decrypt(".".join([jwe.b64url(b'{"alg":"dir","enc":"A256GCM"}'), *parts[1:]]), private)


def test_the_jwe_is_the_standard_wire_format_a_client_can_open_by_hand():
    """A client with only `cryptography` opens what we send: RSA-OAEP-SHA256 unwraps the
    content key, AES-256-GCM with the encoded header as additional data opens the payload."""
    import base64
    import json

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    def unb64(text: str) -> bytes:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))

    private, public = jwe.generate_key()
    token = jwe.encrypt(b"postgresql://u:p@host/db", public, {"org": "acme", "play": "p",
                                                              "expires_at": "2030-01-01"})
    encoded_header, wrapped, iv, ciphertext, tag = token.split(".")
    assert json.loads(unb64(encoded_header))["alg"] == "RSA-OAEP-256"
    raw_private = serialization.load_pem_private_key(private.as_pem(private=True), password=None)
    oaep = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
    content_key = raw_private.decrypt(unb64(wrapped), oaep)
    plaintext = AESGCM(content_key).decrypt(unb64(iv), unb64(ciphertext) + unb64(tag),
                                            encoded_header.encode("ascii"))
    assert plaintext == b"postgresql://u:p@host/db"

    # And the other way round: a JWE assembled by hand with those primitives decrypts.
    import os

    raw_public = raw_private.public_key()
    header = jwe.b64url(json.dumps({"alg": "RSA-OAEP-256", "enc": "A256GCM", "org": "acme"},
                                   separators=(",", ":")).encode())
    key, nonce = AESGCM.generate_key(bit_length=256), os.urandom(12)
    sealed = AESGCM(key).encrypt(nonce, b"by hand", header.encode("ascii"))
    by_hand = ".".join((header, jwe.b64url(raw_public.encrypt(key, oaep)), jwe.b64url(nonce),
                        jwe.b64url(sealed[:-16]), jwe.b64url(sealed[-16:])))
    assert jwe.decrypt(by_hand, private) == (
        {"alg": "RSA-OAEP-256", "enc": "A256GCM", "org": "acme"}, b"by hand")


def test_public_keys_are_checked_member_by_member():
    _, public = jwe.generate_key()
    for bad, member in (({**public, "kty": "EC"}, "kty"), ({**public, "n": "AQAB"}, "2048"),
                        ({**public, "e": "not base64!"}, "public_key.e"), ("key", "kty")):
        with pytest.raises(InvalidInputError, match=member):
            jwe.encrypt(b"x", bad)


async def test_the_periodic_sweep_drops_expired_sessions_and_keeps_valid_ones(dsn):
    org = unique("org")
    async with admin_tenant(dsn, org) as admin:
        expired = await sessions.mint(admin, PlayScope(org, "play"), NAMESPACE, ["receipts"])
        await expire_all(admin)
        valid = await sessions.mint(admin, PlayScope(org, "play"), NAMESPACE, ["receipts"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(sessions.sweep_expired, admin, interval_s=0.05))
            with trio.fail_after(20):
                while expired.role in await session_roles(admin):
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert await session_roles(admin) == [valid.role]
