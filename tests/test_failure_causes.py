"""A failed row's cause is stored with it (`_cause`, indexed) and every surface groups by it:
`runplane failures` and its `--json`, `sheets.error_counts`, the console's top errors and its
failures page filtered by cause. Rows failed before the column read their cause from the
message."""

from __future__ import annotations

import json

from runplane.engine import sheets
from runplane.engine.sheets import RowOutcome, admit, complete
from runplane.engine.sheets.layout import column, layout_for

from .sheet_helpers import CONTRACT, PLAY, new_run, play_scope

NS = "causes"


async def causes_of(tenant, namespace: str = NS) -> dict[str, tuple[str, str | None, str | None]]:
    """name -> (status, error, cause) of every stored row."""
    layout = layout_for(tenant, play_scope(tenant), namespace)
    async with tenant.connection("sheet") as conn:
        records = await conn.fetch(f"SELECT _status, _error, _cause, {column('name')}::text AS name"
                                   f" FROM {layout.qualified}")
    return {json.loads(r["name"]): (r["_status"], r["_error"], r["_cause"]) for r in records}


async def test_a_failed_row_stores_its_cause_and_completing_or_readmitting_it_clears_it(tenant):
    run = await new_run(tenant, PLAY, "r1")
    rows = [{"name": "BGR"}, {"name": "LAX"}, {"name": "ok"}]
    bgr, lax, ok = (await admit(tenant, run, NS, CONTRACT, rows)).pending
    await complete(tenant, run, NS, CONTRACT, [
        # the worker's cause (it knew the row's inputs) is stored as given
        RowOutcome(bgr.key, "failed", error="quota exceeded for BGR",
                   cause="quota exceeded for <name>"),
        # an outcome without one gets its message's
        RowOutcome(lax.key, "failed", error="no data for r13 'LAX'"),
        RowOutcome(ok.key, "completed", {"score": 1}),
    ])
    assert await causes_of(tenant) == {
        "BGR": ("failed", "quota exceeded for BGR", "quota exceeded for <name>"),
        "LAX": ("failed", "no data for r13 'LAX'", "no data for rN '…'"),
        "ok": ("enriched", None, None),
    }
    second = await new_run(tenant, PLAY, "r2")
    readmitted = (await admit(tenant, second, NS, CONTRACT, rows[:2])).pending
    assert {row.key for row in readmitted} == {bgr.key, lax.key}
    stored = await causes_of(tenant)
    assert stored["BGR"] == stored["LAX"] == ("pending", None, None)
    await complete(tenant, second, NS, CONTRACT, [RowOutcome(bgr.key, "completed", {"score": 2})])
    assert (await causes_of(tenant))["BGR"] == ("enriched", None, None)


async def test_a_cause_travels_through_the_gateway(tenant):
    from runplane.engine.gateway import open_gateway

    from .gateway_support import FAST_RETRY, serving, token_for

    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gateway:
            run = await new_run(gateway, PLAY, "r1")
            bgr, lax = (await admit(gateway, run, NS, CONTRACT,
                                    [{"name": "BGR"}, {"name": "LAX"}])).pending
            await complete(gateway, run, NS, CONTRACT, [
                RowOutcome(bgr.key, "failed", error="quota exceeded for BGR",
                           cause="quota exceeded for <name>"),
                RowOutcome(lax.key, "failed", error="quota exceeded for LAX"),
            ])
    stored = await causes_of(tenant)
    assert stored["BGR"][2] == "quota exceeded for <name>"
    assert stored["LAX"][2] == "quota exceeded for LAX"  # no cause sent: the message's own


async def test_a_sheet_from_before_causes_gets_the_column_and_its_index_on_first_write(tenant):
    run = await new_run(tenant, PLAY, "r1")
    a, b = (await admit(tenant, run, NS, CONTRACT, [{"name": "a1"}, {"name": "b1"}])).pending
    await complete(tenant, run, NS, CONTRACT, [RowOutcome(a.key, "failed", error="no data for 7")])
    layout = layout_for(tenant, play_scope(tenant), NS)
    async with tenant.connection("sheet") as conn:
        await conn.execute(f"ALTER TABLE {layout.qualified} DROP COLUMN _cause")  # and its index
    # Readers of the older sheet still group its failures, from the message.
    counts = await sheets.error_counts(tenant, play_scope(tenant), NS)
    assert [(c.pattern, c.count) for c in counts.causes] == [("no data for N", 1)]
    await complete(tenant, run, NS, CONTRACT, [RowOutcome(b.key, "failed", error="no data for 8")])
    async with tenant.connection("sheet") as conn:
        index = await conn.fetchval(
            "SELECT pg_get_indexdef(to_regclass($1))", layout.cause_index)
    assert index is not None and "WHERE (_cause IS NOT NULL)" in index, index
    stored = await causes_of(tenant)
    assert stored["a1"] == ("failed", "no data for 7", None)  # failed before: no stored cause
    assert stored["b1"] == ("failed", "no data for 8", "no data for N")
    counts = await sheets.error_counts(tenant, play_scope(tenant), NS)
    assert [(c.pattern, c.count, c.variants) for c in counts.causes] == [("no data for N", 2, 2)]
    assert counts.distinct_causes == 1
    failed = await sheets.failed_rows(tenant, play_scope(tenant), NS)
    assert [(row.error, row.cause) for row in failed] == [
        ("no data for 7", "no data for N"), ("no data for 8", "no data for N")]



GEO_PLAY = '''
from runplane.engine.sheets import SheetContract

CONTRACT = SheetContract(inputs=("iata",), outputs=("city",))


async def locate(row):
    code = row["iata"]
    if code.startswith("Q"):
        raise KeyError(f"no airport {code!r} in the catalogue")
    if code.startswith("O"):
        return {"city": code.lower()}
    raise RuntimeError(f"geo API: quota exceeded for {code}")


async def play(run, rows):
    return await run.map("airports", rows, locate, contract=CONTRACT, fail_fast=False)
'''

QUOTA = "geo API: quota exceeded for <iata>"


def geo_codes() -> list[str]:
    """199 distinct 3-letter codes that fail with the quota message (none is a word of it),
    3 that fail another way, 2 that succeed."""
    letters = "BCDFGHJKLMNPRSTVWXZ"
    quota = [a + b + c for a in letters for b in letters for c in letters][:199]
    return quota + ["QAA", "QBB", "QCC", "OKA", "OKB"]


def error_rows(html: str, section: str) -> list[list[str]]:
    """The cells of the errors table after `section` in a console page, tags stripped."""
    import re

    table = re.search(r'<table class="errors">(.*?)</table>', html.split(section, 1)[1], re.S)
    assert table is not None, html
    rows = re.findall(r"<tr>(.*?)</tr>", table.group(1), re.S)[1:]
    return [[re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in rows]


async def test_one_cause_per_kind_of_failure_on_every_surface(dsn, tmp_path):
    """199 rows failing with their own code in the message are one cause, and a second kind of
    failure another: exactly two causes in `failures`, `--json`, `error_counts` and the
    console (failures page, its API and the run page), 199 rows for the first."""
    import html as html_module

    import trio

    from runplane.engine import PlayScope, open_tenant
    from runplane.engine.gateway import mint_token

    from .cli_helpers import cli_env, run_cli
    from .conftest import fresh_schema
    from .console_support import client, login_token
    from .gateway_support import SECRET, serving

    schema = fresh_schema()
    play = tmp_path / "geo.py"
    play.write_text(GEO_PLAY)
    rows = tmp_path / "codes.csv"
    rows.write_text("iata\n" + "".join(f"{code}\n" for code in geo_codes()))
    env = cli_env(RUNPLANE_DSN=dsn)
    env.pop("RUNPLANE_ORG", None)
    env.pop("RUNPLANE_SCHEMA", None)

    def cli(*args: str):
        return trio.to_thread.run_sync(lambda: run_cli(*args, "--schema", schema, env=env))

    async with open_tenant("local", dsn, schema=schema) as tenant:
        try:
            done = await cli("run", str(play), "--input", str(rows))
            assert done.returncode == 0, done.stderr
            assert "202 failed rows in table airports, 2 causes (top 2):" in done.stdout, done.stdout
            (run_id,) = {line.split()[1] for line in done.stdout.splitlines()
                         if line.startswith("run ") and " of play geo started" in line}

            # runplane failures, and --json
            shown = await cli("failures", "geo", "airports")
            assert "most common errors (2 causes, top 2):" in shown.stdout, shown.stdout
            summary = shown.stdout.split("most common errors", 1)[1].splitlines()[2:]
            assert [line.split()[0] for line in summary if line.strip()] == ["199", "3"]
            assert "(+198 like it)" in summary[0] and "geo API: quota exceeded for" in summary[0]
            document = json.loads((await cli("failures", "geo", "airports", "--json")).stdout)
            assert document["causes"] == 2
            assert document["rows"] and all(
                row["cause"] == (QUOTA if "quota" in row["error"] else
                                 "\"no airport '…' in the catalogue\"")
                for row in document["rows"])
            assert [(e["count"], e["variants"], e["pattern"]) for e in document["errors"]] == [
                (199, 199, QUOTA), (3, 3, "\"no airport '…' in the catalogue\"")]

            # sheets.error_counts: the messages as before, the causes beside them
            counts = await sheets.error_counts(tenant, PlayScope("local", "geo"), "airports")
            assert (counts.failed, counts.distinct, len(counts.top)) == (202, 202, 5)
            assert counts.distinct_causes == 2
            assert [(c.pattern, c.count, c.variants) for c in counts.causes] == [
                (QUOTA, 199, 199), ("\"no airport '…' in the catalogue\"", 3, 3)]

            # the console: the failures page, its API, the run page, the filter by cause
            async with serving(tenant) as server, client(server.url) as http:
                await login_token(http, mint_token(SECRET, "local"))
                page = (await http.get("/ui/failures/geo/airports")).text
                top = error_rows(page, "Most common errors")
                assert [(row[0], html_module.unescape(row[1])) for row in top] == [
                    ("199", QUOTA), ("3", "\"no airport '…' in the catalogue\"")]
                api = (await http.get("/ui/api/failures/geo/airports")).json()
                assert [(c["pattern"], c["count"]) for c in api["causes"]] == [
                    (QUOTA, 199), ("\"no airport '…' in the catalogue\"", 3)]
                run_page = (await http.get(f"/ui/runs/geo/{run_id}")).text
                assert [row[0] for row in error_rows(run_page, "Top errors of this run")] == [
                    "199", "3"]
                keys, after = [], None
                while True:
                    params = {"cause": QUOTA, **({"after": json.dumps(after)} if after else {})}
                    listed = (await http.get("/ui/api/failures/geo/airports", params=params)).json()
                    keys += [row["_key"] for row in listed["rows"]]
                    assert all(row["_error"].startswith("geo API") for row in listed["rows"])
                    after = listed["next"]
                    if after is None:
                        break
                assert len(keys) == len(set(keys)) == 199
                filtered = (await http.get("/ui/failures/geo/airports",
                                           params={"cause": QUOTA})).text
                assert 'id="cause"' in filtered and "no airport" not in filtered.split(
                    "Most common errors")[0]
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
