"""Shared by the many-servers tests: a tenants file, reading a child process's output, and the
check that a moved org's 300 rows each landed once on its new server."""

from __future__ import annotations

from pathlib import Path

from runplane.engine import PlayScope, sheets

from .sheet_helpers import counters_match


async def assert_moved_rows(moved, org: str) -> None:
    """Org `org`'s table `things` on the tenant `moved` (its new server): rows r0..r299, each
    once and completed (`upper` of its name), and the sheet's counters exact."""
    scope = PlayScope(org, "p")
    stored = await sheets.read_rows(moved, scope, "things")
    assert sorted(row["name"] for row in stored) == sorted(f"r{i}" for i in range(300))
    assert all(row["upper"] == row["name"].upper() for row in stored)
    summary = await sheets.summary(moved, scope, "things")
    assert (summary.total, summary.completed, summary.failed) == (300, 300, 0)
    assert (await counters_match(moved, scope, "things"))[0]


def tenants_toml(path: Path, servers: dict[str, str], orgs: dict[str, str], schema: str,
                 default: str | None = None) -> str:
    lines = [f'[servers.{name}]\ndsn = "{dsn}"' for name, dsn in servers.items()]
    lines += [f'[orgs.{org}]\nserver = "{server}"\nschema = "{schema}"'
              for org, server in orgs.items()]
    if default is not None:
        lines.append(f'[orgs.default]\nserver = "{default}"\nschema = "{schema}"')
    path.write_text("\n".join(lines) + "\n")
    return str(path)


async def read_until(stream, text: bytes, seen: bytearray) -> None:
    """Read `stream` into `seen` until it holds `text`."""
    while text not in seen:
        chunk = await stream.receive_some(4096)
        assert chunk, f"the process closed its output before {text!r}: {bytes(seen)!r}"
        seen.extend(chunk)


async def drain(stream, seen: bytearray) -> None:
    """Read `stream` into `seen` until it ends."""
    while chunk := await stream.receive_some(4096):
        seen.extend(chunk)
