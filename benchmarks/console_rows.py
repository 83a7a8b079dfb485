"""The console's row pages over a large table: a row's page, a search by input value (with the
field's index) and a cause-filtered failures page, each the console's own time.

    python benchmarks/console_rows.py [--rows 1000000] [--requests 20]

Maps `--rows` rows (default 1,000,000; every 50th fails with one of three causes) into one
sheet, creates the index of the input `name` (`runplane index`'s `create_field_index`), runs
`ANALYZE` on the sheet, then asks the console (`runplane console`'s server, in this process)
`--requests` times for each page and prints the median and worst `Server-Timing` of each
(target <= 50 ms): a row's page (`/ui/rows/...`, a different row each time), the search for a
row by its `name` (`/ui/search/...`: one match answers with a redirect to its row) and the failures page filtered by one cause
(`/ui/failures/...?cause=`).
The server is `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway embedded one.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import urllib.parse
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from _server import bench_dsn  # noqa: E402
from console import logged_in  # noqa: E402
from runplane.actors import open_run  # noqa: E402
from runplane.engine import open_tenant, sheets  # noqa: E402
from runplane.engine.console import open_console  # noqa: E402
from runplane.engine.sheets.field_index import create_field_index  # noqa: E402
from runplane.engine.sheets.inputs import row_key  # noqa: E402
from runplane.engine.values.scopes import PlayScope  # noqa: E402

CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("ok",))
PLAY, TABLE = "rows", "companies"
CAUSES = ("quota exceeded", "no such company", "upstream timed out")


async def companies(rows: int):
    for i in range(rows):
        yield {"name": f"company-{i}", "n": i}


async def lookup(row: dict) -> dict:
    if row["n"] % 50 == 0:
        raise ValueError(CAUSES[row["n"] // 50 % 3])
    return {"ok": True}


def server_ms(response) -> float:
    """The console's own time for an answer: a page, or the search's redirect to the row found."""
    match = re.search(r"dur=([0-9.]+)", response.headers.get("server-timing", ""))
    assert response.status_code in (200, 303) and match, (response.status_code, response.text[:200])
    return float(match.group(1))


def report(label: str, times: list[float]) -> None:
    print(f"{label}: median {statistics.median(times):.1f} ms, worst {max(times):.1f} ms "
          "server time (target <= 50 ms)")


async def measure(dsn: str, rows: int, requests: int) -> None:
    schema = f"bench_rows_{uuid.uuid4().hex[:8]}"
    async with open_tenant("bench", dsn, schema=schema) as tenant:
        try:
            began = time.perf_counter()
            async with open_run(tenant, PLAY) as run:
                result = await run.map(TABLE, companies(rows), lookup, contract=CONTRACT,
                                       concurrency=16, fail_fast=False)
            print(f"mapped {rows:,} rows ({result.failed:,} failed) in "
                  f"{time.perf_counter() - began:.0f} s")
            await create_field_index(tenant, PlayScope("bench", PLAY), TABLE, "name")
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'ANALYZE "{schema}".{_table(tenant)}')
            async with open_console(dsn=dsn, schema=schema, bind="127.0.0.1:0") as server:
                http = await logged_in(server)
                org = "org=bench"
                causes = (await http.get(f"/ui/api/failures/{PLAY}/{TABLE}?{org}")).json()
                cause = causes["causes"][0]["pattern"]
                picks = [rows // requests * i + 1 for i in range(requests)]
                pages = {
                    "row page": [f"/ui/rows/{PLAY}/{TABLE}/"
                                 f"{row_key({'name': f'company-{i}', 'n': i}, TABLE)}?{org}"
                                 for i in picks],
                    "search by name (indexed)": [
                        f"/ui/search/{PLAY}/{TABLE}?{org}&field=name&value=company-{i}"
                        for i in picks],
                    "failures filtered by cause": [
                        f"/ui/failures/{PLAY}/{TABLE}?{org}&cause="
                        f"{urllib.parse.quote(cause)}"] * requests,
                }
                for label, paths in pages.items():
                    server_ms(await http.get(paths[0]))  # warm
                    report(f"{label} over {rows:,} rows",
                           [server_ms(await http.get(path)) for path in paths])
                await http.aclose()
        finally:
            async with tenant.connection("sheet") as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _table(tenant) -> str:
    from runplane.engine.sheets.layout import layout_for

    return layout_for(tenant, PlayScope("bench", PLAY), TABLE).qualified.rpartition(".")[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    dsn = bench_dsn()
    trio.run(measure, dsn, args.rows, args.requests)


if __name__ == "__main__":
    main()
