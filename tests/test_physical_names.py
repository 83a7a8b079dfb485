"""Physical names never collide: two fields never share a column, two sheets never share a table.

The first-choice column of a field carries 48 bits of its hash, so collisions are easy to find
(the pair below is one). These tests write through such a pair and check that each field keeps
its own column, whichever path created it (the contract, an extension by completion data, or the
read-only probe), and that a table-name collision is refused instead of mixing two sheets.
"""

from __future__ import annotations

import pytest

from runplane.engine.errors import ConflictError, DatabaseError
from runplane.engine.sheets import (
    RowOutcome, SheetContract, admit, complete, ensure_sheet, probe, read_rows,
)
from runplane.engine.sheets import layout as layout_module
from runplane.engine.sheets.audit import error_counts, failed_rows, run_rows
from runplane.engine.sheets.column_registry import allocate_columns
from runplane.engine.sheets.layout import column_name, layout_for
from tests.sheet_helpers import PLAY, counters_match, new_run, play_scope

A, B = "(*+$*,+<*/-$", "-,..+*!&,.:/"  # both hash to the first-choice column f_d62521967814
NS = "collide"


def test_the_pair_collides_on_its_first_choice():
    assert column_name(A) == column_name(B)


def test_allocation_gives_every_field_its_own_column():
    first = allocate_columns([A, B], {}, set())
    assert first[A] == column_name(A) and first[B] != first[A]
    # B extending a sheet where A already holds the name; a stray column of that name too.
    later = allocate_columns([B], {A: column_name(A)}, {column_name(A), column_name(B, 1)})
    assert later[B] not in (column_name(A), column_name(B, 1))


async def registry(tenant, ns=NS) -> dict[str, str]:
    async with tenant.connection("sheet") as conn:
        rows = await conn.fetch(
            f'SELECT field, column_name FROM "{tenant.schema}".sheet_columns '
            "WHERE org_id = $1 AND play = $2 AND table_namespace = $3",
            tenant.org_id, PLAY, ns)
    return {r["field"]: r["column_name"] for r in rows}


async def test_colliding_contract_fields_keep_their_own_values(tenant):
    contract = SheetContract(inputs=("name",), outputs=(A, B))
    await ensure_sheet(tenant, play_scope(tenant), NS, contract)
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, contract, [{"name": "x"}, {"name": "y"}])
    keys = [row.key for row in admission.pending]
    await complete(tenant, run, NS, contract, [
        RowOutcome(keys[0], "completed", {A: "a0", B: "b0"}),
        RowOutcome(keys[1], "completed", {B: "b1"}),
    ])
    rows = {r["_key"]: r for r in await read_rows(tenant, play_scope(tenant), NS)}
    assert (rows[keys[0]][A], rows[keys[0]][B]) == ("a0", "b0")
    assert (rows[keys[1]][A], rows[keys[1]][B]) == (None, "b1")
    names = await registry(tenant)
    assert len(set(names.values())) == len(names) == 3  # name, A, B
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


async def test_a_colliding_field_added_by_completion_gets_a_new_column(tenant):
    contract = SheetContract(inputs=("name",), outputs=(A,))
    run = await new_run(tenant, PLAY, "r1")
    admission = await admit(tenant, run, NS, contract, [{"name": "x"}])
    key = admission.pending[0].key
    await complete(tenant, run, NS, contract, [RowOutcome(key, "completed", {A: 1})])
    await complete(tenant, run, NS, contract, [RowOutcome(key, "completed", {B: 2})])
    [row] = await read_rows(tenant, play_scope(tenant), NS)
    assert (row[A], row[B]) == (1, 2)
    names = await registry(tenant)
    assert names[A] == column_name(A) and names[B] not in (column_name(A),)


async def test_the_probe_reads_the_registered_columns_not_the_first_choice(tenant):
    contract = SheetContract(inputs=("name",), outputs=(A, B))
    first = await new_run(tenant, PLAY, "r1")
    rows = [{"name": "x"}]
    admission = await admit(tenant, first, NS, contract, rows)
    key = admission.pending[0].key
    # Only B is written: under first-choice names the probe would read A's column for B.
    await complete(tenant, first, NS, contract, [RowOutcome(key, "completed", {A: "", B: "b"})])
    second = await new_run(tenant, PLAY, "r2")
    assert await probe(tenant, second, NS, contract, rows) is None  # A is empty: not settled
    await complete(tenant, first, NS, contract, [RowOutcome(key, "completed", {A: "a", B: "b"})])
    third = await new_run(tenant, PLAY, "r3")
    settled = await probe(tenant, third, NS, contract, rows)
    assert settled is not None and settled.cached == 1


async def test_the_registry_refuses_two_fields_in_one_column(tenant):
    await ensure_sheet(tenant, play_scope(tenant), NS, SheetContract(outputs=(A,)))
    with pytest.raises(DatabaseError) as caught:
        async with tenant.connection("sheet") as conn:
            await conn.execute(
                f'INSERT INTO "{tenant.schema}".sheet_columns '
                "(org_id, play, table_namespace, field, column_name, position) "
                "VALUES ($1, $2, $3, $4, $5, 99)",
                tenant.org_id, PLAY, NS, B, column_name(A))
    assert caught.value.sqlstate == "23505"


async def test_sheets_whose_table_names_collide_are_refused_not_mixed(tenant, monkeypatch):
    real = layout_module.table_name
    monkeypatch.setattr(layout_module, "table_name",
                        lambda org, play, ns: real(org, play, "first"))
    contract = SheetContract(inputs=("name",), outputs=("score",))
    run = await new_run(tenant, PLAY, "r1")
    assert layout_for(tenant, play_scope(tenant), "first").table == \
        layout_for(tenant, play_scope(tenant), "second").table
    admission = await admit(tenant, run, "first", contract, [{"name": "x"}])
    await complete(tenant, run, "first", contract,
                   [RowOutcome(admission.pending[0].key, "completed", {"score": 1})])
    with pytest.raises(ConflictError, match="collide"):
        await admit(tenant, run, "second", contract, [{"name": "y"}])
    with pytest.raises(ConflictError, match="collide"):
        await ensure_sheet(tenant, play_scope(tenant), "second", contract)
    with pytest.raises(ConflictError, match="collide"):
        await read_rows(tenant, play_scope(tenant), "second")
    for read in (failed_rows, error_counts):
        with pytest.raises(ConflictError, match="collide"):
            await read(tenant, play_scope(tenant), "second")
    with pytest.raises(ConflictError, match="collide"):
        await run_rows(tenant, play_scope(tenant), "second", ["r1"])
    [row] = await read_rows(tenant, play_scope(tenant), "first")
    assert (row["name"], row["score"]) == ("x", 1)


async def test_a_schema_whose_registry_already_shares_a_column_is_repaired_on_upgrade(dsn):
    """Version 4 registered a colliding field onto the column its twin held; the upgrade keeps
    the first registration only, and the next write gives the other field a column of its own."""
    from pathlib import Path

    from runplane.engine import open_tenant
    from runplane.engine.sql import qualified, quote_ident
    from tests.conftest import fresh_schema

    schema, org = fresh_schema(), "legacy-org"
    ddl = (Path(__file__).parent / "schema_v4.sql").read_text()
    async with open_tenant(org, dsn, schema=f"{schema}_scratch") as scratch:
        async with scratch.login_connection() as conn:
            await conn.execute(ddl.format(s=quote_ident(schema)))
            await conn.execute(
                f"INSERT INTO {qualified(schema, 'sheet_columns')} (org_id, play, table_namespace,"
                " field, column_name, position) VALUES ($1, $2, $3, $4, $6, 1),"
                " ($1, $2, $3, $5, $6, 2)", org, PLAY, NS, A, B, column_name(A))
        try:
            async with open_tenant(org, dsn, schema=schema) as tenant:
                assert await registry(tenant) == {A: column_name(A)}
                contract = SheetContract(inputs=("name",), outputs=(A, B))
                run = await new_run(tenant, PLAY, "r1")
                admission = await admit(tenant, run, NS, contract, [{"name": "x"}])
                await complete(tenant, run, NS, contract, [
                    RowOutcome(admission.pending[0].key, "completed", {A: "a", B: "b"})])
                [row] = await read_rows(tenant, play_scope(tenant), NS)
                assert (row[A], row[B]) == ("a", "b")
                names = await registry(tenant)
                assert names[A] == column_name(A) != names[B]
        finally:
            async with scratch.login_connection() as conn:
                await conn.execute(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE")
