"""The fence of a shared map's leased units around plain writes (admission and completion).

How it works
- A shared map hands its rows out in units (`engine.shared.leases`); the holder of a unit's
  lease admits and completes the unit's rows under its own attempt. A plain write of the same
  run (no unit guard: another process, or a hostile token of the run) must not touch those
  rows while the lease is held, even once a row's own attempt lease lapsed (unit leases are
  renewed, the rows' are not).
- `leased_units` is the CTE `leased`: the input-index ranges [low, high) of the run's units in
  this sheet that are leased now (not done, lease not expired, map open), read by one probe of
  `shared_units` by its key prefix (org, play, run) per statement: nothing per row when the
  run shares no map. `in_leased(index)` says whether an input index falls in one of them.
- Only a login that reads the unit leases uses it (`reads_unit_leases`): a database session
  reads none, and may write its sheet's rows by hand anyway.
This module does no I/O.
"""

from __future__ import annotations

from ..ports import Port, table
from ..shared.maps import MapState


def leased_units(port: Port, *, org: str, play: str, run_id: str, namespace: str) -> str:
    """The CTE `leased` (with its trailing comma) for the binds named `org`, `play`, `run_id`
    and `namespace` (see the module docstring)."""
    return f"""
leased AS MATERIALIZED (
    SELECT u.low, u.low + u.row_count AS high
      FROM {table(port, "shared_units")} AS u
      JOIN {table(port, "shared_maps")} AS m
        ON m.org_id = u.org_id AND m.play = u.play AND m.run_id = u.run_id
       AND m.map_invocation_id = u.map_invocation_id
     WHERE u.org_id = {org} AND u.play = {play} AND u.run_id = {run_id}
       AND NOT u.done AND u.expires_at > now()
       AND m.state = {MapState.OPEN.sql} AND m.table_namespace = {namespace}
),"""


def in_leased(index: str) -> str:
    """True when input index `index` (an expression) is a row of a unit in `leased`."""
    return f"EXISTS (SELECT 1 FROM leased AS l WHERE {index} >= l.low AND {index} < l.high)"


def reads_unit_leases(port: Port) -> bool:
    """Whether the port's login reads the shared maps' unit leases, so that its plain writes are
    fenced on their rows: a login that reads the schema's lock secret reads every runplane
    table (the owner's, the gateway's). A database session reads neither; it may write its
    sheet's rows by hand anyway, so a fence in its statements would bind nothing."""
    return port.settings.lock_secret is not None
