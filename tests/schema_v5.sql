-- The tenant schema at version 5 (unique physical names) without its row-level security policies,
-- frozen: the lock-secret migration is tested from it (the bootstrap installs the policies again).
-- {s} is the quoted schema name.
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
    state text NOT NULL DEFAULT 'pending',
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
    ON {s}.terminal_outbox (next_attempt_at) WHERE state = 'pending';
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
INSERT INTO {s}.meta (key, value) VALUES ('schema_version', '5')
    ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value;
