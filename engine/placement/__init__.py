"""Many servers: where each org lives, and moving an org from one PostgreSQL to another online.

How it works
- `tenants_file`: the operator's tenants file (TOML, read with the standard library): servers by
  name, orgs placed on them, an optional `[orgs.default]` and `[control]`.
- `control`: the control table on the control server (the first server of the file, or
  `[control] dsn`): each org's placement, fence and move step. The file only seeds it; every
  process reads placements from the table.
- `router`: a process's view of the control table, polled every second, the file reloaded on
  SIGHUP; `routed`: the gateway's tenants over many servers, routed by the token's org.
- `following`: a direct tenant (a command given `--tenants FILE --org ORG`, the local console)
  that follows its org to its new server while it runs, connection by connection.
- `fence`: the fence inside the database (triggers that fail any write of a fenced org);
  `copying`: an org's tables copied with COPY, verified by counts and digests; `org_views`: its
  sheet views, recreated on the target; `move`: the steps of `move-org`, each recorded so an
  interrupted move resumes or rolls back.
See docs/architecture.md ("Many servers") and docs/guide/operations.md ("Many servers:
moving an org").
"""

from .tenants_file import OrgPlacement, TenantsFile, load_tenants_file, parse_tenants

__all__ = ["OrgPlacement", "TenantsFile", "load_tenants_file", "parse_tenants"]
