"""Shared by the many-servers tests: a tenants file, and reading a child process's output."""

from __future__ import annotations

from pathlib import Path


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
