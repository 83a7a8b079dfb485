"""A row's page: its inputs, its outputs with their cells (status, completed_at, run, attempts,
the value kept), its failure and the runs that touched it; linked from the table and failures
pages; only the viewer's."""

from __future__ import annotations

import re

import pytest

from runplane.actors import open_run
from runplane.engine.gateway import mint_token

from .console_support import (CONTRACT, EVIL, OTHER_ORG, SECRET, client, login_token, seed,
                              upper)
from .gateway_support import serving


@pytest.fixture
async def seeded(tenant):
    return await seed(tenant)


@pytest.fixture
async def gateway_url(tenant):
    async with serving(tenant) as server:
        yield server.url


async def _key_of(http, name: str) -> str:
    found = (await http.get("/ui/api/search/alpha/t",
                            params={"field": "name", "value": name})).json()
    (row,) = found["rows"]
    return row["key"]


async def failing_r005(row: dict) -> dict:
    if row["name"] == "r005":
        raise ValueError("r005 broke this time")
    return await upper(row)


async def test_a_completed_rows_page_shows_its_cells_and_run(tenant, gateway_url, seeded):
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        key = await _key_of(http, "r005")
        row = (await http.get(f"/ui/api/rows/alpha/t/{key}")).json()
        assert row["inputs"] == {"name": "r005"} and row["outputs"] == {"upper": "R005"}
        cell = row["_cells"]["upper"]
        assert cell["status"] == "completed" and cell["run_id"] == seeded.alpha_run
        assert cell["attempts"] == 1 and cell["last_value"] == "R005"
        assert cell["completed_at"].endswith("+00:00")
        assert [(r["run_id"], r["roles"]) for r in row["runs"]] == [
            (seeded.alpha_run, ["wrote it last", "wrote upper"])]
        page = (await http.get(f"/ui/rows/alpha/t/{key}")).text
        assert "R005" in page and f'href="/ui/runs/alpha/{seeded.alpha_run}"' in page
        assert 'id="failure"' not in page
        # every row of the table page links to its page
        table = (await http.get("/ui/tables/alpha/t")).text
        assert len(re.findall(r'href="/ui/rows/alpha/t/[^"]+"', table)) == 50
        assert (await http.get("/ui/rows/alpha/t/no-such-key")).status_code == 404
        assert (await http.get("/ui/api/rows/alpha/nothing/x")).status_code == 404


async def test_a_failed_rows_page_shows_its_failure_across_runs(tenant, gateway_url, seeded):
    rows = [{"name": f"bad{i}"} for i in range(3)]
    async with open_run(tenant, "alpha") as run:
        await run.map("t", rows, upper, contract=CONTRACT)
        second = run.run_id
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        failures = (await http.get("/ui/failures/alpha/t")).text
        key = await _key_of(http, "bad1")
        assert f'href="/ui/rows/alpha/t/{key}"' in failures
        row = (await http.get(f"/ui/api/rows/alpha/t/{key}")).json()
        assert row["status"] == "failed" and "no data for bad1" in row["error"]
        assert row["cause"] is not None and "bad1" not in row["cause"]
        assert row["outputs"] == {"upper": None} and row["attempts"] >= 2
        assert row["failed_runs"] == 2
        roles = {r["run_id"]: r["roles"] for r in row["runs"]}
        assert "failed it last" in roles[second] and "wrote it last" in roles[second]
        page = (await http.get(f"/ui/rows/alpha/t/{key}")).text
        assert 'id="failure"' in page and "It failed in 2 run(s)" in page
        assert "/ui/failures/alpha/t?cause=" in page
        assert EVIL not in page and "&lt;script&gt;" in page  # the error holds it, escaped


async def test_a_recomputed_cell_that_failed_shows_null_and_keeps_its_last_value(
        tenant, gateway_url, seeded):
    async with open_run(tenant, "alpha") as run:
        await run.map("t", [{"name": "r005"}], failing_r005, contract=CONTRACT, force=True)
        forced = run.run_id
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        key = await _key_of(http, "r005")
        row = (await http.get(f"/ui/api/rows/alpha/t/{key}")).json()
        assert row["outputs"] == {"upper": None}
        cell = row["_cells"]["upper"]
        assert cell["status"] in ("failed", "pending") and cell["last_value"] == "R005"
        assert forced in {r["run_id"] for r in row["runs"]}
        page = (await http.get(f"/ui/rows/alpha/t/{key}")).text
        assert "<code>&quot;R005&quot;</code>" in page  # the value kept, not shown as current


async def test_only_the_viewers_rows(tenant, gateway_url, seeded):
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        key = await _key_of(http, "r005")
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, OTHER_ORG))
        assert (await http.get(f"/ui/rows/alpha/t/{key}")).status_code == 404
        assert (await http.get(f"/ui/api/rows/alpha/t/{key}?org={tenant.org_id}")).status_code == 404
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id, plays=("beta",)))
        assert (await http.get(f"/ui/api/rows/alpha/t/{key}")).status_code == 404
    async with client(gateway_url) as http:
        assert (await http.get(f"/ui/api/rows/alpha/t/{key}")).status_code == 401
        assert (await http.get(f"/ui/rows/alpha/t/{key}")).status_code == 303


async def test_failures_grouped_by_cause_with_counts_and_a_filter(tenant, gateway_url, seeded):
    from runplane.engine.console import queries, rows

    causes = await rows.top_errors(tenant, tenant.org_id, "alpha", "t", limit=20)
    assert [(c.count, c.variants) for c in causes] == [(3, 3)]
    (cause,) = causes
    async with client(gateway_url) as http:
        await login_token(http, mint_token(SECRET, tenant.org_id))
        page = (await http.get("/ui/failures/alpha/t", params={"cause": cause.pattern})).text
        assert 'id="causes"' in page and "(3 rows)" in page
        assert len(re.findall(r'href="/ui/rows/alpha/t/[^"]+"', page)) == 3
    # a failed row without a stored cause (failed before causes were stored) still counts:
    # the index of stored causes no longer accounts for every failed row, so the sheet is read
    sheet = queries.layout(tenant, tenant.org_id, "alpha", "t")
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"UPDATE {sheet.qualified} SET _cause = NULL, _error = 'old failure'"
                           " WHERE _key = (SELECT min(_key) FROM "
                           f"{sheet.qualified} WHERE _status = 'failed')")
    causes = await rows.top_errors(tenant, tenant.org_id, "alpha", "t", limit=20)
    assert sorted((c.pattern, c.count) for c in causes) == sorted(
        [(cause.pattern, 2), ("old failure", 1)])
