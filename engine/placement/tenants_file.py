"""The tenants file: which PostgreSQL servers there are and where each org lives (TOML).

```
[control]            # optional: where the control table lives (default: the first server)
dsn = "postgresql://…"
[servers.main]
dsn = "postgresql://…"
[orgs.acme]
server = "main"
schema = "runplane"  # optional, default "runplane"
[orgs.default]       # optional: places every org not named; without it they are refused
server = "main"
```

Choices: read with `tomllib` (standard library); every problem is an `InvalidInputError` naming
the key, raised before anything connects. The file only seeds the control table
(`engine.placement.control`): after a move the table, not the file, says where an org lives.
The file's order of servers is kept: the first one holds the control table unless `[control]`
names another. This module does no I/O beyond reading the file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Mapping

import attrs

from ..errors import InvalidInputError
from ..opening import check_dsn, check_tenant_names

DEFAULT_ORG = "default"
DEFAULT_SCHEMA = "runplane"


@attrs.frozen
class OrgPlacement:
    """Where one org lives: a server's name and the schema on it."""

    server: str
    schema: str = DEFAULT_SCHEMA


@attrs.frozen
class TenantsFile:
    """A parsed tenants file: servers' DSNs by name (in file order), placed orgs, the default
    placement (None: unnamed orgs are refused) and the control server's DSN."""

    servers: Mapping[str, str] = attrs.field(repr=False)
    orgs: Mapping[str, OrgPlacement]
    default: OrgPlacement | None
    control_dsn: str = attrs.field(repr=False)
    path: str | None = None

    def dsn(self, server: str) -> str:
        """The DSN of server `server` (InvalidInputError when the file names no such server)."""
        try:
            return self.servers[server]
        except KeyError:
            raise InvalidInputError(f"the tenants file names no server {server!r}") from None


def _table(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise InvalidInputError(f"tenants file: {where} must be a table")
    return value


def _text(table: Mapping[str, object], key: str, where: str, default: str | None = None) -> str:
    value = table.get(key, default)
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"tenants file: {where}.{key} must be a non-empty string")
    return value


def _placement(name: str, value: object, servers: Mapping[str, str]) -> OrgPlacement:
    where = f"orgs.{name}"
    table = _table(value, where)
    unknown = set(table) - {"server", "schema"}
    if unknown:
        raise InvalidInputError(f"tenants file: {where} has unknown keys {sorted(unknown)}")
    server = _text(table, "server", where)
    if server not in servers:
        raise InvalidInputError(f"tenants file: {where}.server names no server: {server!r}")
    schema = _text(table, "schema", where, DEFAULT_SCHEMA)
    check_tenant_names(name, schema, None)
    return OrgPlacement(server, schema)


def parse_tenants(document: Mapping[str, object], path: str | None = None) -> TenantsFile:
    """A tenants file from its parsed TOML `document` (see the module docstring)."""
    unknown = set(document) - {"servers", "orgs", "control"}
    if unknown:
        raise InvalidInputError(f"tenants file: unknown tables {sorted(unknown)}")
    servers: dict[str, str] = {}
    for name, value in _table(document.get("servers", {}), "servers").items():
        dsn = _text(_table(value, f"servers.{name}"), "dsn", f"servers.{name}")
        check_dsn(dsn)
        servers[name] = dsn
    if not servers:
        raise InvalidInputError("tenants file: no [servers.NAME] table names a server")
    orgs = {name: _placement(name, value, servers)
            for name, value in _table(document.get("orgs", {}), "orgs").items()}
    default = orgs.pop(DEFAULT_ORG, None)
    control = document.get("control")
    control_dsn = (next(iter(servers.values())) if control is None
                   else _text(_table(control, "control"), "dsn", "control"))
    check_dsn(control_dsn)
    return TenantsFile(servers, orgs, default, control_dsn, path)


def load_tenants_file(path: str | Path) -> TenantsFile:
    """Read and parse the tenants file at `path` (InvalidInputError for a missing or bad one)."""
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except OSError as exc:
        raise InvalidInputError(f"cannot read the tenants file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInputError(f"the tenants file {path} is not valid TOML: {exc}") from None
    return parse_tenants(document, str(path))
