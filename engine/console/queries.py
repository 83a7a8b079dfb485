"""The console's reads: runs, a run's maps and their counters, a table's rows, failed rows.

How it works
- Every read checks out a connection on the tenant's `console` lane (a small limit of its own,
  so people looking at pages never take permits from runs) and runs in a read-only transaction
  with a short statement timeout: the console cannot write, and a read that would take long is
  cut off instead of holding a connection.
- Every statement is bounded: listings take `LIMIT` and page by keyset (runs by epoch, sheet
  rows in the sheet's row order `(_input_index, _created_at, _key)`, which the row-order index
  serves). Rows whose input index is null come last, read by a second statement on
  `(_created_at, _key)` once the indexed rows are exhausted, so each statement stays an index
  range.
- Every read is one snapshot (a repeatable-read transaction), so the figures of one page or one
  live tick are of one moment.
- Counters (`sheet_summary`, `sheet_column_summary`) are one primary-key range each, and so is
  what a run did (its run history, `figures`): the runs list and the live stream read only
  those. A run's top errors filter a sheet by `_run_id` and `_status`, which no index serves:
  they scan the sheet, bounded by the statement timeout, and are read when a page loads, never
  per second. Top errors are causes (`sheets.causes`), counted by the sheet's stored `_cause`
  (`sheets.audit.cause_counts_sql`, one statement for every surface) and folded here.
- The caller passes the org (and checks the viewer may see it and the play) before any read;
  every statement filters by org and play, so a page can only show what its viewer may see.
"""

from __future__ import annotations

import datetime
from typing import Awaitable, Callable, TypeVar

import attrs

from ..errors import StatementTimeoutError
from ..runs import row_calls
from ..runs.outbox import OutboxState
from ..pg import Connection, Record
from ..ports import CONSOLE_LANE, Port, table
from ..sheets.audit import cause_counts, cause_counts_sql, sheets_with_causes
from ..sheets.causes import ErrorCause, group_causes
from ..sheets.counters import summary_source
from ..sheets.layout import FOREIGN_TABLE, SheetLayout, table_name
from ..opening import reads_replica
from .figures import MapFigures, RunFigures, run_maps, run_totals

T = TypeVar("T")

STATEMENT_TIMEOUT_MS = 3000
SCAN_TIMEOUT_MS = 1000  # a per-run figure that scans a sheet gives up sooner, and shows "…"
RUNS_PAGE = 50
ROWS_PAGE = 50
MAX_TABLES = 50
MAX_FIELDS = 64
TOP_ERRORS = 5


async def read(port: Port, operation: Callable[[Connection], Awaitable[T]]) -> T:
    """Run `operation` on a console-lane connection in a read-only, time-bounded transaction
    (the checkout's own, when it opened one: an execution role or a transaction-mode pooler;
    it has taken no snapshot yet, so its isolation may still be set)."""
    async with port.connection(CONSOLE_LANE) as conn:
        if conn.in_transaction:
            await conn.execute(_READ_SETUP)
            return await operation(conn)
        async with conn.transaction():
            await conn.execute(_READ_SETUP)
            return await operation(conn)


_READ_SETUP = ("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
               f"SET LOCAL statement_timeout = {STATEMENT_TIMEOUT_MS}")


async def replica_lag(port: Port) -> float | None:
    """How far behind its primary the replica this port reads is (`RUNPLANE_READ_DSN`), in
    seconds; None when it reads no replica."""
    if not reads_replica(port):
        return None
    return await port.replay_lag_s()


async def scan(conn: Connection, sql: str, *args: object) -> list[Record] | None:
    """A statement that scans a sheet, in a savepoint under `SCAN_TIMEOUT_MS`: its records, or
    None when it ran past that (the page then shows the figure as unknown)."""
    try:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL statement_timeout = {SCAN_TIMEOUT_MS}")
            return await conn.fetch(sql, *args)
    except StatementTimeoutError:
        return None


# -- runs -------------------------------------------------------------------------------------
@attrs.frozen
class RunRow:
    org_id: str
    play: str
    run_id: str
    epoch: int
    started: datetime.datetime
    state: OutboxState  # shown as its word (`OutboxState.word`)
    settled: datetime.datetime | None
    command: str | None
    figures: RunFigures | None = None  # what the run did (its run history); None: no map recorded

    @property
    def duration_s(self) -> float:
        settled = self.state is not OutboxState.OPEN and self.settled
        end = self.settled if settled else datetime.datetime.now(datetime.timezone.utc)
        return max(0.0, (end - self.started).total_seconds())


_RUNS = f"""
SELECT r.org_id, r.play, r.run_id, r.epoch, r.created_at, r.command,
       coalesce(o.state, {OutboxState.OPEN.sql}) AS state, o.updated_at AS settled
  FROM {{runs}} AS r
  LEFT JOIN {{outbox}} AS o ON o.org_id = r.org_id AND o.play = r.play AND o.run_id = r.run_id
 WHERE ($1::text IS NULL OR r.org_id = $1::text)
   AND ($2::text[] IS NULL OR r.play = ANY($2::text[]))
   AND ($3::text IS NULL OR r.play = $3::text)
   AND ($4::text IS NULL OR coalesce(o.state, {OutboxState.OPEN.sql}) = $4::text)
   AND ($5::bigint IS NULL OR r.epoch < $5::bigint)
   AND ($7::text[] IS NULL OR r.run_id = ANY($7::text[]))
 ORDER BY r.epoch DESC
 LIMIT $6
"""

_RUN = f"""
SELECT r.org_id, r.play, r.run_id, r.epoch, r.created_at, r.command,
       coalesce(o.state, {OutboxState.OPEN.sql}) AS state, o.updated_at AS settled
  FROM {{runs}} AS r
  LEFT JOIN {{outbox}} AS o ON o.org_id = r.org_id AND o.play = r.play AND o.run_id = r.run_id
 WHERE r.org_id = $1 AND r.play = $2 AND r.run_id = $3
"""

# A table's counters, with "running" as everywhere (rows in a call now, `engine.runs.row_calls`) and
# the stored `running` status as "leased".
_TABLES = """
SELECT table_namespace, total, queued, running AS leased, {in_call} AS running, completed, failed,
       updated_at FROM {summary} AS s
 WHERE org_id = $1 AND play = $2 ORDER BY table_namespace LIMIT {limit}
"""

_PRESENT = "SELECT to_regclass($1) IS NOT NULL AS present, {foreign} AS foreign_table"

def _run_row(record: Record) -> RunRow:
    return RunRow(record["org_id"], record["play"], record["run_id"], record["epoch"],
                  record["created_at"], OutboxState(record["state"]),
                  record["settled"], record["command"])


def layout(port: Port, org: str, play: str, namespace: str) -> SheetLayout:
    return SheetLayout(port.schema, org, play, namespace, table_name(org, play, namespace))


async def _present(conn: Connection, port: Port, sheet: SheetLayout) -> bool:
    """Whether the sheet's table exists and is this sheet's own (never read another's)."""
    sql = _PRESENT.format(foreign=FOREIGN_TABLE.format(
        summary=table(port, "sheet_summary"), t="$2", o="$3", p="$4", n="$5"))
    record = await conn.fetchrow(sql, sheet.qualified, sheet.table, *sheet.counter_args)
    return bool(record["present"]) and not record["foreign_table"]


_PRESENT_MANY = """
SELECT n.i, to_regclass(n.qualified) IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM {summary} AS s WHERE s.table_name = n.name
                          AND (s.org_id, s.play, s.table_namespace) <> (n.org_id, n.play, n.ns))
       AS ours
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[])
       WITH ORDINALITY AS n(org_id, play, ns, qualified, name, i)
"""


async def own_tables(conn: Connection, port: Port, sheets: list[SheetLayout]) -> list[SheetLayout]:
    """Those of `sheets` whose tables exist and are their own (never another sheet's), in one
    statement."""
    if not sheets:
        return []
    records = await conn.fetch(
        _PRESENT_MANY.format(summary=table(port, "sheet_summary")),
        [s.org_id for s in sheets], [s.play for s in sheets], [s.namespace for s in sheets],
        [s.qualified for s in sheets], [s.table for s in sheets])
    ours = {r["i"] for r in records if r["ours"]}
    return [s for i, s in enumerate(sheets, 1) if i in ours]


@attrs.frozen
class RunsQuery:
    """One page of the runs list: whose runs (`org` None: every org; `plays` None: every play;
    `runs` None: every run, else only those run ids), of `play` and in `state` when given,
    older than `before_epoch`, at most `limit` of them."""

    org: str | None
    plays: tuple[str, ...] | None
    play: str | None = None
    state: OutboxState | None = None
    before_epoch: int | None = None
    runs: tuple[str, ...] | None = None
    limit: int = RUNS_PAGE


async def list_runs(port: Port, query: RunsQuery, *, with_rows: bool = True) -> list[RunRow]:
    """The runs of `query`, newest first, one keyset page, each with what it did
    (`with_rows`)."""
    sql = _RUNS.format(runs=table(port, "runs"), outbox=table(port, "terminal_outbox"))
    plays = None if query.plays is None else list(query.plays)
    runs = None if query.runs is None else list(query.runs)
    state = None if query.state is None else query.state.value

    async def op(conn: Connection) -> list[RunRow]:
        records = await conn.fetch(sql, query.org, plays, query.play, state, query.before_epoch,
                                   query.limit, runs)
        found = [_run_row(record) for record in records]
        if not with_rows:
            return found
        totals = await run_totals(conn, port, [(r.org_id, r.play, r.run_id) for r in found])
        return [attrs.evolve(r, figures=totals.get((r.org_id, r.play, r.run_id))) for r in found]

    return await read(port, op)


# -- one run ----------------------------------------------------------------------------------
@attrs.frozen
class TableCounters:
    namespace: str
    total: int
    queued: int
    running: int  # rows in a call now, any run (`engine.runs.row_calls`)
    completed: int
    failed: int
    updated: datetime.datetime | None = None
    leased: int = 0  # the stored `running` status: admitted to a live attempt

    @property
    def done(self) -> int:
        return self.completed + self.failed


@attrs.frozen
class RunTable:
    """A table a run mapped: what the run did on it (its run history) and, read at the same
    moment, the table's counters now (None: the table has none) and the run's top errors
    (None: counting them took too long)."""

    mine: MapFigures
    counters: TableCounters | None
    top_errors: list[ErrorCause] | None

    @property
    def namespace(self) -> str:
        return self.mine.namespace


@attrs.frozen
class LiveTick:
    """One read of the live stream: the run, its maps, the counters of its play's tables and
    the database's clock, all of one moment."""

    run: RunRow | None
    maps: list[MapFigures]
    counters: dict[str, TableCounters]
    now: float | None

# Top errors are causes (`sheets.causes`): failed rows counted by stored cause (or by message
# where none was stored) in SQL, at most `CAUSE_GROUPS` groups a table, folded in Python.
CAUSE_GROUPS = 200


async def cause_sql(conn: Connection, sheets: list[SheetLayout]) -> list[str]:
    """Each sheet's statement counting its failed rows by cause (`$1`: a run id or NULL)."""
    with_cause = await sheets_with_causes(conn, [s.qualified for s in sheets])
    return [cause_counts_sql(s.qualified, s.qualified in with_cause, CAUSE_GROUPS)
            for s in sheets]


def top_causes(records: list[Record]) -> list[ErrorCause]:
    """The `TOP_ERRORS` commonest causes of one table's cause counts."""
    return group_causes(cause_counts(records))[:TOP_ERRORS]


def _counters(record: Record) -> TableCounters:
    return TableCounters(record["table_namespace"], record["total"], record["queued"],
                         record["running"], record["completed"], record["failed"],
                         record["updated_at"], record["leased"])


async def get_run(port: Port, org: str, play: str, run_id: str) -> RunRow | None:
    sql = _RUN.format(runs=table(port, "runs"), outbox=table(port, "terminal_outbox"))

    async def op(conn: Connection) -> RunRow | None:
        record = await conn.fetchrow(sql, org, play, run_id)
        return None if record is None else _run_row(record)

    return await read(port, op)


async def live(port: Port, org: str, play: str, run_id: str) -> LiveTick:
    """The run, its maps and its play's counters, in one snapshot (the live stream's tick)."""
    run_sql = _RUN.format(runs=table(port, "runs"), outbox=table(port, "terminal_outbox"))
    tables_sql = _TABLES.format(summary=summary_source(port), limit=MAX_TABLES,
                           in_call=row_calls.in_call_sql(port, "s"))

    async def op(conn: Connection) -> LiveTick:
        record = await conn.fetchrow(run_sql, org, play, run_id)
        maps, now = await run_maps(conn, port, org, play, run_id)
        found = await _fetch_counters(conn, tables_sql, org, play)
        return LiveTick(None if record is None else _run_row(record), maps,
                        {c.namespace: c for c in found}, now)

    return await read(port, op)


async def _fetch_counters(conn: Connection, sql: str, org: str, play: str) -> list[TableCounters]:
    return [_counters(record) for record in await conn.fetch(sql, org, play)]


async def run_tables(port: Port, org: str, play: str, run_id: str, *,
                     with_errors: bool = True) -> list[RunTable]:
    """Each table the run mapped, with what the run did on it and the table's counters (one
    snapshot), and (`with_errors`) the run's top errors: one scanning statement for all its
    tables together, under `SCAN_TIMEOUT_MS`; without them, no statement scans a sheet."""
    sql = _TABLES.format(summary=summary_source(port), limit=MAX_TABLES,
                           in_call=row_calls.in_call_sql(port, "s"))

    async def op(conn: Connection) -> list[RunTable]:
        maps, _ = await run_maps(conn, port, org, play, run_id)
        counters = {c.namespace: c for c in await _fetch_counters(conn, sql, org, play)}
        present = await own_tables(conn, port, [layout(port, org, play, m.namespace)
                                                for m in maps]) if with_errors else []
        errors = None
        if present:
            errors = await scan(conn, "\nUNION ALL\n".join(
                f"(SELECT {i}::int AS i, q.* FROM ({sql}) AS q)"
                for i, sql in enumerate(await cause_sql(conn, present))), run_id)
        where = {s.namespace: i for i, s in enumerate(present)}
        out = []
        for mine in maps:
            i = where.get(mine.namespace)
            top = ([] if i is None else None if errors is None else
                   top_causes([r for r in errors if r["i"] == i]))
            out.append(RunTable(mine, counters.get(mine.namespace), top))
        return out

    return await read(port, op)


# -- the workers of a play's shared maps ---------------------------------------------------------
@attrs.frozen
class WorkerRow:
    worker_id: str
    pid: int
    host: str
    units_done: int
    seen_s_ago: float


_WORKERS = """
SELECT worker_id, pid, host, units_done,
       extract(epoch FROM now() - seen_at)::float8 AS seen_s_ago
  FROM {workers} WHERE org_id = $1 AND play = $2
 ORDER BY seen_at DESC LIMIT $3
"""
MAX_WORKERS = 50


async def play_workers(port: Port, org: str, play: str) -> list[WorkerRow]:
    """The workers that joined the play's shared maps (`runplane worker`, `--workers`), most
    recently seen first: their pid, host and units done (by primary-key prefix, bounded)."""
    sql = _WORKERS.format(workers=table(port, "shared_workers"))

    async def op(conn: Connection) -> list[WorkerRow]:
        return [WorkerRow(r["worker_id"], r["pid"], r["host"], r["units_done"], r["seen_s_ago"])
                for r in await conn.fetch(sql, org, play, MAX_WORKERS)]

    return await read(port, op)
