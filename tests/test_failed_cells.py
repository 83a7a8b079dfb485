"""A failed row never shows an earlier output as current (§27, §35).

A row that completed in run 1 and fails in a forced run 2 reads as null in each of its outputs
on every read path — `read_rows`, datasets (direct and `MapResult.dataset`), the JSON lines
(server-side COPY), CSV and Parquet exports, the console's table — while `cells=True` /
`--cells` still reports the value kept (`_cells[f].last_value`) with the cell's status. A forced
rerun interrupted before a row completes shows its cells pending (null). Counters still equal
COUNT(*): `force` moves the column counters at admission.
"""

from __future__ import annotations

import csv
import datetime
import json

import attrs
import pytest

from runplane.actors import open_run
from runplane.engine import sheets
from runplane.engine.console import rows as console_rows
from runplane.engine.sheets import SheetContract

from .gateway_support import gateway, server  # noqa: F401  (fixtures)
from .sheet_helpers import PLAY, counters_match, new_run, play_scope, raw_rows
from .test_export import export

CONTRACT = SheetContract(inputs=("name",), outputs=("score", "label"))
NS = "cells"
NAMES = ("a", "b")


@attrs.frozen
class Forced:
    """Run 1 completed both rows; forced run 2 failed `a` and recomputed `b`."""

    first: str
    second: str
    result: object


async def score_run1(row):
    return {"score": len(row["name"]), "label": row["name"].upper()}


async def score_run2(row):
    if row["name"] == "a":
        raise ValueError("the provider is down")
    return {"score": 100, "label": "second"}


async def check_counters(tenant):
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


@pytest.fixture
async def forced(tenant) -> Forced:
    rows = [{"name": n} for n in NAMES]
    async with open_run(tenant, PLAY) as run:
        first = run.run_id
        assert (await run.map(NS, rows, score_run1, contract=CONTRACT)).completed == 2
    async with open_run(tenant, PLAY, force=True) as run:
        second = run.run_id
        result = await run.map(NS, rows, score_run2, contract=CONTRACT)
    assert (result.completed, result.failed) == (1, 1)
    stored = await raw_rows(tenant, play_scope(tenant), NS, ["score", "label"])
    assert sorted((r["score"], r["label"]) for r in stored.values()) == [(1, "A"), (100, "second")]
    return Forced(first, second, result)


def by_name(rows):
    return {row["name"]: row for row in rows}


def assert_failed_row_reads_null(rows):
    got = by_name(rows)
    assert (got["a"]["_status"], got["a"]["score"], got["a"]["label"]) == ("failed", None, None)
    assert (got["b"]["_status"], got["b"]["score"], got["b"]["label"]) == (
        "enriched", 100, "second")


async def test_read_rows_shows_null_for_outputs_of_a_row_that_failed_after_force(tenant, forced):
    assert_failed_row_reads_null(await sheets.read_rows(tenant, play_scope(tenant), NS))
    await check_counters(tenant)


async def test_datasets_show_null_for_outputs_of_a_row_that_failed_after_force(tenant, forced):
    ds = sheets.dataset(tenant, play_scope(tenant), NS)
    assert_failed_row_reads_null(await ds.materialize())
    assert_failed_row_reads_null([row async for row in ds.iterate(page_rows=1)])
    assert_failed_row_reads_null(await forced.result.dataset.materialize())
    failed = await sheets.dataset(tenant, play_scope(tenant), NS, status="failed").peek()
    assert [(r["name"], r["score"], r["label"]) for r in failed] == [("a", None, None)]
    # A field whose only visible values are null is a null column, whatever is still stored.
    kinds = await sheets.dataset(tenant, play_scope(tenant), NS, status="failed").field_kinds()
    assert kinds == {"name": "string", "score": "null", "label": "null"}


async def test_exports_show_null_for_outputs_of_a_row_that_failed_after_force(
        tenant, forced, tmp_path):
    done = await export(tenant, "--format", "jsonl", table=NS)  # direct: one COPY on the server
    assert done.returncode == 0, done.stderr
    assert_failed_row_reads_null([json.loads(line) for line in done.stdout.splitlines()])

    path = tmp_path / "out.csv"
    done = await export(tenant, "--format", "csv", "--output", str(path), table=NS)
    assert done.returncode == 0, done.stderr
    with path.open(encoding="utf-8", newline="") as f:
        listing = list(csv.DictReader(f))
    got = {row["name"]: row for row in listing}
    assert (got["a"]["_status"], got["a"]["score"], got["a"]["label"]) == ("failed", "", "")
    assert (got["b"]["score"], got["b"]["label"]) == ("100", "second")
    assert "_cells" not in listing[0]

    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "out.parquet"
    done = await export(tenant, "--format", "parquet", "--output", str(path), table=NS)
    assert done.returncode == 0, done.stderr
    table = pq.read_table(path)
    assert "_cells" not in table.column_names
    assert_failed_row_reads_null(table.to_pylist())


async def test_the_consoles_table_shows_null_for_a_row_that_failed_after_force(tenant, forced):
    page = await console_rows.rows_page(tenant, tenant.org_id, PLAY, NS)
    got = by_name([{**row, "name": json.loads(row["name"])} for row in page.rows])
    assert (got["a"]["_status"], got["a"]["score"], got["a"]["label"]) == ("failed", None, None)
    assert (got["b"]["score"], got["b"]["label"]) == ("100", '"second"')


def check_cells(row, *, second: str):
    """`_cells` of row a (failed in run 2, run-1 values kept) and b (completed in run 2)."""
    cells = row["_cells"]
    assert set(cells) == {"score", "label"}
    for field, kept in (("score", 1), ("label", "A")):
        assert cells[field] | {"attempts": None} == {
            "status": "failed", "completed_at": None, "run_id": second, "attempts": None,
            "last_value": kept}
        assert cells[field]["attempts"] >= 1


def check_completed_cells(row, *, second: str):
    for field, value in (("score", 100), ("label", "second")):
        cell = row["_cells"][field]
        assert (cell["status"], cell["run_id"], cell["last_value"]) == ("completed", second, value)
        when = datetime.datetime.fromisoformat(cell["completed_at"])
        assert when.tzinfo is not None
        assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 3600


async def test_cells_report_status_and_the_value_kept(tenant, forced):
    scope = play_scope(tenant)
    got = by_name(await sheets.read_rows(tenant, scope, NS, cells=True))
    check_cells(got["a"], second=forced.second)
    check_completed_cells(got["b"], second=forced.second)
    assert "_cells" not in (await sheets.read_rows(tenant, scope, NS))[0]

    for rows in (await sheets.dataset(tenant, scope, NS, cells=True).materialize(),
                 await forced.result.dataset.materialize(cells=True),
                 [r async for r in sheets.dataset(tenant, scope, NS).iterate(cells=True)]):
        got = by_name(rows)
        check_cells(got["a"], second=forced.second)
        check_completed_cells(got["b"], second=forced.second)
        assert_failed_row_reads_null(rows)
    only = await sheets.dataset(tenant, scope, NS, fields=["score"], cells=True).peek()
    assert [list(r["_cells"]) for r in only] == [["score"], ["score"]]
    assert [r["score"] for r in only] == [None, 100]


async def test_export_cells_in_every_format(tenant, forced, tmp_path):
    done = await export(tenant, "--cells", table=NS)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    check_cells(by_name(lines)["a"], second=forced.second)
    check_completed_cells(by_name(lines)["b"], second=forced.second)
    assert_failed_row_reads_null(lines)

    path = tmp_path / "out.csv"
    done = await export(tenant, "--format", "csv", "--cells", "--output", str(path), table=NS)
    assert done.returncode == 0, done.stderr
    with path.open(encoding="utf-8", newline="") as f:
        listing = list(csv.DictReader(f))
    assert list(listing[0]) == ["name", "score", "label", "_key", "_status", "_error", "_cells"]
    got = {row["name"]: {**row, "_cells": json.loads(row["_cells"])} for row in listing}
    check_cells(got["a"], second=forced.second)
    check_completed_cells(got["b"], second=forced.second)

    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "out.parquet"
    done = await export(tenant, "--format", "parquet", "--cells", "--output", str(path), table=NS)
    assert done.returncode == 0, done.stderr
    table = pq.read_table(path)
    assert table.column_names[-1] == "_cells"
    rows = table.to_pylist()
    assert_failed_row_reads_null(rows)
    got = by_name([{**row, "_cells": json.loads(row["_cells"])} for row in rows])
    check_cells(got["a"], second=forced.second)
    check_completed_cells(got["b"], second=forced.second)


async def test_a_forced_rerun_interrupted_before_a_row_completes_shows_it_pending(tenant):
    scope = play_scope(tenant)
    rows = [{"name": n} for n in NAMES]
    async with open_run(tenant, PLAY) as run:
        first = run.run_id
        await run.map(NS, rows, score_run1, contract=CONTRACT)
    before = await sheets.summary(tenant, scope, NS)
    assert before.columns["score"].completed == 2
    # The forced run admits the rows and stops before any completion is written.
    forced = await new_run(tenant, PLAY, "forced-then-stopped")
    admission = await sheets.admit(tenant, forced, NS, CONTRACT, rows, force=True)
    assert len(admission.pending) == 2
    after = await sheets.summary(tenant, scope, NS)
    assert (after.queued, after.completed) == (2, 0)
    assert {f: (c.completed, c.failed) for f, c in after.columns.items()} == {
        "score": (0, 0), "label": (0, 0)}
    await check_counters(tenant)

    read = by_name(await sheets.read_rows(tenant, scope, NS, cells=True))
    assert {n: (r["_status"], r["score"], r["label"]) for n, r in read.items()} == {
        "a": ("pending", None, None), "b": ("pending", None, None)}
    assert read["a"]["_cells"]["score"] == {
        "status": "pending", "completed_at": None, "run_id": "forced-then-stopped",
        "attempts": 1, "last_value": 1}
    rows_out = await sheets.dataset(tenant, scope, NS).materialize()
    assert [(r["score"], r["label"]) for r in rows_out] == [(None, None), (None, None)]
    assert first != "forced-then-stopped"

    # A later plain run recomputes them (a pending cell is no cache hit).
    async with open_run(tenant, PLAY) as run:
        result = await run.map(NS, rows, score_run1, contract=CONTRACT)
    assert (result.cached, result.completed) == (0, 2)
    recomputed = await sheets.dataset(tenant, scope, NS).materialize()
    assert [(r["score"], r["label"]) for r in recomputed] == [(1, "A"), (1, "B")]
    await check_counters(tenant)


async def test_read_page_carries_cells_only_when_asked_through_a_gateway(tenant, forced, gateway):
    scope = play_scope(tenant)
    direct = await sheets.dataset(tenant, scope, NS, cells=True).materialize()
    remote = sheets.dataset(gateway, scope, NS)
    assert await remote.materialize(cells=True) == direct
    plain = await remote.materialize()
    assert_failed_row_reads_null(plain)
    assert all("_cells" not in row for row in plain)
    assert await sheets.read_rows(gateway, scope, NS, cells=True) == \
        await sheets.read_rows(tenant, scope, NS, cells=True)


async def test_runplane_sql_and_the_sheet_views_show_null_for_a_row_that_failed_after_force(
        tenant, forced):
    """`runplane sql`'s text and `runplane psql`'s views read cells as every read path does."""
    from runplane.engine.sheets import views

    (sheet,) = await views.read_sheets(tenant, tenant.org_id, PLAY, NS)
    async with tenant.connection("sheet") as conn:
        rows = [dict(r) for r in await conn.fetch(views.sheet_select(tenant.schema, sheet))]
        await views.sync_views(tenant)
        viewed = [dict(r) for r in await conn.fetch(
            f'SELECT * FROM "{views.views_schema(tenant.schema)}".'
            f'"{views.identifier(f"{tenant.org_id}/{PLAY}/{NS}")}"')]
        await conn.execute(f'DROP SCHEMA "{views.views_schema(tenant.schema)}" CASCADE')
    for got in (rows, viewed):
        decoded = [{k: json.loads(v) if k in ("name", "score", "label") and v is not None else v
                    for k, v in row.items()} for row in got]
        assert_failed_row_reads_null(decoded)
