"""The control table: where each org lives, whether it is fenced, and how far a move got.

How it works
- One table, `runplane_control.placements`, on the control server (the tenants file's first
  server, or `[control] dsn`): per org its server, schema, `fenced`, and a move's target and
  step (`MoveStep`). The row `default` holds `[orgs.default]`.
- `seed(conn, file)` creates the table when missing and inserts the file's placements that the
  table does not hold yet (`ON CONFLICT DO NOTHING`): the file only seeds it, so a reloaded or
  restarted process never undoes a move. Creation is serialized by an advisory lock on the
  table's name (the control schema is runplane's own; other applications' keys are untouched).
- `read(conn)` reads every placement in one statement (every process polls it each second);
  the writers below are one statement each, used by `engine.placement.move`.
- `control_connection(dsn)` is one plain connection of the control login, closed after.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Mapping

import attrs

from .. import pg
from ..errors import TenantUnreachableError
from ..sql import SqlLiteral
from ..tenant import describe_dsn
from .tenants_file import DEFAULT_ORG, OrgPlacement, TenantsFile

CONTROL_SCHEMA = "runplane_control"
TABLE = f"{CONTROL_SCHEMA}.placements"


class MoveStep(SqlLiteral):
    """The step a move of an org is at (recorded before the step runs; `--resume` redoes it)."""

    FENCE = "fence"
    COPY = "copy"
    SWITCH = "switch"
    UNFENCE = "unfence"


_CREATE = f"""
SELECT pg_advisory_xact_lock(hashtextextended('runplane.control:placements', 0));
CREATE SCHEMA IF NOT EXISTS {CONTROL_SCHEMA};
CREATE TABLE IF NOT EXISTS {TABLE} (
    org_id text PRIMARY KEY,
    server text NOT NULL,
    schema_name text NOT NULL,
    fenced boolean NOT NULL DEFAULT false,
    move_to text,
    move_step text,
    moved_from text,
    updated_at timestamptz NOT NULL DEFAULT now()
);
"""

_SEED = f"""
INSERT INTO {TABLE} (org_id, server, schema_name)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[])
ON CONFLICT (org_id) DO NOTHING
"""

_READ = f"""SELECT org_id, server, schema_name, fenced, move_to, move_step, moved_from
  FROM {TABLE}"""


@attrs.frozen
class Placement:
    """One org's row of the control table."""

    org: str
    server: str
    schema: str
    fenced: bool = False
    move_to: str | None = None
    move_step: MoveStep | None = None
    moved_from: str | None = None

    @property
    def where(self) -> OrgPlacement:
        return OrgPlacement(self.server, self.schema)


@contextlib.asynccontextmanager
async def connect(driver: pg.Driver, dsn: str) -> AsyncIterator[pg.Connection]:
    """One plain connection to `dsn` on `driver` (UTC, so digests of times agree), closed
    after the block."""
    try:
        raw = await driver.connect(dsn, server_settings={"application_name": "runplane",
                                                         "TimeZone": "UTC"})
    except Exception as exc:  # the driver's own error, untranslated: a connect that failed
        raise TenantUnreachableError(f"cannot reach {describe_dsn(dsn)}: {exc}") from exc
    try:
        yield pg.Connection(raw, driver)
    finally:
        await pg.close_gracefully(raw, driver)


@contextlib.asynccontextmanager
async def control_connection(dsn: str) -> AsyncIterator[pg.Connection]:
    """One plain connection to `dsn` on a driver of its own."""
    async with pg.open_driver() as driver:
        async with connect(driver, dsn) as conn:
            yield conn


async def seed(conn: pg.Connection, file: TenantsFile) -> None:
    """Create the control table if missing and insert the file's placements it lacks."""
    places = dict(file.orgs)
    if file.default is not None:
        places[DEFAULT_ORG] = file.default
    async with conn.transaction():
        await conn.execute(_CREATE)
        await conn.execute(_SEED, list(places), [p.server for p in places.values()],
                           [p.schema for p in places.values()])


async def read(conn: pg.Connection) -> Mapping[str, Placement]:
    """Every org's placement, by org (the `default` row included)."""
    rows = await conn.fetch(_READ)
    return {row["org_id"]: Placement(
        row["org_id"], row["server"], row["schema_name"], row["fenced"], row["move_to"],
        None if row["move_step"] is None else MoveStep(row["move_step"]), row["moved_from"])
        for row in rows}


async def record_step(conn: pg.Connection, placement: Placement, step: MoveStep, *,
                      fenced: bool = True) -> Placement:
    """Record that the move of `placement.org` to `placement.move_to` is at `step`."""
    await conn.execute(
        f"""INSERT INTO {TABLE} (org_id, server, schema_name, fenced, move_to, move_step)
            VALUES ($1, $2, $3, $4, $5, $6)
            ON CONFLICT (org_id) DO UPDATE SET fenced = $4, move_to = $5, move_step = $6,
                                              updated_at = now()""",
        placement.org, placement.server, placement.schema, fenced, placement.move_to, step.value)
    return attrs.evolve(placement, fenced=fenced, move_step=step)


async def switch(conn: pg.Connection, placement: Placement) -> Placement:
    """Route the org to its move's target (still fenced; the step becomes `unfence`)."""
    assert placement.move_to is not None
    await conn.execute(
        f"""UPDATE {TABLE} SET server = move_to, moved_from = server, move_step = $2,
                               updated_at = now() WHERE org_id = $1""",
        placement.org, MoveStep.UNFENCE.value)
    return attrs.evolve(placement, server=placement.move_to, moved_from=placement.server,
                        move_step=MoveStep.UNFENCE)


async def since_update_s(conn: pg.Connection, org: str) -> float:
    """Seconds since the org's row last changed (by the control server's clock; 0: no row)."""
    seconds = await conn.fetchval(
        f"SELECT extract(epoch FROM now() - updated_at) FROM {TABLE} WHERE org_id = $1", org)
    return 0.0 if seconds is None else float(seconds)


async def settle(conn: pg.Connection, org: str, *, moved_from: str | None) -> None:
    """End a move (done or rolled back): unfenced, no step, `moved_from` as given (the server
    that still holds the org's rows until `--drop-source`)."""
    await conn.execute(
        f"""UPDATE {TABLE} SET fenced = false, move_to = NULL, move_step = NULL,
                               moved_from = $2, updated_at = now() WHERE org_id = $1""",
        org, moved_from)
