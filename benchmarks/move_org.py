"""The fence time of `move-org` and its copy rate against a raw COPY TO/FROM of the same rows.

    python benchmarks/move_org.py [--rows 20000]

An org with one sheet of `--rows` rows (plus its run, summary and column registry) lives in a
database of the server; a second database of the same server is the target. Then:
1. `move_org` moves it (fence, COPY, verify, sequences, switch, unfence): prints the seconds the
   org was fenced (its requests answered 503 meanwhile) and the copy's rows/s.
2. Raw: the same rows of the same tables dumped with `COPY (…) TO STDOUT (FORMAT binary)` into
   memory and loaded with `COPY … FROM STDIN (FORMAT binary)` into empty tables of the same DDL
   on the target, through the driver directly: rows/s.
Prints the ratio move/raw of the rates (target >= 0.7). The sheet's rows are made in SQL from
one admitted row (`generate_series`), so seeding a million rows takes seconds.
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

import trio

from _server import bench_dsn
from runplane.engine import PlayScope, RunScope, open_tenant, runs, schema as schema_ddl, sheets
from runplane.engine.placement import copying, load_tenants_file
from runplane.engine.placement.control import control_connection
from runplane.engine.placement.move import MoveRequest, move_org
from runplane.engine.sql import qualified, quote_ident

CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("upper",))


def _database_dsn(dsn: str, database: str) -> str:
    return urllib.parse.urlunsplit(urllib.parse.urlsplit(dsn)._replace(path=f"/{database}"))


async def _seed(dsn: str, org: str, schema: str, rows: int) -> None:
    async with open_tenant(org, dsn, schema=schema) as tenant:
        run = await runs.register(tenant, RunScope(org, "bench", "r1"))
        admitted = await sheets.admit(tenant, run, "things", CONTRACT, [{"name": "x", "n": 0}])
        await sheets.complete(tenant, run, "things", CONTRACT, [sheets.RowOutcome(
            admitted.pending[0].key, "completed", {"upper": "X"})])
        async with tenant.connection("sheet") as conn:
            table = await conn.fetchval(
                f"SELECT table_name FROM {qualified(schema, 'sheet_summary')} WHERE org_id = $1",
                org)
            cols = [c for c in await conn.fetchval(
                "SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute WHERE"
                " attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped",
                qualified(schema, table)) if c not in ("_key", "_version")]
            listed = ", ".join(quote_ident(c) for c in cols)
            await conn.execute(
                f"INSERT INTO {qualified(schema, table)} (_key, {listed})"
                f" SELECT md5(g::text), {listed} FROM {qualified(schema, table)} AS t,"
                f" generate_series(1, $1) AS g", rows - 1)
    async with control_connection(dsn) as conn:
        await conn.execute("ANALYZE")


async def _raw(source_dsn: str, target_dsn: str, org: str, schema: str) -> tuple[int, float]:
    """Rows and seconds of a raw dump-and-load of the org's tables (into a scratch schema)."""
    from runplane.engine import pg

    scratch = f"raw_{uuid.uuid4().hex[:8]}"
    async with pg.open_driver() as driver:
        from runplane.engine.placement.control import connect

        async with connect(driver, source_dsn) as src, connect(driver, target_dsn) as dst:
            copies = await copying.plan(src, schema, org)
            await schema_ddl.bootstrap(dst, schema)  # the tables to copy the DDL of
            for copy in copies:
                if copy.sheet:
                    for statement in await copying.table_ddl(src, schema, copy.name):
                        await dst.execute(statement)
            await dst.execute(f"CREATE SCHEMA {scratch}")
            for copy in copies:
                await dst.execute(f"CREATE TABLE {scratch}.{quote_ident(copy.name)}"
                                  f" (LIKE {qualified(schema, copy.name)} INCLUDING ALL)")
            started, total = time.perf_counter(), 0
            for copy in copies:
                buffer = io.BytesIO()
                await driver.call(src.raw.copy_from_query(copy.select(), *copy.args,
                                                          output=buffer, format="binary"))
                buffer.seek(0)
                status = await driver.call(dst.raw.copy_to_table(
                    copy.name, schema_name=scratch, columns=list(copy.columns), source=buffer,
                    format="binary"))
                total += int(status.split()[-1])
            seconds = time.perf_counter() - started
            await dst.execute(f"DROP SCHEMA {scratch} CASCADE")
    return total, seconds


async def bench(dsn: str, rows: int) -> None:
    names = [f"rp_move_{uuid.uuid4().hex[:8]}_{i}" for i in range(2)]
    async with control_connection(dsn) as conn:
        for name in names:
            await conn.execute(f'CREATE DATABASE "{name}"')
    try:
        dsns = [_database_dsn(dsn, name) for name in names]
        org, schema = "bench-org", "runplane"
        path = Path(tempfile.mkdtemp(prefix="runplane-move-")) / "tenants.toml"
        path.write_text(f'[servers.one]\ndsn = "{dsns[0]}"\n[servers.two]\ndsn = "{dsns[1]}"\n'
                        f'[orgs.{org}]\nserver = "one"\nschema = "{schema}"\n')
        await _seed(dsns[0], org, schema, rows)
        raw_rows, raw_s = await _raw(dsns[0], dsns[1], org, schema)
        report = await move_org(load_tenants_file(path), MoveRequest(org, to="two"))
        moved = sum(report.rows.values())
        move_rate, raw_rate = moved / report.copy_s, raw_rows / raw_s
        print(f"move-org of {moved:,} rows ({rows:,} in the sheet): fenced {report.fenced_s:.2f} s,"
              f" copy {report.copy_s:.2f} s ({move_rate:,.0f} rows/s)")
        print(f"raw COPY TO/FROM of the same rows: {raw_s:.2f} s ({raw_rate:,.0f} rows/s)")
        print(f"ratio move/raw: {move_rate / raw_rate:.2f} (target >= 0.7)")
        async with open_tenant(org, dsns[1], schema=schema) as tenant:
            summary = await sheets.summary(tenant, PlayScope(org, "bench"), "things")
            assert summary.total >= 1
    finally:
        async with control_connection(dsn) as conn:
            for name in names:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="rows in the org's sheet")
    args = parser.parse_args()
    trio.run(bench, bench_dsn(), args.rows)


if __name__ == "__main__":
    main()
