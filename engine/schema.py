"""The tenant schema: idempotent bootstrap DDL, safe when several processes start at once.

`bootstrap(conn, schema)` runs every statement below in one transaction under a lock on the
schema's `meta` table (an advisory lock keyed by the schema name while the schema does not exist
yet), so concurrent bootstraps serialize instead of racing on `CREATE ... IF NOT EXISTS` (which
is not atomic in PostgreSQL). `schema_status` reads the stored
version without taking the lock. Per-sheet tables are created by `engine.sheets`, not here;
`sheet_columns` is their registry (which physical column holds which field). The bootstrap also
installs what scoped database sessions rely on (`engine.sessions.isolation`).
Versions: 2 added `runs.command` (how to resume a run, recorded by the command line); 3 added
`rate_limits` (shared rate-limit buckets, `engine.limits.rates`); 4 added `session_scopes` and the
row-level security policies of database sessions; 5 makes physical names unique: one column per
field in `sheet_columns` (a unique index on the column name, after dropping the later of any two
registrations that already shared one) and one table per sheet (`sheet_summary.table_name`,
unique, filled by the next write of each sheet); 6 adds `lock_secret` (one random value no
session may read; it derived sheet advisory-lock keys until sheet locks became row locks on
`sheet_summary`, and the bootstrap's key until it became a table lock on `meta`) and
`session_scopes.sheet_lock_key` (a session's own sheet's key, still recorded: it marks a
database session's port, `PortSettings.sheet_lock_keys`). An older schema is upgraded in place by the same idempotent bootstrap, with no
manual step; processes of version 5 and 6 running side by side during an upgrade take
different keys for the same sheet (writers of one sheet still serialize on its summary row);
7 adds work-receipt leases (`work_receipts.lease_expires_at`: a running receipt whose lease
has expired may be claimed again) and `sheet_reuse` (the rows each rerun reused).
8 adds `run_maps`, the run history (what each map of each run did, `engine.runs.history`).
9 adds shared maps (`shared_maps`, `shared_units`, `shared_workers`; `engine.shared.maps`).
10 adds counter deltas (`sheet_counter_deltas`, `sheet_column_deltas`; `engine.sheets.counters`).
11 adds recorded lists (`sheet_summary.writes`, `sheet_lists`; `engine.sheets.lists`).
12 adds `row_calls`: how many rows each process has inside a call now (`engine.runs.row_calls`).
13 adds `runs.cancel_requested_at`: a run asked to stop (`engine.runs.cancel`).
14 makes run epochs unique per org (`runs (org_id, epoch)`), not per schema: an org moved to
another server (`engine.placement`) keeps its epochs beside the orgs already there.
15 adds `run_maps.spec`: the function and policies a map ran with, for retries
(`engine.runs.retry_spec`), and `run_outages`, the outages a run rode out
(`engine.runs.outages`).
"""

from __future__ import annotations

import secrets

from .runs.history import MapRunState
from .runs.outbox import OutboxState
from .sessions import isolation as session_isolation
from .shared.maps import MapState
from .sheets.layout import SHEET_FILLFACTOR
from .lock_keys import LOCK_SECRET_TABLE, SECRET_READABLE
from .sql import qualified, quote_ident

SCHEMA_VERSION = "16"
BOOTSTRAP_LOCK_TIMEOUT = "5s"

_DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE SEQUENCE IF NOT EXISTS {s}.run_epochs;
CREATE SEQUENCE IF NOT EXISTS {s}.row_versions;
CREATE TABLE IF NOT EXISTS {s}.meta (
    key text PRIMARY KEY,
    value text NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.runs (
    org_id text NOT NULL,
    play text NOT NULL,
    run_id text NOT NULL,
    epoch bigint NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, run_id)
);
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS command text;
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS cancel_requested_at timestamptz;
CREATE TABLE IF NOT EXISTS {s}.work_receipts (
    k bytea PRIMARY KEY,
    status smallint NOT NULL,
    output jsonb,
    error text,
    run_id text,
    epoch bigint,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {s}.sheet_summary (
    org_id text NOT NULL,
    play text NOT NULL,
    table_namespace text NOT NULL,
    total bigint NOT NULL DEFAULT 0,
    queued bigint NOT NULL DEFAULT 0,
    running bigint NOT NULL DEFAULT 0,
    completed bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, table_namespace)
);
CREATE TABLE IF NOT EXISTS {s}.sheet_column_summary (
    org_id text NOT NULL,
    play text NOT NULL,
    table_namespace text NOT NULL,
    field text NOT NULL,
    completed bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (org_id, play, table_namespace, field)
);
CREATE TABLE IF NOT EXISTS {s}.sheet_columns (
    org_id text NOT NULL,
    play text NOT NULL,
    table_namespace text NOT NULL,
    field text NOT NULL,
    column_name text NOT NULL,
    position integer NOT NULL,
    PRIMARY KEY (org_id, play, table_namespace, field)
);
ALTER TABLE {s}.sheet_summary ADD COLUMN IF NOT EXISTS table_name text;
CREATE UNIQUE INDEX IF NOT EXISTS sheet_summary_table_name ON {s}.sheet_summary (table_name);
DELETE FROM {s}.sheet_columns AS later
 USING {s}.sheet_columns AS earlier
 WHERE later.org_id = earlier.org_id AND later.play = earlier.play
   AND later.table_namespace = earlier.table_namespace
   AND later.column_name = earlier.column_name
   AND (later.position, later.field) > (earlier.position, earlier.field);
CREATE UNIQUE INDEX IF NOT EXISTS sheet_columns_column_name
    ON {s}.sheet_columns (org_id, play, table_namespace, column_name);
CREATE TABLE IF NOT EXISTS {s}.terminal_outbox (
    org_id text NOT NULL,
    play text NOT NULL,
    run_id text NOT NULL,
    state text NOT NULL DEFAULT {OutboxState.PENDING.sql},
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_owner text,
    lease_expires_at timestamptz,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, run_id)
);
CREATE TABLE IF NOT EXISTS {s}.rate_limits (
    org_id text NOT NULL,
    key text NOT NULL,
    tokens float8 NOT NULL,
    granted integer NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, key)
);
CREATE INDEX IF NOT EXISTS terminal_outbox_due
    ON {s}.terminal_outbox (next_attempt_at) WHERE state = {OutboxState.PENDING.sql};
CREATE TABLE IF NOT EXISTS {s}.session_scopes (
    role_name text PRIMARY KEY,
    org_id text NOT NULL,
    play text NOT NULL,
    table_namespace text NOT NULL,
    operations text[] NOT NULL,
    sheet_table text,
    receipts_low bytea,
    receipts_high bytea,
    facts_low bytea,
    facts_high bytea,
    expires_at timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {s}.lock_secret (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    secret bytea NOT NULL
);
ALTER TABLE {s}.session_scopes ADD COLUMN IF NOT EXISTS sheet_lock_key bigint;
-- version 7: work-receipt leases (engine.receipts). NULL on receipts claimed before: never expires.
ALTER TABLE {s}.work_receipts ADD COLUMN IF NOT EXISTS lease_expires_at timestamptz;
-- version 7: the rows a rerun reused (engine.sheets.reuse), one row per map holding its keys
-- (row keys as 16-byte digests, uncompressed: they are random; other keys as text).
CREATE TABLE IF NOT EXISTS {s}.sheet_reuse (
    org_id text NOT NULL,
    play text NOT NULL,
    table_namespace text NOT NULL,
    run_id text NOT NULL,
    id bigint GENERATED BY DEFAULT AS IDENTITY,
    epoch bigint NOT NULL,
    digests bytea,
    keys text[],
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, table_namespace, run_id, id)
);
ALTER TABLE {s}.sheet_reuse ALTER COLUMN digests SET STORAGE EXTERNAL;
-- end of version 7
-- version 8: run history (engine.runs.history) ------------------------------------------------
CREATE TABLE IF NOT EXISTS {s}.run_maps (
    org_id text NOT NULL,
    play text NOT NULL,
    run_id text NOT NULL,
    map_key text NOT NULL,
    table_namespace text NOT NULL,
    state text NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at timestamptz,
    source_rows bigint NOT NULL DEFAULT 0,
    admitted bigint NOT NULL DEFAULT 0,
    cached bigint NOT NULL DEFAULT 0,
    completed bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    blocked bigint NOT NULL DEFAULT 0,
    retried bigint NOT NULL DEFAULT 0,
    running bigint NOT NULL DEFAULT 0,
    stop_reason text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, run_id, map_key)
);
CREATE INDEX IF NOT EXISTS run_maps_live ON {s}.run_maps (org_id, play) WHERE state = {MapRunState.RUNNING.sql};
ALTER TABLE {s}.run_maps ADD COLUMN IF NOT EXISTS spec jsonb;
CREATE TABLE IF NOT EXISTS {s}.run_outages (
    org_id text NOT NULL,
    play text NOT NULL,
    run_id text NOT NULL,
    began_at timestamptz NOT NULL,
    seconds float8 NOT NULL,
    PRIMARY KEY (org_id, play, run_id, began_at)
);
-- end of version 8 -----------------------------------------------------------------------------
-- Shared maps (engine.shared.maps), from version 9: a published map, its units (slices of
-- staged pages, handed out as leases) and the workers that joined the play's maps.
CREATE TABLE IF NOT EXISTS {s}.shared_maps (
    org_id text NOT NULL,
    play text NOT NULL,
    run_id text NOT NULL,
    map_invocation_id text NOT NULL,
    epoch bigint NOT NULL,
    table_namespace text NOT NULL,
    config jsonb NOT NULL,
    function text NOT NULL,
    play_digest text NOT NULL,
    state text NOT NULL DEFAULT {MapState.WAITING.sql},
    units integer NOT NULL,
    lease_s float8 NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, run_id, map_invocation_id)
);
CREATE INDEX IF NOT EXISTS shared_maps_live ON {s}.shared_maps (org_id, play)
    WHERE state IN ({MapState.WAITING.sql}, {MapState.OPEN.sql});
CREATE TABLE IF NOT EXISTS {s}.shared_units (
    org_id text NOT NULL,
    play text NOT NULL,
    run_id text NOT NULL,
    map_invocation_id text NOT NULL,
    unit integer NOT NULL,
    page integer NOT NULL,
    low integer NOT NULL,
    row_count integer NOT NULL,
    done boolean NOT NULL DEFAULT false,
    holder text,
    claims integer NOT NULL DEFAULT 0,
    expires_at timestamptz,
    counters jsonb,
    PRIMARY KEY (org_id, play, run_id, map_invocation_id, unit)
);
CREATE TABLE IF NOT EXISTS {s}.shared_workers (
    org_id text NOT NULL,
    play text NOT NULL,
    worker_id text NOT NULL,
    pid integer NOT NULL,
    host text NOT NULL,
    units_done integer NOT NULL DEFAULT 0,
    seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, worker_id)
);
-- end of version 9 -----------------------------------------------------------------------------
-- Counter deltas (engine.sheets.counters), from version 10: the writers of one shared map write
-- at once, each adding its counter deltas to its own row (keyed by its backend's pid); readers
-- add them to `sheet_summary` / `sheet_column_summary` until a fold moves them there.
CREATE TABLE IF NOT EXISTS {s}.sheet_counter_deltas (
    org_id text NOT NULL,
    play text NOT NULL,
    table_namespace text NOT NULL,
    slot integer NOT NULL,
    total bigint NOT NULL DEFAULT 0,
    queued bigint NOT NULL DEFAULT 0,
    running bigint NOT NULL DEFAULT 0,
    completed bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (org_id, play, table_namespace, slot)
);
CREATE TABLE IF NOT EXISTS {s}.sheet_column_deltas (
    org_id text NOT NULL,
    play text NOT NULL,
    table_namespace text NOT NULL,
    field text NOT NULL,
    slot integer NOT NULL,
    completed bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (org_id, play, table_namespace, field, slot)
);
-- end of version 10 ----------------------------------------------------------------------------
-- Recorded lists (engine.sheets.lists), from version 11: every sheet write transaction adds one
-- to its sheet's `writes`; a list recorded while every row of it was a cache hit answers an
-- unchanged rerun in one statement while `writes` has not moved (row keys as 16-byte digests).
ALTER TABLE {s}.sheet_summary ADD COLUMN IF NOT EXISTS writes bigint NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS {s}.sheet_lists (
    org_id text NOT NULL,
    play text NOT NULL,
    table_namespace text NOT NULL,
    digest bytea NOT NULL,
    writes bigint NOT NULL,
    row_count integer NOT NULL,
    digests bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, table_namespace, digest)
);
ALTER TABLE {s}.sheet_lists ALTER COLUMN digests SET STORAGE EXTERNAL;
-- Session roles minted before version 11 that write a sheet's counters bump `writes` too.
DO $grant$
DECLARE r record;
BEGIN
    FOR r IN SELECT DISTINCT p.grantee FROM information_schema.column_privileges AS p
              WHERE p.table_schema = {schema_literal} AND p.table_name = 'sheet_summary'
                AND p.column_name = 'updated_at' AND p.privilege_type = 'UPDATE'
                AND p.grantee <> current_user
    LOOP
        EXECUTE format('GRANT SELECT (writes), UPDATE (writes) ON %I.sheet_summary TO %I',
                       {schema_literal}, r.grantee);
    END LOOP;
END
$grant$;
-- end of version 11 ----------------------------------------------------------------------------
-- Rows in a call (engine.runs.row_calls), from version 12: every process hosting a map's rows
-- writes how many of them are inside a call of the function now, at least every few seconds.
CREATE TABLE IF NOT EXISTS {s}.row_calls (
    org_id text NOT NULL,
    play text NOT NULL,
    run_id text NOT NULL,
    map_key text NOT NULL,
    process text NOT NULL,
    table_namespace text NOT NULL,
    in_call integer NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, play, run_id, map_key, process)
);
-- version 14: run epochs unique per org (an org moved between servers keeps its epochs)
CREATE UNIQUE INDEX IF NOT EXISTS runs_org_epoch ON {s}.runs (org_id, epoch);
ALTER TABLE {s}.runs DROP CONSTRAINT IF EXISTS runs_epoch_key;
-- version 16: sheets leave 65% of each page free (engine.sheets.layout.SHEET_FILLFACTOR) so a
-- completion updates its rows in place; a sheet made before is set to it once (pages written
-- afterwards follow it). A sheet this login may not alter, or cannot lock at once, keeps its own.
DO $fill$
DECLARE t text;
BEGIN
    IF coalesce((SELECT value FROM {s}.meta WHERE key = 'schema_version'), '16')::integer < 16 THEN
        FOR t IN SELECT c.relname FROM pg_catalog.pg_class AS c
                   JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
                  WHERE n.nspname = {schema_literal} AND c.relkind = 'r'
                    AND c.relname IN (SELECT table_name FROM {s}.sheet_summary)
        LOOP
            BEGIN
                EXECUTE format('ALTER TABLE %I.%I SET (fillfactor = {fillfactor})',
                               {schema_literal}, t);
            EXCEPTION WHEN insufficient_privilege OR lock_not_available THEN
                NULL;
            END;
        END LOOP;
    END IF;
END
$fill$;
INSERT INTO {s}.meta (key, value) VALUES ('schema_version', '{version}')
    ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value;
"""

_GRANTS = """
GRANT USAGE, CREATE ON SCHEMA {s} TO {role};
GRANT ALL ON ALL TABLES IN SCHEMA {s} TO {role};
GRANT ALL ON ALL SEQUENCES IN SCHEMA {s} TO {role};
"""


def bootstrap_sql(schema: str, execution_role: str | None = None) -> str:
    s = quote_ident(schema)
    text = _DDL.format(s=s, version=SCHEMA_VERSION, fillfactor=SHEET_FILLFACTOR,
                       schema_literal="'" + schema.replace("'", "''") + "'",
                       OutboxState=OutboxState, MapRunState=MapRunState, MapState=MapState)
    if execution_role is not None:
        text += _GRANTS.format(s=s, role=quote_ident(execution_role))
    return text


async def bootstrap(conn, schema: str, execution_role: str | None = None, *,
                    unless_current: bool = False) -> None:
    """Create or upgrade the schema; idempotent and serialized across processes. With
    `unless_current`, a schema found current once the lock is held (a peer bootstrapped it
    while this one waited: many tenants opening at once on a new schema) is left as it is,
    so they wait for one bootstrap, not for one each."""
    async with conn.transaction():
        # A schema that exists is locked by a table lock on its `meta` table, which no database
        # session can take or hold off (sessions may only read it: their ACCESS SHARE does not
        # conflict with this mode). An advisory key would not do: every login sees held keys in
        # `pg_locks` and may take any key. A schema not created yet (no session can exist on
        # it) is locked by name, so concurrent first bootstraps agree on one key.
        meta = qualified(schema, "meta")
        lock_meta = f"LOCK TABLE {meta} IN SHARE ROW EXCLUSIVE MODE"
        if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", meta):
            await conn.execute(lock_meta)
        else:
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended('runplane.bootstrap:' || $1, 0))",
                schema,
            )
            # The peer that held the name may have created the schema meanwhile. This backend's
            # catalog cache does not know yet (an advisory lock, unlike a table lock, takes in
            # no catalog changes), so `to_regclass` would still say "absent" and every tenant
            # opening at once would run the whole DDL in turn, taking ACCESS EXCLUSIVE locks on
            # tables that runs are writing. The catalog's own rows, read with this statement's
            # snapshot, tell; locking `meta` by name then takes the changes in, inside this
            # transaction (which may be a caller's, through a transaction-mode pooler).
            if await conn.fetchval(_META_CREATED, schema):
                await conn.execute(lock_meta)
        # DDL on a shared table waits for every open transaction that touched it, and every
        # later statement on the table queues behind that wait: bound it, so a transaction left
        # open (a session's, say) costs other orgs at most this long, and the bootstrap fails
        # with a retryable `LockTimeoutError` instead.
        await conn.execute("SELECT set_config('lock_timeout', $1, true)", BOOTSTRAP_LOCK_TIMEOUT)
        if unless_current and execution_role is None \
                and await schema_status(conn, schema) == SCHEMA_VERSION:
            return
        await conn.execute(bootstrap_sql(schema, execution_role))
        await conn.execute(
            f"INSERT INTO {qualified(schema, LOCK_SECRET_TABLE)} (secret) VALUES ($1)"
            " ON CONFLICT DO NOTHING", secrets.token_bytes(32))
        await session_isolation.install(conn, schema)


# Whether the schema's `meta` table exists, read from the catalog's rows (the statement's
# snapshot), not through the backend's catalog cache.
_META_CREATED = """
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class AS c
                 JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
                WHERE n.nspname = $1 AND c.relname = 'meta')
"""


# Whether the schema is bootstrapped (`$1`), and the stored version once it is.
_BOOTSTRAPPED = "to_regclass(quote_ident($1) || '.meta') IS NOT NULL"


def _version_sql(schema: str) -> str:
    return f"SELECT value FROM {quote_ident(schema)}.meta WHERE key = 'schema_version'"


# Whether the schema is bootstrapped and whether this login may read its lock secret: catalog
# functions only, so one statement answers both before either table is named.
_OPENING_PROBE = (f"SELECT {_BOOTSTRAPPED} AS bootstrapped, "
                  f"{SECRET_READABLE.format(n=2)} AS secret_readable")


async def status_and_secret(conn, schema: str) -> tuple[str | None, bytes | None]:
    """What a tenant's opening reads, in two statements: the stored schema version (None when
    the schema is not bootstrapped) and the lock secret (None when this login may not read it,
    as a database session may not, or there is none yet)."""
    secret_table = qualified(schema, LOCK_SECRET_TABLE)
    probe = await conn.fetchrow(_OPENING_PROBE, schema, secret_table)
    if not probe["bootstrapped"]:
        return None, None
    version = _version_sql(schema)
    if not probe["secret_readable"]:
        return await conn.fetchval(version), None
    row = await conn.fetchrow(
        f"SELECT ({version}) AS version, (SELECT secret FROM {secret_table}) AS secret")
    return row["version"], row["secret"]


async def schema_status(conn, schema: str) -> str | None:
    """The stored schema version, or None when the schema is not bootstrapped."""
    if not await conn.fetchval(f"SELECT {_BOOTSTRAPPED}", schema):
        return None
    return await conn.fetchval(_version_sql(schema))
