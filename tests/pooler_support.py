"""A real PgBouncer (Debian's `pgbouncer`) in transaction mode in front of the test server.

`bouncer` (a module-scoped fixture) starts one on a free local port, forwarding every database
to the server of the test DSN (its socket directory, or its host and port). It runs as the user
that owns the server's socket directory (PgBouncer refuses to run as root), with `trust`
authentication for the DSN's user: the pooler logs in to the server with that user's password
from its auth file. `Bouncer.restart()` kills it (SIGTERM: every connection drops at once) and
starts it again on the same port. Without the binary the tests skip with one line saying how to
install it; under `CI=true` they fail.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

import attrs
import pytest

INSTALL = "pgbouncer is not installed (apt-get install pgbouncer)"


def pgbouncer_or_skip() -> str:
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(INSTALL)
        pytest.skip(INSTALL)
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@attrs.define
class Bouncer:
    binary: str
    directory: Path
    port: int
    user: str | None  # the system user it runs as (None: this process's own)
    db_user: str
    process: subprocess.Popen | None = None

    @property
    def plain_dsn(self) -> str:
        """The pooler's address, with no word of what it is."""
        return f"postgresql://{self.db_user}@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        return self.plain_dsn + "?pooler=transaction"

    def start(self) -> None:
        argv = [self.binary, str(self.directory / "pgbouncer.ini")]
        if self.user is not None:
            argv[1:1] = ["-u", self.user]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"pgbouncer exited: {self.log()}")
                time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen: {self.log()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text()[-2000:] if path.exists() else ""


def start_bouncer(server_dsn: str, *, pool_size: int = 40) -> Bouncer:
    """A transaction-mode PgBouncer in front of the server `server_dsn` names."""
    binary = pgbouncer_or_skip()
    url = urllib.parse.urlsplit(server_dsn)
    query = urllib.parse.parse_qs(url.query)
    host = (query.get("host") or [url.hostname or "/tmp"])[0]
    port = (query.get("port") or [str(url.port or 5432)])[0]
    db_user = urllib.parse.unquote(url.username or "postgres")
    password = urllib.parse.unquote(url.password or "")
    run_as = None
    if os.geteuid() == 0:
        owner = Path(host).stat().st_uid if host.startswith("/") else None
        run_as = pwd.getpwuid(owner).pw_name if owner else "nobody"
    directory = Path(tempfile.mkdtemp(prefix="runplane-bouncer-"))
    bouncer = Bouncer(binary, directory, _free_port(), run_as, db_user)
    (directory / "users.txt").write_text(f'"{db_user}" "{password}"\n')
    (directory / "pgbouncer.ini").write_text(f"""\
[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {bouncer.port}
unix_socket_dir =
auth_type = trust
auth_file = {directory / 'users.txt'}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 2000
ignore_startup_parameters = extra_float_digits
server_login_retry = 1
logfile = {directory / 'pgbouncer.log'}
pidfile = {directory / 'pgbouncer.pid'}
""")
    if run_as is not None:
        shutil.chown(directory, run_as)
        for path in directory.iterdir():
            shutil.chown(path, run_as)
    bouncer.start()
    return bouncer


@pytest.fixture(scope="module")
def bouncer(dsn):
    started = start_bouncer(dsn)
    try:
        yield started
    finally:
        started.stop()
        shutil.rmtree(started.directory, ignore_errors=True)
