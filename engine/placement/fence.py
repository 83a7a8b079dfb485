"""The fence inside the database: while an org moves, any write of its rows fails, whatever path
it came by (a gateway, a direct runner, a database session, `runplane sql`).

How it works
- `install(conn, schema, org)` creates, in one transaction, triggers that raise SQLSTATE 55P03
  (lock not available: `LockTimeoutError`, a `StoreUnavailableError` every layer retries and the
  gateway answers 503 with `retry_after_ms`) on every write of the org: a row trigger with a
  `WHEN` on `org_id` on each table of the schema that has that column, one on `work_receipts`
  whose key starts with the org's prefix (`engine.values.keys`), and a statement trigger on each
  of the org's own sheet tables. Creating a trigger waits for the transactions writing that
  table to end, so once `install` returns, no write of the org is in flight: the run's last
  writes either committed before the fence (and are copied) or fail and are retried after.
- Triggers exist only while the org is fenced (other orgs pay one `WHEN` test per row, during a
  move only). The DDL takes all its table locks first (`bounded`): without waiting, then, under
  load, waiting at most half the server's `deadlock_timeout` for all of them before it rolls
  back and tries again. So no other org's writer queues behind the fence for long, and none is
  ever chosen as the victim of a deadlock with it.
- `end_sessions` expires the org's database-session roles on the source and ends their
  connections: a runner mints its next session through the gateway, on the new server.
- `remove(conn, schema, org)` drops them; `org_tables(conn, schema, org)` lists what belongs to
  an org (`OrgTables`), which the copy and `--drop-source` share.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Sequence

import attrs
import trio

from .. import pg
from ..errors import InsufficientPrivilegeError, LockTimeoutError, StatementTimeoutError
from ..sheets.layout import table_name
from ..sql import qualified, quote_ident

log = logging.getLogger("runplane.placement")

FENCE_FUNCTION = "runplane_fenced"
LOCK_PHASE_MS = 400
FENCE_ATTEMPTS = 600
NOWAIT_ATTEMPTS, NOWAIT_PAUSE_S = 20, 0.02
RECEIPTS_TABLE = "work_receipts"
# Database sessions are roles of one server: their scope rows are neither fenced nor copied nor
# deleted by a move; `end_sessions` expires the org's roles at the fence (the sweep drops them).
NOT_COPIED = frozenset({"session_scopes"})

_FUNCTION = """
CREATE OR REPLACE FUNCTION {s}.{f}() RETURNS trigger LANGUAGE plpgsql AS $fence$
BEGIN
    RAISE EXCEPTION 'org % is fenced: it is moving to another server, retry shortly',
        TG_ARGV[0] USING ERRCODE = '55P03';
END
$fence$
"""

_ORG_TABLES = """
SELECT c.relname FROM pg_catalog.pg_class AS c
  JOIN pg_catalog.pg_attribute AS a ON a.attrelid = c.oid AND a.attname = 'org_id'
 WHERE c.relnamespace = to_regnamespace($1) AND c.relkind = 'r' AND NOT a.attisdropped
 ORDER BY c.relname
"""

_SHEETS = """
SELECT play, table_namespace, table_name FROM {summary} WHERE org_id = $1
"""


def literal(value: str) -> str:
    """`value` as an SQL string literal (for trigger DDL, which takes no bind values)."""
    return "'" + value.replace("'", "''") + "'"


def receipt_prefix(org: str) -> bytes:
    """The bytes every stored receipt key of `org` starts with (`engine.values.keys`)."""
    return json.dumps([org], separators=(",", ":"), ensure_ascii=False).encode()[:-1] + b","


@attrs.frozen
class OrgTables:
    """What belongs to an org in one schema: tables shared by orgs (keyed by `org_id`) and
    the org's own sheet tables (that exist)."""

    schema: str
    shared: tuple[str, ...]
    sheets: tuple[str, ...]


async def org_tables(conn: pg.Connection, schema: str, org: str) -> OrgTables:
    """What belongs to `org` in `schema` on `conn`'s server (nothing when no such schema)."""
    if await conn.fetchval("SELECT to_regnamespace($1)", quote_ident(schema)) is None:
        return OrgTables(schema, (), ())
    shared = [row["relname"] for row in await conn.fetch(_ORG_TABLES, quote_ident(schema))]
    names = set()
    if "sheet_summary" in shared:
        for row in await conn.fetch(_SHEETS.format(summary=qualified(schema, "sheet_summary")),
                                    org):
            names.add(row["table_name"] or table_name(org, row["play"], row["table_namespace"]))
    exists = await conn.fetch(
        "SELECT relname FROM pg_catalog.pg_class WHERE relnamespace = to_regnamespace($1)"
        " AND relkind = 'r' AND relname = ANY($2::text[])", quote_ident(schema), sorted(names))
    return OrgTables(schema, tuple(shared), tuple(sorted(row["relname"] for row in exists)))


def _trigger(org: str, suffix: str) -> str:
    return f"runplane_fence_{hashlib.sha256(org.encode()).hexdigest()[:16]}_{suffix}"


def _fence_sql(tables: OrgTables, org: str) -> list[str]:
    s, lit = quote_ident(tables.schema), literal(org)
    run = f"EXECUTE FUNCTION {s}.{FENCE_FUNCTION}({lit})"
    statements = [_FUNCTION.format(s=s, f=FENCE_FUNCTION)]
    for name in (name for name in tables.shared if name not in NOT_COPIED):
        t = qualified(tables.schema, name)
        statements.append(f"CREATE TRIGGER {_trigger(org, 'w')} BEFORE INSERT OR UPDATE ON {t}"
                          f" FOR EACH ROW WHEN (NEW.org_id = {lit}) {run}")
        statements.append(f"CREATE TRIGGER {_trigger(org, 'd')} BEFORE DELETE ON {t}"
                          f" FOR EACH ROW WHEN (OLD.org_id = {lit}) {run}")
    prefix = receipt_prefix(org)
    receipts = qualified(tables.schema, RECEIPTS_TABLE)
    starts = f"'\\x{prefix.hex()}'::bytea"
    for suffix, row, ops in (("w", "NEW", "INSERT OR UPDATE"), ("d", "OLD", "DELETE")):
        statements.append(
            f"CREATE TRIGGER {_trigger(org, suffix)} BEFORE {ops} ON {receipts} FOR EACH ROW"
            f" WHEN (substring({row}.k from 1 for {len(prefix)}) = {starts}) {run}")
    for name in tables.sheets:
        statements.append(
            f"CREATE TRIGGER {_trigger(org, 's')} BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE"
            f" ON {qualified(tables.schema, name)} FOR EACH STATEMENT {run}")
    return statements


async def _triggers(conn: pg.Connection, schema: str, org: str) -> list[tuple[str, str]]:
    rows = await conn.fetch(
        "SELECT t.tgname, c.relname FROM pg_catalog.pg_trigger AS t"
        " JOIN pg_catalog.pg_class AS c ON c.oid = t.tgrelid"
        " WHERE c.relnamespace = to_regnamespace($1) AND t.tgname LIKE $2",
        quote_ident(schema), _trigger(org, "%"))
    return [(row["tgname"], row["relname"]) for row in rows]


async def is_fenced(conn: pg.Connection, schema: str, org: str) -> bool:
    return bool(await _triggers(conn, schema, org))


@attrs.frozen
class Locks:
    """The tables a DDL transaction of a move locks first: `share` in SHARE ROW EXCLUSIVE mode
    (what creating a trigger takes), `exclusive` in ACCESS EXCLUSIVE (what dropping a trigger
    or a table takes). Qualified names."""

    share: tuple[str, ...] = ()
    exclusive: tuple[str, ...] = ()


async def _lock(conn: pg.Connection, locks: Locks, *, wait: bool) -> None:
    for mode, names in (("SHARE ROW EXCLUSIVE", locks.share),
                        ("ACCESS EXCLUSIVE", locks.exclusive)):
        if names:
            await conn.execute(f"LOCK TABLE {', '.join(sorted(set(names)))} IN {mode} MODE"
                               + ("" if wait else " NOWAIT"))


async def _lock_phase_ms(conn: pg.Connection) -> int:
    """How long the waiting lock phase may last: half the server's `deadlock_timeout`, at most
    `LOCK_PHASE_MS` (a writer waiting on the fence is then never waiting long enough for its
    own deadlock check to run while the fence waits too)."""
    seconds = await conn.fetchval(
        "SELECT extract(epoch FROM current_setting('deadlock_timeout')::interval)")
    return max(10, min(LOCK_PHASE_MS, int(float(seconds) * 500)))


async def bounded(conn: pg.Connection, statements: list[str], locks: Locks) -> None:
    """Run `statements` in one transaction that first takes `locks`, then runs them without
    waiting for anything else. The locks are tried without waiting (`NOWAIT`) first, then with
    waits whose whole phase is bounded (`_lock_phase_ms`), each attempt rolled back and retried
    when it does not get them: the fence is never in a deadlock whose victim is another org's
    writer, and a writer queues behind it at most that long."""
    phase_ms = await _lock_phase_ms(conn)
    for attempt in range(NOWAIT_ATTEMPTS + FENCE_ATTEMPTS):
        wait = attempt >= NOWAIT_ATTEMPTS
        try:
            async with conn.transaction():
                if wait:
                    await conn.execute("SELECT set_config('statement_timeout', $1, true)",
                                       f"{phase_ms}ms")
                await _lock(conn, locks, wait=wait)
                await conn.execute("SELECT set_config('statement_timeout', '0', true)")
                for statement in statements:
                    await conn.execute(statement)
            return
        except (LockTimeoutError, StatementTimeoutError):
            if attempt == NOWAIT_ATTEMPTS + FENCE_ATTEMPTS - 1:
                raise
            await trio.sleep(NOWAIT_PAUSE_S)


async def _drops(conn: pg.Connection, schema: str, org: str) -> tuple[list[str], Locks]:
    found = await _triggers(conn, schema, org)
    return ([f"DROP TRIGGER IF EXISTS {quote_ident(name)} ON {qualified(schema, table)}"
             for name, table in found],
            Locks(exclusive=tuple(qualified(schema, table) for _, table in found)))


async def install(conn: pg.Connection, schema: str, org: str) -> OrgTables:
    """Fence `org` in `schema` (idempotent: an existing fence is replaced)."""
    tables = await org_tables(conn, schema, org)
    drops, locks = await _drops(conn, schema, org)
    fenced = [name for name in tables.shared if name not in NOT_COPIED]
    fenced += [RECEIPTS_TABLE, *tables.sheets]
    await bounded(conn, drops + _fence_sql(tables, org), attrs.evolve(
        locks, share=tuple(qualified(schema, t) for t in fenced)))
    return tables


async def remove(conn: pg.Connection, schema: str, org: str, *,
                 dropping: tuple[str, ...] = (), then: Sequence[str] = (),
                 views: tuple[str, ...] = ()) -> None:
    """Lift the fence of `org` in `schema`; in the same transaction drop the views named in
    `views` (qualified) and then the tables named in `dropping`, and run the statements `then`
    (deleting the org's rows: nothing slips in between)."""
    drops, locks = await _drops(conn, schema, org)
    drops = [f"DROP VIEW IF EXISTS {name}" for name in views] + drops
    drops += [f"DROP TABLE IF EXISTS {qualified(schema, name)}" for name in dropping]
    drops += then
    if drops:
        await bounded(conn, drops, attrs.evolve(locks, exclusive=(
            locks.exclusive + views + tuple(qualified(schema, n) for n in dropping))))


async def end_sessions(conn: pg.Connection, schema: str, org: str) -> int:
    """Expire `org`'s database-session roles in `schema` and end their connections (a runner
    mints a new session, through the gateway, on the org's new server); the schema's sweep
    drops them. Returns how many roles were ended; a login that may not signal them only
    expires them (logged)."""
    scopes = qualified(schema, "session_scopes")
    if await conn.fetchval("SELECT to_regclass($1)", scopes) is None:
        return 0
    roles = [row["rolname"] for row in await conn.fetch(
        f"SELECT r.rolname FROM {scopes} AS s JOIN pg_catalog.pg_roles AS r"
        " ON r.rolname = s.role_name WHERE s.org_id = $1", org)]
    for role in roles:
        await conn.execute(f"ALTER ROLE {quote_ident(role)} VALID UNTIL 'epoch'")
    try:
        await conn.execute("SELECT pg_catalog.pg_terminate_backend(pid)"
                           " FROM pg_catalog.pg_stat_activity WHERE usename = ANY($1::text[])",
                           roles)
    except InsufficientPrivilegeError as exc:
        log.warning("move: the org's session connections were not ended: %s", exc)
    return len(roles)
