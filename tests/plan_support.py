"""Plans of the statements an engine call sends, as the server would run them.

`PlanPort(inner)` is a port that, before each statement a checkout sends, asks the server for
that statement's plan on the same connection, inside the same transaction (so the transaction's
own settings apply), with the real bind values:
- the custom plan: `EXPLAIN (FORMAT JSON) <statement>` with the statement's arguments;
- the generic plan a prepared statement switches to after five executions: the statement is
  `PREPARE`d and `EXPLAIN EXECUTE`d under `plan_cache_mode = force_generic_plan` (in a savepoint,
  so a statement that cannot be prepared this way changes nothing).
Neither runs the statement (no `ANALYZE`), so data-modifying statements are safe to explain.
`scans_off_index(plan, watched)` lists the plan nodes that reach a watched table other than
through an index lookup: a sequential or bitmap scan, or an index scan with no index condition
(a walk over the whole index). Only tests use this module.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, AsyncIterator, Callable, Iterator

import attrs

from runplane.engine import pg
from runplane.engine.ports import PortWrapper

# Statements with no plan worth checking (transaction control, settings, DDL, locks).
_NO_PLAN = re.compile(
    r"^\s*(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|SET|SHOW|RESET|CREATE|ALTER|DROP|ANALYZE|"
    r"GRANT|REVOKE|COMMENT|LOCK|NOTIFY|LISTEN|DEALLOCATE|DO|VACUUM|TRUNCATE)\b",
    re.IGNORECASE,
)
_SCANS = {"Seq Scan", "Bitmap Heap Scan", "Bitmap Index Scan", "Tid Range Scan"}
_INDEX_SCANS = {"Index Scan", "Index Only Scan"}


@attrs.define
class Explained:
    """One statement and its two plans (the JSON `Plan` trees)."""

    sql: str
    custom: dict
    generic: dict | None
    generic_error: str | None = None


def nodes(plan: dict) -> Iterator[dict]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from nodes(child)


def scans_off_index(plan: dict, watched: Callable[[str], bool], limited: bool = False) -> list[str]:
    """The nodes of `plan` that read a watched relation other than by an index lookup (an index
    walked in order under a `Limit` reads only what the limit takes, and counts as a lookup)."""
    bad = []
    relation = plan.get("Relation Name")
    kind = plan["Node Type"]
    if relation is not None and watched(relation) and (
            kind in _SCANS or (kind in _INDEX_SCANS and "Index Cond" not in plan and not limited)):
        bad.append(f"{kind} on {relation} ({plan.get('Filter', plan.get('Index Cond', ''))})")
    for child in plan.get("Plans", ()):
        bad += scans_off_index(child, watched, limited or kind == "Limit")
    return bad


@attrs.define(eq=False)
class PlanPort(PortWrapper):
    """A port that is `inner` but explains every statement before it is sent."""

    generic: bool = True
    explained: list[Explained] = attrs.field(factory=list)
    _busy: bool = attrs.field(default=False)

    @contextlib.asynccontextmanager
    async def connection(self, lane: str) -> AsyncIterator[pg.Connection]:
        async with self.inner.connection(lane) as conn:
            inner_hook = conn.statement_hook

            async def hook(sql: str, send: Any) -> Any:
                if not self._busy and not _NO_PLAN.match(sql) and ";" not in sql.strip().rstrip(";"):
                    method, args = send.args[0], send.args[1]
                    if method in ("execute", "fetch", "fetchrow", "fetchval"):
                        await self._explain(conn, sql, list(args[1:]))
                return await (inner_hook(sql, send) if inner_hook is not None else send())

            conn.statement_hook = hook
            try:
                yield conn
            finally:
                conn.statement_hook = inner_hook

    async def _explain(self, conn: pg.Connection, sql: str, args: list[Any]) -> None:
        self._busy = True
        try:
            custom = await conn.fetchval("EXPLAIN (FORMAT JSON) " + sql, *args)
            entry = Explained(sql, json.loads(custom)[0]["Plan"], None)
            if self.generic:
                await self._explain_generic(conn, sql, args, entry)
            self.explained.append(entry)
        finally:
            self._busy = False

    async def _explain_generic(
        self, conn: pg.Connection, sql: str, args: list[Any], entry: Explained
    ) -> None:
        in_txn = conn.in_transaction
        await conn.execute("SAVEPOINT plan_check" if in_txn else "BEGIN")
        prepared = False
        try:
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            await conn.execute("PREPARE plan_check AS " + sql)
            prepared = True
            # A generic plan is the same whatever the values: NULLs stand in for them (a utility
            # statement such as EXPLAIN EXECUTE takes no bind parameters).
            nulls = ", ".join("NULL" for _ in args)
            execute = "EXECUTE plan_check" + (f"({nulls})" if args else "")
            generic = await conn.fetchval("EXPLAIN (FORMAT JSON) " + execute)
            entry.generic = json.loads(generic)[0]["Plan"]
        except Exception as exc:  # recorded; the test decides whether it matters
            entry.generic_error = f"{type(exc).__name__}: {exc}"
        finally:
            await conn.execute("ROLLBACK TO SAVEPOINT plan_check" if in_txn else "ROLLBACK")
            if in_txn:
                await conn.execute("RELEASE SAVEPOINT plan_check")
            if prepared:  # not transactional: undone by nothing but DEALLOCATE
                await conn.execute("DEALLOCATE plan_check")
