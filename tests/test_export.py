"""`runplane export`, run as a user runs it (a subprocess): every format round-trips a
10,000-row table; through a gateway it writes what a direct export writes; a missing schema or
table is one line, exit 1, and creates nothing."""

from __future__ import annotations

import csv
import io
import json
import os

import pytest
import trio

from runplane.engine import sheets

from .cli_helpers import ROOT, RUNPLANE
from .dataset_support import CONTRACT, NS, fill
from .gateway_support import server, token_for  # noqa: F401
from .sheet_helpers import PLAY, new_run, play_scope

COLUMNS = [*CONTRACT.fields, "_key", "_status", "_error"]


async def export(tenant, *args: str, env: dict | None = None, play: str = PLAY,
                 table: str = NS, direct: bool = True):
    where = ["--dsn", tenant.dsn, "--org", tenant.org_id, "--schema", tenant.schema] if direct else []
    return await trio.run_process(
        [*RUNPLANE, "export", play, table, *where, *args], capture_stdout=True,
        capture_stderr=True, check=False, cwd=ROOT, env={**os.environ, **(env or {})})


def from_csv_cell(cell: str, expected):
    if cell == "":
        return None
    return cell if type(expected) is str else json.loads(cell)


@pytest.fixture
async def table_rows(tenant):
    await fill(tenant, 10_000)
    rows = await sheets.read_rows(tenant, play_scope(tenant), NS, limit=10_000)
    statuses = {r["_status"] for r in rows}
    assert statuses == {"enriched", "failed", "pending"}
    assert any("\ufffdnul" in r["name"] for r in rows) and any("東京" in r["name"] for r in rows)
    return rows


async def test_every_format_round_trips_a_10000_row_table(tenant, table_rows, tmp_path):
    rows = table_rows
    done = await export(tenant)
    assert done.returncode == 0, done.stderr
    assert done.stderr == b""  # no progress bar when stderr is not a terminal
    assert [json.loads(line) for line in done.stdout.decode("utf-8").splitlines()] == rows

    path = tmp_path / "out.csv"
    done = await export(tenant, "--format", "csv", "--output", str(path))
    assert done.returncode == 0, done.stderr
    with path.open(encoding="utf-8", newline="") as f:
        listing = list(csv.reader(f))
    assert listing[0] == COLUMNS
    assert len(listing) == 10_001
    for row, line in zip(rows, listing[1:]):
        assert {name: from_csv_cell(cell, row[name]) for name, cell in zip(COLUMNS, line)} \
            == {name: row[name] for name in COLUMNS}

    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "out.parquet"
    done = await export(tenant, "--format", "parquet", "--output", str(path))
    assert done.returncode == 0, done.stderr
    parquet = pq.ParquetFile(path)
    assert parquet.metadata.num_row_groups >= 1 and parquet.metadata.num_rows == 10_000
    read = parquet.read().to_pylist()
    assert list(read[0]) == COLUMNS
    for row, got in zip(rows, read):
        expected = dict(row)
        for name in ("info", "tags"):
            got[name] = None if got[name] is None else json.loads(got[name])
        if expected["score"] is not None:
            expected["score"] = float(expected["score"])
        assert got == {name: expected[name] for name in COLUMNS}


async def test_filters_and_fields(tenant, table_rows):
    failed = [r for r in table_rows if r["_status"] == "failed"]
    done = await export(tenant, "--status", "failed", "--fields", "name,score", "--format", "csv")
    assert done.returncode == 0, done.stderr
    listing = list(csv.reader(io.StringIO(done.stdout.decode("utf-8"), newline="")))
    assert listing[0] == ["name", "score", "_key", "_status", "_error"]
    assert [line[2] for line in listing[1:]] == [r["_key"] for r in failed]
    assert {line[4] for line in listing[1:]} >= {failed[0]["_error"]}
    done = await export(tenant, "--run", "nobody")
    assert (done.returncode, done.stdout) == (0, b"")
    done = await export(tenant, "--fields", "nope")
    assert done.returncode == 1
    assert done.stderr.decode().count("\n") == 1 and "no field 'nope'" in done.stderr.decode()


async def test_export_through_a_gateway_equals_direct(tenant, server):
    await fill(tenant, 3_000)
    env = {"RUNPLANE_TOKEN": token_for(tenant)}
    for args in ((), ("--format", "csv"), ("--status", "enriched", "--fields", "info")):
        direct = await export(tenant, *args)
        through = await export(tenant, *args, "--gateway", server.url, env=env, direct=False)
        assert through.returncode == 0, through.stderr
        assert through.stdout == direct.stdout and direct.stdout
    assert server.requests["sheets.read_page"] >= 6


async def tables_of(tenant, schema: str) -> list[str]:
    async with tenant.connection("sheet") as conn:
        return sorted(await conn.fetchval(
            "SELECT coalesce(array_agg(c.relname::text), '{}') FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1", schema))


async def test_a_missing_schema_play_or_table_exits_1_and_creates_nothing(tenant, tmp_path):
    await fill(tenant, 5)
    before = await tables_of(tenant, tenant.schema)
    output = tmp_path / "never.jsonl"
    for play, table in ((PLAY, "nope"), ("no_such_play", NS)):
        done = await export(tenant, "--output", str(output), play=play, table=table)
        assert done.returncode == 1
        assert done.stderr.decode() == f"runplane: play {play!r} has no table {table!r}\n"
        assert not output.exists()
    assert await tables_of(tenant, tenant.schema) == before
    missing = tenant.schema + "_missing"
    done = await trio.run_process(
        [*RUNPLANE, "export", PLAY, NS, "--dsn", tenant.dsn, "--schema", missing],
        capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT)
    assert done.returncode == 1 and done.stderr.decode().count("\n") == 1, done.stderr
    assert "nothing was created" in done.stderr.decode()
    async with tenant.connection("sheet") as conn:
        assert not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", missing)


async def test_parquet_without_the_frames_extra_names_the_extra(tenant, tmp_path):
    await fill(tenant, 5)
    shadow = tmp_path / "shadow" / "pyarrow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('pyarrow is not installed')\n")
    env = {"PYTHONPATH": f"{shadow.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = await export(tenant, "--format", "parquet", env=env)
    assert done.returncode == 1
    assert done.stderr.decode() == ("runplane: --format parquet needs pyarrow: install the extra "
                                    "with `pip install 'runplane[frames]'`\n")


async def test_failures_lists_the_failed_rows_in_the_sheet_order(tenant):
    await fill(tenant, 300)
    failed = await sheets.dataset(tenant, play_scope(tenant), NS, status="failed").materialize()
    assert len(failed) > 5
    done = await trio.run_process(
        [*RUNPLANE, "failures", PLAY, NS, "--dsn", tenant.dsn, "--org", tenant.org_id,
         "--schema", tenant.schema, "--limit", "5"],
        capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode("utf-8").splitlines()
    assert lines[0] == f"{len(failed)} failed rows in table {NS} of play {PLAY} (first 5):"
    listed = [line.split()[0] for line in lines[2:7]]
    assert listed == [row["_key"] for row in failed[:5]]
    name = json.dumps(failed[0]["name"], ensure_ascii=False)
    assert lines[2].endswith(f'{{"n": {failed[0]["n"]}, "name": {name}}}'), lines[2]


# -- spreadsheet formulas (§28.14) -------------------------------------------------------------
FORMULA_NS = "formulas"
FORMULA_CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("=total", "score"))
# Text a spreadsheet would run as a formula (or whose tab / CR it would act on), and text
# that is only a number, which stays as it is.
RISKY = ["=1+2", "+SUM(A1:A9)", "-2+3", "@cmd", "\tlead", "\rlead", "-", "-inf", "+0x1F"]
NUMBERS = ["-3.5", "+1", "-1e5", "1.5E-07", "-.5", "7"]


async def fill_formulas(tenant) -> None:
    scope = play_scope(tenant)
    run = await new_run(tenant, scope.play, "rf")
    await sheets.ensure_sheet(tenant, scope, FORMULA_NS, FORMULA_CONTRACT)
    names = [*RISKY, *NUMBERS, "plain", "'quoted"]
    admission = await sheets.admit(tenant, run, FORMULA_NS, FORMULA_CONTRACT,
                                   [{"name": name} for name in names])
    outcomes = []
    for a in admission.pending:
        if names[a.input_index] == "@cmd":
            outcomes.append(sheets.RowOutcome(a.key, "failed", error="-failed: =cmd"))
        else:
            outcomes.append(sheets.RowOutcome(a.key, "completed", data={
                "=total": names[a.input_index], "score": -3.5 if a.input_index % 2 else -7}))
    await sheets.complete(tenant, run, FORMULA_NS, FORMULA_CONTRACT, outcomes)


def check_guarded(listing: list[list[str]], guarded: bool) -> None:
    """Every risky cell, the header's `=total` included, is prefixed with `'` when `guarded`
    and verbatim otherwise; numbers (text or JSON) and plain text stay as they are."""
    mark = "'" if guarded else ""
    assert listing[0] == ["name", f"{mark}=total", "score", "_key", "_status", "_error"]
    by_name = {}
    for line in listing[1:]:
        name = line[0]
        if guarded and name[1:] in RISKY:
            name = name[1:]
        by_name[name] = line
    assert sorted(by_name) == sorted([*RISKY, *NUMBERS, "plain", "'quoted"])
    for name, line in by_name.items():
        shown = f"{mark}{name}" if name in RISKY else name
        assert line[0] == shown, (name, line)
        if name == "@cmd":
            assert line[1] == "" and line[5] == f"{mark}-failed: =cmd"
        else:
            assert line[1] == shown and line[2] in ("-3.5", "-7"), (name, line)


def test_a_cell_is_guarded_only_when_a_spreadsheet_would_run_it():
    from runplane.engine.console.export import csv_cell

    for text in RISKY:
        assert csv_cell(text, safe=True) == "'" + text
        assert csv_cell(text, safe=False) == text
    for value in (*NUMBERS, "plain", "'=x", " =x", "", -3.5, -7, 1e-7, -1e100, True):
        assert csv_cell(value, safe=True) == csv_cell(value, safe=False)
    assert csv_cell(-3.5, safe=True) == "-3.5" and csv_cell(None, safe=True) == ""
    assert csv_cell({"a": "=x"}, safe=True) == '{"a":"=x"}'
    assert csv_cell("-٣", safe=True) == "'-٣"  # only ASCII digits make a plain number
    assert csv_cell("-3.5\n", safe=True) == "'-3.5\n"


async def test_csv_export_to_a_file_guards_formulas_unless_raw(tenant, tmp_path):
    await fill_formulas(tenant)

    def listing_of(data: bytes) -> list[list[str]]:
        return list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))

    path = tmp_path / "out.csv"
    for extra, guarded in (((), True), (("--raw",), False)):
        done = await export(tenant, "--format", "csv", "--output", str(path), *extra,
                            table=FORMULA_NS)
        assert done.returncode == 0, done.stderr
        check_guarded(listing_of(path.read_bytes()), guarded)
    for extra, guarded in (((), False), (("--csv-safe",), True)):  # stdout: raw unless asked
        done = await export(tenant, "--format", "csv", *extra, table=FORMULA_NS)
        assert done.returncode == 0, done.stderr
        check_guarded(listing_of(done.stdout), guarded)
    done = await export(tenant, "--format", "jsonl", "--raw", table=FORMULA_NS)
    assert done.returncode == 2 and b"--csv-safe and --raw apply to --format csv" in done.stderr


async def test_the_consoles_csv_download_guards_formulas(tenant):
    from runplane.engine.console.export import export_chunks

    await fill_formulas(tenant)
    chunks = [chunk async for chunk in export_chunks(tenant, tenant.org_id, PLAY, FORMULA_NS,
                                                     "csv", None)]
    check_guarded(list(csv.reader(io.StringIO(b"".join(chunks).decode("utf-8"), newline=""))),
                  guarded=True)
