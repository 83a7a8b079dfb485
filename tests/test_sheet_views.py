"""A sheet read by hand (§27, issue 35 item 11): `runplane sql PLAY TABLE` prints a readable
`SELECT`, and `runplane psql` offers each sheet as a view in `<schema>_views`."""

from __future__ import annotations

import pytest
import trio

from runplane.engine import open_tenant
from runplane.engine.sheets.views import identifier

from .cli_helpers import run_cli, schema, write_play  # noqa: F401 - fixture


@pytest.fixture
def views_dropped(schema, dsn):
    """The test's `<schema>_views` is dropped afterwards (the tenant schema's fixture drops
    the views themselves with the tables they read)."""
    yield

    async def drop() -> None:
        async with open_tenant("local", dsn, schema=schema, bootstrap=False) as tenant:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}_views" CASCADE')

    trio.run(drop)

WIDER_PLAY = '''
from runplane.engine.sheets import SheetContract

PLAY = "ops"
CONTRACT = SheetContract(inputs=("name",), outputs=("size", "shout", "vowels"))


async def measure(row):
    name = row["name"]
    return {"size": len(name), "shout": name.upper(),
            "vowels": sum(ch in "aeiou" for ch in name)}


async def play(run, rows):
    return await run.map("things", rows, measure, contract=CONTRACT, force=True)
'''


def psql(schema: str, sql: str):
    done = run_cli("psql", "--schema", schema, "--", "-XAt", "-F", ",", "-v", "ON_ERROR_STOP=1",
                   "-c", sql)
    assert done.returncode == 0, done.stderr
    return done


def test_identifiers_past_63_bytes_keep_a_prefix_and_a_hash_of_the_whole_name():
    assert identifier("local/ops/things") == "local/ops/things"
    long_a, long_b = "local/" + "é" * 40 + "/a", "local/" + "é" * 40 + "/b"
    short_a, short_b = identifier(long_a), identifier(long_b)
    assert short_a != short_b
    assert all(len(name.encode()) <= 63 for name in (short_a, short_b))
    assert short_a.startswith("local/éé") and "~" in short_a


def test_runplane_sql_prints_a_select_with_readable_names_that_psql_runs(schema, tmp_path,
                                                                         views_dropped):
    play, rows = write_play(tmp_path, ["alpha", "bad1"])
    assert run_cli("run", str(play), "--input", str(rows), "--schema", schema).returncode == 0
    printed = run_cli("sql", "ops", "things", "--schema", schema)
    assert printed.returncode == 0, printed.stderr
    select = printed.stdout
    assert select.startswith('SELECT "_key",\n       "_status",\n       "_error",'), select
    for field in ("name", "size", "shout"):
        assert f' AS "{field}"' in select, select
    ran = psql(schema, select)
    assert sorted(line.split(",")[1:3] + line.split(",")[-3:] for line in
                  ran.stdout.splitlines()) == [
        ["enriched", "", '"alpha"', "5", '"ALPHA"'],  # cells are jsonb, as stored
        ["failed", "quota exceeded", '"bad1"', "", ""]], ran.stdout
    missing = run_cli("sql", "ops", "nothing", "--schema", schema)
    assert missing.returncode == 1 and "has no table 'nothing'" in missing.stderr


def test_psql_offers_each_sheet_as_a_view_kept_in_step_with_its_columns(schema, tmp_path,
                                                                        views_dropped):
    play, rows = write_play(tmp_path, ["alpha", "bb"])
    assert run_cli("run", str(play), "--input", str(rows), "--schema", schema).returncode == 0
    views = f"{schema}_views"
    seen = psql(schema, 'SELECT name, size, shout, _status FROM "local/ops/things" ORDER BY name')
    assert seen.stdout == '"alpha",5,"ALPHA",enriched\n"bb",2,"BB",enriched\n'
    options = psql(schema, f"SELECT reloptions FROM pg_class WHERE oid = "
                           f"'{views}.\"local/ops/things\"'::regclass")
    assert options.stdout.strip() == "{security_invoker=true}"

    # A map adds a column: the next psql session (or `runplane views`) has it.
    wider = tmp_path / "wider_play.py"
    wider.write_text(WIDER_PLAY)
    assert run_cli("run", str(wider), "--input", str(rows), "--schema", schema).returncode == 0
    refreshed = run_cli("views", "--schema", schema)
    assert refreshed.returncode == 0 and refreshed.stdout == f"1 view in {views}\n", refreshed
    seen = psql(schema, f'SELECT name, vowels FROM {views}."local/ops/things" ORDER BY name')
    assert seen.stdout == '"alpha",2\n"bb",0\n'


async def test_a_map_that_adds_a_column_brings_the_sheets_view_along(tenant):
    """Once `<schema>_views` exists, a write that adds a column refreshes that sheet's view in
    the same transaction: no `runplane views` needed."""
    from runplane.actors import open_run
    from runplane.engine.sheets import SheetContract, views

    async def one(row):
        return {"size": len(row["name"]), "shout": row["name"].upper()}

    narrow = SheetContract(inputs=("name",), outputs=("size",))
    wide = SheetContract(inputs=("name",), outputs=("size", "shout"))
    async with open_run(tenant, "ops") as run:
        await run.map("things", [{"name": "ab"}], one, contract=narrow)
    await views.sync_views(tenant)
    view = (f'"{views.views_schema(tenant.schema)}".'
            f'"{views.identifier(f"{tenant.org_id}/ops/things")}"')
    try:
        async with open_run(tenant, "ops", force=True) as run:
            await run.map("things", [{"name": "ab"}], one, contract=wide)
        async with tenant.connection("sheet") as conn:
            row = dict(await conn.fetchrow(f"SELECT * FROM {view}"))
        assert (row["size"], row["shout"]) == ("2", '"AB"')
    finally:
        async with tenant.connection("sheet") as conn:
            await conn.execute(f'DROP SCHEMA "{views.views_schema(tenant.schema)}" CASCADE')
