"""Finding a row by an input value: `runplane index` (a hash index on the field's column), the
console's search answered from it, and without it a bounded scan that says so."""

from __future__ import annotations

import pytest
import trio

from runplane.actors import open_run
from runplane.engine import sheets
from runplane.engine.console import queries, search
from runplane.engine.errors import InvalidInputError
from runplane.engine.gateway import mint_token
from runplane.engine.sheets.field_index import (IndexBuild, create_field_index, field_index_name,
                                                search_values)
from runplane.engine.values.scopes import PlayScope

from .console_support import (CONTRACT, EVIL, OTHER_ORG, OTHER_SECRET, SECRET, client,
                              login_token, seed, upper)
from .gateway_support import serving

NUMBERS = sheets.SheetContract(inputs=("n", "tag"), outputs=("twice",))


@pytest.fixture
async def seeded(tenant):
    return await seed(tenant)


@pytest.fixture
async def gateway_url(tenant):
    async with serving(tenant) as server:
        yield server.url


async def twice(row: dict) -> dict:
    return {"twice": str(row["n"]) * 2}


async def _index_of(tenant, table: str, field: str) -> tuple[str, str] | None:
    sheet = queries.layout(tenant, tenant.org_id, "alpha", table)
    async with tenant.connection("sheet") as conn:
        record = await conn.fetchrow(
            "SELECT a.amname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " JOIN pg_am a ON a.oid = c.relam WHERE i.indrelid = to_regclass($1)"
            " AND c.relname LIKE '%\\_v\\_%'", sheet.qualified)
    return None if record is None else (record["amname"], record["indisvalid"])


def test_a_typed_value_matches_its_text_and_the_number_it_spells():
    assert search_values("abc") == ['"abc"']
    assert search_values("42") == ['"42"', "42"]
    assert search_values("-3.5") == ['"-3.5"', "-3.5"]
    assert search_values("007") == ['"007"']  # not a JSON number
    assert search_values("NaN") == ['"NaN"'] and search_values("true") == ['"true"']
    assert search_values('"x"') == ['"\\"x\\""']


def test_index_names_are_deterministic_and_bounded():
    from runplane.engine.sheets.layout import SheetLayout, column_name, table_name

    long = "n" * 300
    sheet = SheetLayout("s", "o", "p", long, table_name("o", "p", long))
    name = field_index_name(sheet, column_name(long))
    assert len(name.encode()) <= 63 and name == field_index_name(sheet, column_name(long))
    assert name != field_index_name(sheet, column_name("other"))


async def test_search_without_an_index_is_a_bounded_scan_that_says_so(tenant, gateway_url,
                                                                     seeded, monkeypatch):
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        table = await http.get("/ui/tables/alpha/t")
        assert 'id="search"' in table.text and '<option value="name">name</option>' in table.text
        one = await http.get("/ui/search/alpha/t", params={"field": "name", "value": "r005"})
        assert one.status_code == 303 and one.headers["location"].startswith("/ui/rows/alpha/t/")
        row = await http.get(one.headers["location"])
        assert row.status_code == 200 and "r005" in row.text and "R005" in row.text
        none = await http.get("/ui/search/alpha/t", params={"field": "name", "value": "zzz"})
        assert none.status_code == 200 and 'id="no-matches"' in none.text
        assert "searched all 64 rows" in none.text
        api = (await http.get("/ui/api/search/alpha/t",
                              params={"field": "name", "value": "bad1"})).json()
        assert api["indexed"] is False and api["complete"] is True and api["scanned"] == 64
        assert [r["status"] for r in api["rows"]] == ["failed"]

        monkeypatch.setattr(search, "SCAN_ROWS", 10)  # a table past the bound
        far = await http.get("/ui/search/alpha/t", params={"field": "name", "value": "r050"})
        assert far.status_code == 200 and 'id="no-matches"' in far.text
        assert "no index on name: searched the first 10 rows" in far.text.lower()
        assert "runplane index alpha t name" in far.text
        api = (await http.get("/ui/api/search/alpha/t",
                              params={"field": "name", "value": "r050"})).json()
        assert api["complete"] is False and api["scanned"] == 10 and api["rows"] == []


async def test_runplane_index_builds_a_hash_index_the_search_answers_from(tenant, gateway_url,
                                                                         seeded, monkeypatch):
    scope = PlayScope(tenant.org_id, "alpha")
    made = await create_field_index(tenant, scope, "t", "name")
    assert made.build is IndexBuild.CREATED and made.field == "name"
    assert (await create_field_index(tenant, scope, "t", "name")).build is IndexBuild.EXISTED
    assert await _index_of(tenant, "t", "name") == ("hash", True)
    monkeypatch.setattr(search, "SCAN_ROWS", 10)  # the index answers past any scan bound
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        assert "name (indexed)" in (await http.get("/ui/tables/alpha/t")).text
        api = (await http.get("/ui/api/search/alpha/t",
                              params={"field": "name", "value": "r050"})).json()
        assert api["indexed"] is True and len(api["rows"]) == 1
        evil = await http.get("/ui/search/alpha/t", params={"field": "name", "value": EVIL})
        assert evil.status_code == 303
        page = await http.get(evil.headers["location"])
        assert EVIL not in page.text and "&lt;script&gt;" in page.text
        none = await http.get("/ui/search/alpha/t", params={"field": "name", "value": "zzz"})
        assert "Answered from the index of name" in none.text
    # the planner can take it: an index lookup, not a scan of the sheet
    sheet = queries.layout(tenant, tenant.org_id, "alpha", "t")
    async with tenant.connection("sheet") as conn:
        async with conn.transaction():
            await conn.execute("SET LOCAL enable_seqscan = off")
            plan = "\n".join(r[0] for r in await conn.fetch(
                f"EXPLAIN {search._BY_INDEX.format(t=sheet.qualified, matches=search._matches(made.column, ['x'], 2))}",
                1, '"r050"'))
    assert made.name in plan
    # a hash entry has no size limit: a long input value still writes once the index is there
    async with open_run(tenant, "alpha") as run:
        result = await run.map("t", [{"name": "L" * 20_000}], upper, contract=CONTRACT)
    assert result.completed == 1


async def test_numbers_match_as_numbers_and_text_as_text(tenant, gateway_url):
    rows = [{"n": 42, "tag": "a"}, {"n": "42", "tag": "b"}, {"n": 7, "tag": "c"},
            {"n": "007", "tag": "d"}, {"n": 42.5, "tag": "e"}]
    async with open_run(tenant, "alpha") as run:
        await run.map("nums", rows, twice, contract=NUMBERS)
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))

        async def tags(value: str) -> list[str]:
            got = (await http.get("/ui/api/search/alpha/nums",
                                  params={"field": "n", "value": value})).json()
            keys = [r["key"] for r in got["rows"]]
            found = []
            for key in keys:
                row = (await http.get(f"/ui/api/rows/alpha/nums/{key}")).json()
                found.append(row["inputs"]["tag"])
            return sorted(found)

        for indexed in (False, True):
            assert await tags("42") == ["a", "b"]
            assert await tags("42.0") == ["a"]
            assert await tags("007") == ["d"] and await tags("7") == ["c"]
            assert await tags("42.5") == ["e"] and await tags("4") == []
            if not indexed:
                await create_field_index(tenant, PlayScope(tenant.org_id, "alpha"), "nums", "n")
        many = await http.get("/ui/search/alpha/nums", params={"field": "n", "value": "42"})
        assert many.status_code == 200 and many.text.count('href="/ui/rows/alpha/nums/') == 2


async def test_bad_searches_and_indexes_are_refused_before_any_read(tenant, gateway_url, seeded):
    scope = PlayScope(tenant.org_id, "alpha")
    for table, field, says in (("t", "upper", "output"), ("t", "nope", "not a field"),
                               ("nothing", "name", "no rows")):
        with pytest.raises(InvalidInputError, match=says):
            await create_field_index(tenant, scope, table, field)
    assert await _index_of(tenant, "t", "upper") is None
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        for params in ({"field": "upper", "value": "R001"}, {"field": "nope", "value": "x"},
                       {"field": "name"}, {"value": "x"}):
            assert (await http.get("/ui/api/search/alpha/t", params=params)).status_code == 400
        assert (await http.get("/ui/api/search/alpha/nothing",
                               params={"field": "name", "value": "x"})).status_code == 404
    async with client(gateway_url) as http:  # another org's token finds none of this org's
        await login_token(http, mint_token(SECRET, OTHER_ORG))
        mine = (await http.get("/ui/api/search/alpha/t",
                               params={"field": "name", "value": "r001"})).json()
        assert mine["rows"] == []
        theirs = await http.get("/ui/search/alpha/t", params={"field": "name",
                                                              "value": OTHER_SECRET})
        assert theirs.status_code == 303
        assert (await http.get("/ui/api/search/beta/u", params={
            "field": "name", "value": "beta-row"})).status_code == 404


async def test_the_index_command(tenant, seeded):
    from .cli_helpers import cli_env, run_cli

    env = cli_env(RUNPLANE_DSN=tenant.dsn, RUNPLANE_SCHEMA=tenant.schema, RUNPLANE_ORG=tenant.org_id)
    first = await trio.to_thread.run_sync(lambda: run_cli("index", "alpha", "t", "name", env=env))
    assert first.returncode == 0, first.stderr
    assert "of field 'name' of alpha/t: created" in first.stdout
    again = await trio.to_thread.run_sync(lambda: run_cli("index", "alpha", "t", "name", env=env))
    assert again.returncode == 0 and "already there" in again.stdout
    assert await _index_of(tenant, "t", "name") == ("hash", True)
    output = await trio.to_thread.run_sync(lambda: run_cli("index", "alpha", "t", "upper", env=env))
    assert output.returncode == 2 and "is an output" in output.stderr
