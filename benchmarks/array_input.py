"""Array-input throughput against raw-driver baselines measured in the same run, same server.

    python benchmarks/array_input.py [--pages 200] [--rounds 1]

Engine side (trio, through `engine.array_input`): stage 200 pages of 1,000 rows (~1 MiB of
canonical JSON each) with `put_page` from 2 concurrent stager tasks (as the array sealer actor
stages; puts take the run guard FOR SHARE, so they do not serialize) — and once more from a
single task, printed beside — then `seal` them (batch size 4) and `read_page` every page.
Raw side (asyncpg on plain asyncio, no engine code): one INSERT of the page fact's text per page
(what a put cannot avoid), and the pipeline a seal cannot avoid — fetch the same stored page
facts 4 at a time, `json.loads`, canonical `json.dumps` of the rows, SHA-256. Reads are compared
with that same pipeline.

Prints MB/s (10^6 bytes of stored page-fact text per second) for put, seal and read, each with
its ratio to its raw baseline. Targets: put ≥ 0.5, seal ≥ 0.7, read ≥ 0.7.

The server: `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else an embedded PostgreSQL started
in a temporary directory. Benchmarks may import asyncpg directly; engine code never does.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import asyncpg
import trio

from runplane.engine import RunScope, array_input as A, open_tenant
from runplane.engine.array_input.facts import page_key
from runplane.engine.array_input.pages import encode_page

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import bench_dsn  # noqa: E402  (the benchmarks' shared server choice)

TARGETS = {"put": 0.5, "seal": 0.7, "read": 0.7}
PUT_TASKS = 2  # stagers putting pages concurrently, as the array sealer actor stages
ROW_PAD = 920  # ~1,030 bytes of canonical JSON per row: 1,000 rows fill one page (≤ 1 MiB)


def make_source(pages: int) -> list[A.Occurrence]:
    filler = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    rows = []
    for i in range(pages * A.MAX_PAGE_ROWS):
        text = (filler[i % 61:] + filler) * (ROW_PAD // len(filler) + 2)
        rows.append(A.Occurrence({"id": i, "name": f"company-{i}", "blurb": text[:ROW_PAD]},
                                 A.SourceIdentity("bench", i)))
    return rows


# -- engine side (trio) ------------------------------------------------------------------------


async def put_all(tenant, scope, drafts, fingerprint, tasks: int) -> float:
    """Put every page with `tasks` concurrent stagers (each takes the next page); seconds."""
    pending = iter(drafts)

    async def stager():
        for draft in pending:
            await A.put_page(tenant, scope, source_fingerprint=fingerprint, ordinal=draft.ordinal,
                             offset=draft.offset, rows=draft.rows)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(stager)
    return time.perf_counter() - started


async def engine_side(dsn: str, schema: str, source, drafts, fingerprint) -> dict[str, float]:
    run = RunScope("org-bench", "play", "run-bench")
    scope = run.map("companies", "map-1")
    seconds = {}
    async with open_tenant("org-bench", dsn, schema=schema) as tenant:
        for name, tasks in (("put_1", 1), ("put", PUT_TASKS)):
            target = scope if name == "put" else run.map("companies", "map-sequential")
            await A.begin(tenant, target, source_fingerprint=fingerprint,
                          source_rows=len(source), has_source_identities=True)
            seconds[name] = await put_all(tenant, target, drafts, fingerprint, tasks)

        started = time.perf_counter()
        await A.seal(tenant, scope, source_fingerprint=fingerprint, source_rows=len(source),
                     page_count=len(drafts), batch_size=4)
        seconds["seal"] = time.perf_counter() - started

        started = time.perf_counter()
        rows = 0
        for ordinal in range(len(drafts)):
            rows += len((await A.read_page(tenant, scope, ordinal)).rows)
        seconds["read"] = time.perf_counter() - started
        assert rows == len(source)
    return seconds


# -- raw side (asyncio + asyncpg) --------------------------------------------------------------


def canonical_rows_digest(fact: dict) -> str:
    rows_text = json.dumps(fact["rows"], ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(rows_text.encode()).hexdigest()


async def raw_side(dsn: str, schema: str, scope, page_texts: list[str]) -> dict[str, float]:
    conn = await asyncpg.connect(dsn)
    seconds = {}
    try:
        raw_table = f'"{schema}"."raw_pages"'
        await conn.execute(f"CREATE TABLE {raw_table} (k bytea PRIMARY KEY, output jsonb)")
        started = time.perf_counter()
        for ordinal, text in enumerate(page_texts):
            await conn.execute(f"INSERT INTO {raw_table} (k, output) VALUES ($1, $2::jsonb)",
                               page_key(scope, ordinal), text)
        seconds["put"] = time.perf_counter() - started

        keys = [page_key(scope, ordinal) for ordinal in range(len(page_texts))]
        fetch = (f'SELECT output::text AS output FROM "{schema}"."work_receipts" '
                 "WHERE k = ANY($1::bytea[]) ORDER BY k")
        for label, group in (("seal", 4), ("read", 1)):
            started = time.perf_counter()
            for first in range(0, len(keys), group):
                for row in await conn.fetch(fetch, keys[first:first + group]):
                    canonical_rows_digest(json.loads(row["output"]))
            seconds[f"raw_{label}"] = time.perf_counter() - started
    finally:
        await conn.close()
    return seconds


# -- the run -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    dsn = bench_dsn()

    source = make_source(args.pages)
    drafts = A.paginate(source)
    fingerprint = A.source_fingerprint(source)
    page_texts = [encode_page(fingerprint, d.ordinal, d.offset, d.rows).text for d in drafts]
    megabytes = sum(len(text.encode()) for text in page_texts) / 1e6
    scope = RunScope("org-bench", "play", "run-bench").map("companies", "map-1")
    print(f"{len(drafts)} pages of {A.MAX_PAGE_ROWS} rows, {megabytes:.1f} MB of page facts "
          f"(largest {max(len(t.encode()) for t in page_texts) / 2**20:.3f} MiB)")

    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        schema = f"bench_{uuid.uuid4().hex[:12]}"
        try:
            engine = trio.run(engine_side, dsn, schema, source, drafts, fingerprint)
            raw = run_asyncio(raw_side(dsn, schema, scope, page_texts))
        finally:
            run_asyncio(_drop(dsn, schema))
        for name, value in {**engine, **{f"raw_{k}" if not k.startswith("raw_") else k: v
                                         for k, v in raw.items()}}.items():
            samples.setdefault(name, []).append(value)

    median = {name: statistics.median(values) for name, values in samples.items()}
    baseline = {"put": "raw_put", "seal": "raw_seal", "read": "raw_seal"}
    ok = True
    for name in ("put", "seal", "read"):
        engine_rate = megabytes / median[name]
        raw_rate = megabytes / median[baseline[name]]
        ratio = engine_rate / raw_rate
        ok &= ratio >= TARGETS[name]
        print(f"{name:5} {engine_rate:7.1f} MB/s   raw {raw_rate:7.1f} MB/s   ratio {ratio:4.2f} "
              f"(target ≥ {TARGETS[name]})")
    one_task = megabytes / median["put_1"]
    print(f"(put with {PUT_TASKS} stager tasks above; one task: {one_task:.1f} MB/s, ratio "
          f"{one_task / (megabytes / median['raw_put']):.2f}; raw one-page-a-time read pipeline: "
          f"{megabytes / median['raw_read']:.1f} MB/s)")
    return 0 if ok else 1


def run_asyncio(coro):
    """Run on a plain asyncio event loop (importing the engine installs trio-asyncio's policy)."""
    loop = asyncio.SelectorEventLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _drop(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


if __name__ == "__main__":
    raise SystemExit(main())
