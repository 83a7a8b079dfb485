"""How the database keeps a scoped session inside its org: grants plus row-level
security, installed by the schema bootstrap. No I/O except `install`, which runs inside the
bootstrap's transaction (under its per-schema advisory lock).

The choice, and why
- A tenant schema holds many orgs. Sheets are one table per (org, play, namespace); everything
  else is shared and keyed by org: `work_receipts` (user receipts under the key prefix
  `["org","play","receipt",`, array-input facts under `["org","play","array_input_…`),
  `sheet_summary`, `sheet_column_summary`, `sheet_columns`, `sheet_reuse`, the counter deltas
  and `shared_maps` (keyed by org, play, namespace), `runs` and `terminal_outbox` (keyed by
  org). A schema per org would move every existing
  tenant's data; instead a session is confined inside the schema:
  - sheet tables by **grants**: a session holds privileges on exactly one sheet table (its
    org, play and namespace); every other sheet is `permission denied`;
  - the shared tables a session may touch by **row-level security**: each has a permissive
    policy that admits every row for every role (owners bypass RLS anyway, execution roles and
    other logins keep working unchanged) and a RESTRICTIVE policy for members of the NOLOGIN
    group `runplane_sessions`, which keeps only the rows of the session's scope as recorded in
    `session_scopes` — one row per session role, written only by the login that mints sessions
    (a session may read its own row, never write any). Deletes are further restricted to array
    facts (retirement), so no session ever deletes a receipt. The scope values are scalar
    subqueries, so PostgreSQL evaluates them once per statement (InitPlans), not once per row.
    A session's summary row may only name its own sheet's table;
  - `runs`, `terminal_outbox` and every other table: no grant at all.
- The group has no privileges of its own. Session roles are members WITH INHERIT TRUE, SET FALSE
  (PostgreSQL 16+), so they cannot even `SET ROLE runplane_sessions`.
- When the bootstrapping login may not create roles and the group does not exist yet, the
  policies are skipped (no session can exist then) and `sessions.mint` says so.
"""

from __future__ import annotations

from ..pg import Connection
from ..sql import qualified, quote_ident

GROUP = "runplane_sessions"
SCOPES_TABLE = "session_scopes"
RECEIPT_SCOPED_TABLES = ("work_receipts",)
SHEET_SCOPED_TABLES = ("sheet_summary", "sheet_column_summary", "sheet_columns", "sheet_reuse",
                       "sheet_counter_deltas", "sheet_column_deltas", "shared_maps")
POLICY_PREFIX = "runplane_"



def _scope(m: str, column: str) -> str:
    return f"(SELECT {column} FROM {m} WHERE role_name = current_user)"


def policies(schema: str) -> dict[tuple[str, str], str]:
    """`(table, policy name) -> CREATE POLICY statement` for every policy sessions rely on."""
    m = qualified(schema, SCOPES_TABLE)
    group = quote_ident(GROUP)
    in_keys = (
        f"((k >= {_scope(m, 'receipts_low')} AND k < {_scope(m, 'receipts_high')})"
        f" OR (k >= {_scope(m, 'facts_low')} AND k < {_scope(m, 'facts_high')}))"
    )
    in_facts = f"(k >= {_scope(m, 'facts_low')} AND k < {_scope(m, 'facts_high')})"
    in_sheet = (
        f"(org_id = {_scope(m, 'org_id')} AND play = {_scope(m, 'play')}"
        f" AND table_namespace = {_scope(m, 'table_namespace')})"
    )
    scoped = {
        **{name: in_keys for name in RECEIPT_SCOPED_TABLES},
        **{name: in_sheet for name in SHEET_SCOPED_TABLES},
        SCOPES_TABLE: "(role_name = current_user)",
    }
    out: dict[tuple[str, str], str] = {}
    for name, condition in scoped.items():
        t = qualified(schema, name)
        out[name, POLICY_PREFIX + "everyone"] = (
            f"CREATE POLICY {POLICY_PREFIX}everyone ON {t} AS PERMISSIVE FOR ALL TO PUBLIC"
            " USING (true) WITH CHECK (true)"
        )
        out[name, POLICY_PREFIX + "session_scope"] = (
            f"CREATE POLICY {POLICY_PREFIX}session_scope ON {t} AS RESTRICTIVE FOR ALL TO {group}"
            f" USING {condition} WITH CHECK {condition}"
        )
    # A session writes its own summary row, whose table name must be its own sheet's: it can
    # never claim (squat) the table name of another org's sheet.
    own_table = f"(table_name IS NULL OR table_name = {_scope(m, 'sheet_table')})"
    out["sheet_summary", POLICY_PREFIX + "session_table_name"] = (
        f"CREATE POLICY {POLICY_PREFIX}session_table_name ON {qualified(schema, 'sheet_summary')}"
        f" AS RESTRICTIVE FOR ALL TO {group} USING (true) WITH CHECK {own_table}"
    )
    for name in RECEIPT_SCOPED_TABLES:
        out[name, POLICY_PREFIX + "session_deletes"] = (
            f"CREATE POLICY {POLICY_PREFIX}session_deletes ON {qualified(schema, name)}"
            f" AS RESTRICTIVE FOR DELETE TO {group} USING {in_facts}"
        )
    return out


_GROUP_STATE = """
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $1) AS present,
       (SELECT rolsuper OR rolcreaterole FROM pg_catalog.pg_roles WHERE rolname = current_user)
           AS can_create
"""

_INSTALLED = """
SELECT c.relname::text AS table_name, c.relrowsecurity AS secured,
       coalesce(array_agg(p.polname::text) FILTER (WHERE p.polname IS NOT NULL), '{}') AS names
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
  LEFT JOIN pg_catalog.pg_policy p ON p.polrelid = c.oid
 WHERE n.nspname = $1 AND c.relname = ANY($2::text[]) AND c.relkind IN ('r', 'p')
 GROUP BY c.relname, c.relrowsecurity
"""


async def group_exists(conn: Connection) -> bool:
    return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $1)", GROUP))


async def missing_policies(conn: Connection, schema: str) -> list[tuple[str, str]]:
    """The policies (and RLS switches, as `(table, "rls")`) sessions need that are absent."""
    wanted = policies(schema)
    tables = sorted({name for name, _ in wanted})
    rows = await conn.fetch(_INSTALLED, schema, tables)
    state = {row["table_name"]: (row["secured"], set(row["names"])) for row in rows}
    missing: list[tuple[str, str]] = []
    for name in tables:
        secured, names = state.get(name, (False, set()))
        if not secured:
            missing.append((name, "rls"))
        missing += [(t, p) for (t, p) in wanted if t == name and p not in names]
    return missing


# Per-table statistics (row counts, writes, scans of every table in the database) are open to
# everyone by default: the `pg_stat_get_*(oid)` functions and the views built on them
# (`pg_stat_user_tables`, `pg_statio_all_indexes`, ...). A superuser bootstrap takes them from
# PUBLIC and gives them to `pg_read_all_stats` (so `pg_monitor` keeps them). What stays readable
# (`pg_class.reltuples` and `relpages`, table names) is listed in docs/guide/operations.md.
STATISTICS_READER = "pg_read_all_stats"

_STATISTICS_OPEN = """
SELECT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)
       AND has_function_privilege($1, 'pg_catalog.pg_stat_get_live_tuples(oid)', 'EXECUTE')
"""

_CLOSE_STATISTICS = """
DO $$
DECLARE
  fns regprocedure[];
  names text[];
  f regprocedure;
  v regclass;
BEGIN
  SELECT array_agg(p.oid::regprocedure), array_agg(DISTINCT p.proname::text)
    INTO fns, names
    FROM pg_catalog.pg_proc p
   WHERE p.pronamespace = 'pg_catalog'::regnamespace
     AND p.proname LIKE 'pg\\_stat\\_get\\_%'
     AND p.proname NOT LIKE 'pg\\_stat\\_get\\_db\\_%'
     AND p.proname NOT LIKE 'pg\\_stat\\_get\\_subscription%'
     AND p.pronargs = 1 AND p.proargtypes[0] = 'oid'::regtype;
  FOREACH f IN ARRAY fns LOOP
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO {reader}', f);
  END LOOP;
  FOR v IN SELECT c.oid::regclass FROM pg_catalog.pg_class c
            WHERE c.relnamespace = 'pg_catalog'::regnamespace AND c.relkind = 'v'
              AND EXISTS (SELECT 1 FROM unnest(names) AS n
                           WHERE pg_catalog.pg_get_viewdef(c.oid) LIKE '%' || n || '(%')
  LOOP
    EXECUTE format('REVOKE SELECT ON %s FROM PUBLIC', v);
    EXECUTE format('GRANT SELECT ON %s TO {reader}', v);
  END LOOP;
END $$
"""


async def close_statistics(conn: Connection) -> bool:
    """Take per-table statistics from PUBLIC (see above), when this login is a superuser and
    they are still open; True when it did."""
    if not await conn.fetchval(_STATISTICS_OPEN, GROUP):
        return False
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('runplane.statistics', 0))")
    await conn.execute(_CLOSE_STATISTICS.format(reader=quote_ident(STATISTICS_READER)))
    return True


async def install(conn: Connection, schema: str) -> bool:
    """Create the group (when allowed) and the policies, after the schema's tables (the scope
    table among them) exist; idempotent, and lock-light when already installed (it only reads the
    catalog). True when sessions can be minted on this schema."""
    state = await conn.fetchrow(_GROUP_STATE, GROUP)
    if not state["present"]:
        if not state["can_create"]:
            return False
        # Roles are cluster-wide: serialize creation across every schema's bootstrap.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('runplane.sessions_group', 0))")
        if not await group_exists(conn):
            await conn.execute(f"CREATE ROLE {quote_ident(GROUP)} NOLOGIN")
    await close_statistics(conn)
    wanted = policies(schema)
    for name, policy in await missing_policies(conn, schema):
        if policy == "rls":
            await conn.execute(f"ALTER TABLE {qualified(schema, name)} ENABLE ROW LEVEL SECURITY")
        else:
            await conn.execute(wanted[name, policy])
    return True
