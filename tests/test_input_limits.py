"""Limits on identifiers, keys and messages: refused with a typed error before any
query, or stored and working (never a DatabaseError for input the API accepted)."""

from __future__ import annotations

import pytest

from runplane.actors import open_run
from runplane.engine import MapScope, PlayScope, RunScope, open_tenant, receipts, sheets
from runplane.engine.errors import InvalidInputError, ScopeError
from runplane.engine.runs import register
from runplane.simulations.ports import CountingPort

from .conftest import fresh_schema
from .sheet_helpers import CONTRACT, play_scope

CJK = "\u4e2d"      # 3 UTF-8 bytes
EMOJI = "\U0001f600"  # 4 UTF-8 bytes, outside the BMP
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none"  # connecting here fails: nothing may try


BAD_PARTS = [
    ("NUL", "a\x00b"), ("lone surrogate", "a\ud800b"), ("control character", "a\x1bb"),
    ("control character", "a\nb"), ("C1 control character", "a\x85b"),
    ("257 bytes", "x" * 257), ("258 UTF-8 bytes", CJK * 86),
]


@pytest.mark.parametrize("why,bad", BAD_PARTS)
def test_scope_parts_past_the_limits_are_scope_errors(why, bad):
    for build in (
        lambda: PlayScope(bad, "p"), lambda: PlayScope("o", bad), lambda: RunScope("o", "p", bad),
        lambda: MapScope("o", "p", "r", bad, "m"), lambda: MapScope("o", "p", "r", "t", bad),
    ):
        with pytest.raises(ScopeError):
            build()


def test_scope_parts_at_the_limits_are_kept_exactly():
    scope = MapScope("x" * 256, CJK * 85 + "x", EMOJI * 64, "n" * 256, "\u00e9" * 128)
    assert (scope.org_id, scope.play, scope.run_id) == ("x" * 256, CJK * 85 + "x", EMOJI * 64)
    assert scope.map_invocation_id == "\u00e9" * 128
    assert PlayScope(" o\t", "p\n") == PlayScope("o", "p")  # surrounding whitespace is stripped


async def test_open_run_refuses_a_bad_play_or_run_id_before_any_query(tenant):
    port = CountingPort(tenant)
    for play, run_id in (("a\x00b", None), ("p", "r\x00"), ("p", "r\ud800"), ("x" * 300, None)):
        with pytest.raises(ScopeError):
            async with open_run(port, play, run_id):
                pass  # pragma: no cover - never reached
    assert port.boundaries == []


async def test_identifiers_at_the_limits_round_trip(tenant):
    """The longest accepted org, play and run id (multi-byte, quotes and backslashes) register,
    claim and complete a receipt, and read back exactly."""
    org = '"\\' * 128
    async with open_tenant(org, tenant.dsn, schema=tenant.schema) as port:
        scope = RunScope(org, CJK * 85, "\\" + EMOJI * 63)
        run = await register(port, scope)
        assert run.scope == scope
        key = "k" * 1024
        assert (await receipts.claim(port, run, key)).disposition == "claimed"
        stored = await receipts.complete(port, run, key, {"v": 1})
        assert (stored.key, stored.output, stored.run_id) == (key, {"v": 1}, scope.run_id)


@pytest.mark.parametrize("schema", ["s" * 64, CJK * 21 + "s", "a\x00b", "a\ud800", "a\x07b", ""])
async def test_schemas_past_63_bytes_or_with_control_characters_are_refused_before_connecting(schema):
    with pytest.raises(InvalidInputError, match="schema"):
        async with open_tenant("org", UNREACHABLE, schema=schema):
            pass  # pragma: no cover


@pytest.mark.parametrize("role", ["r" * 64, "a\x00b", "a\x1fb"])
async def test_execution_roles_past_63_bytes_are_refused_before_connecting(role):
    with pytest.raises(InvalidInputError, match="execution_role"):
        async with open_tenant("org", UNREACHABLE, schema="s", execution_role=role):
            pass  # pragma: no cover


@pytest.mark.parametrize("org", ["o" * 257, "a\x00b", "a\ud800", "a\tb"])
async def test_tenant_orgs_past_the_limits_are_refused_before_connecting(org):
    with pytest.raises(InvalidInputError, match="org_id"):
        async with open_tenant(org, UNREACHABLE):
            pass  # pragma: no cover


async def test_two_schemas_sharing_their_first_63_bytes_never_merge(dsn):
    """A 63-byte schema is kept exactly; one byte more is refused (PostgreSQL would truncate it
    into the same schema)."""
    base = fresh_schema()
    name = base + "x" * (63 - len(base))
    async with open_tenant("org", dsn, schema=name) as port:
        try:
            async with port.connection("receipts") as conn:
                assert await conn.fetchval(
                    "SELECT count(*) FROM pg_namespace WHERE nspname = $1", name) == 1
        finally:
            async with port.connection("receipts") as conn:
                await conn.execute(f'DROP SCHEMA "{name}" CASCADE')
    with pytest.raises(InvalidInputError, match="63"):
        async with open_tenant("org", dsn, schema=name + "y"):
            pass  # pragma: no cover


async def test_keys_are_counted_in_bytes_before_any_query(tenant):
    port = CountingPort(tenant)
    run = await register(tenant, RunScope(tenant.org_id, "play", "r1"))
    for key in (CJK * 1024, EMOJI * 513, CJK * 683):
        with pytest.raises(InvalidInputError, match="2048 UTF-8 bytes"):
            await receipts.claim(port, run, key)
        with pytest.raises(InvalidInputError, match="2048 UTF-8 bytes"):
            await sheets.admit(port, run, "t", CONTRACT, [{"name": "a"}], keys=[key])
        with pytest.raises(InvalidInputError, match="2048 UTF-8 bytes"):
            sheets.RowOutcome(key, "completed")
    assert port.boundaries == []
    # 682 CJK characters (2,046 bytes) and 512 emoji (2,048 bytes) are stored and work
    for key in (CJK * 682, EMOJI * 512):
        assert (await receipts.claim(tenant, run, key)).receipt.key == key
        admission = await sheets.admit(tenant, run, "t", CONTRACT, [{"name": key[:3]}], keys=[key])
        assert [row.key for row in admission.pending] == [key]
        done = await sheets.complete(tenant, run, "t", CONTRACT,
                                     [sheets.RowOutcome(key, "completed", data={"score": 1})])
        assert done.committed_keys == (key,)


async def test_a_receipt_key_whose_stored_form_is_past_the_index_limit_is_refused(tenant):
    """Quotes and backslashes double in the stored JSON key: identifiers and a key each within
    their limits can still make a stored key past what the index holds."""
    org = '"\\' * 128
    async with open_tenant(org, tenant.dsn, schema=tenant.schema) as port:
        counting = CountingPort(port)
        run = await register(port, RunScope(org, '\\"' * 128, "r"))
        with pytest.raises(InvalidInputError, match="stored receipt key"):
            await receipts.claim(counting, run, CJK * 682)
        assert counting.boundaries == []


async def test_failure_messages_with_nul_or_lone_surrogates_are_stored_cleaned(tenant):
    run = await register(tenant, RunScope(tenant.org_id, "play", "r1"))
    receipt = await receipts.fail(tenant, run, "k", "bad\x00byte \ud800")
    assert receipt.error == "bad\ufffdbyte \ufffd"
    assert (await receipts.get(tenant, PlayScope(tenant.org_id, "play"), "k")).error == receipt.error
    admission = await sheets.admit(tenant, run, "t", CONTRACT, [{"name": "a"}])
    key = admission.pending[0].key
    await sheets.complete(tenant, run, "t", CONTRACT,
                          [sheets.RowOutcome(key, "failed", error="x\x00y")])
    [row] = await sheets.read_rows(tenant, play_scope(tenant), "t")
    assert row["_error"] == "x\ufffdy"


async def test_read_rows_refuses_a_bad_run_id_before_any_query(tenant):
    port = CountingPort(tenant)
    for run_id in ("a\x00", "x" * 257, "a\ud800"):
        with pytest.raises((InvalidInputError, ScopeError)):
            await sheets.read_rows(port, play_scope(tenant), "t", run_id=run_id)
    assert port.boundaries == []
