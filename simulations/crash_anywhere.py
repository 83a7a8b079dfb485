"""Scenario `crash_anywhere`: a play killed (SIGKILL) at its k-th statement, then woken.

How it works
- The play: a supervised run (`actors.open_supervisor`, `sup.run`, as the product hosts plays)
  maps a small list source — so it is staged, sealed, admitted, completed and, when the body
  ends, retired — with a deterministic user function that fails a few rows.
- The child runs the play on its tenant wrapped in a `HookedPort` whose statement hook
  (`CrashAtStatement`, installed on every connection the port checks out) counts the statements
  the play sends. A reference child process runs the play once with `--crash-at 0` (count
  only); that count N is the play's number of statement boundaries.
- For each boundary k (every k in 1..N, or a seeded sample when more are asked than wanted), a
  child process runs the play under a play name of its own with `--crash-at k`: the hook kills
  the process with SIGKILL just before its k-th statement (a k past the end lets it finish). The
  parent then snapshots the sheet, and a fresh child process wakes the run (same run id, same
  list, no hook) and lets the supervisor's drainer run until the run's outbox entry is done.
- Checks, per k: every row ends with the model's status, output and error; no row finished
  (enriched) before the wake was rewritten (`_version` unchanged) or executed by the wake —
  failed rows are run again, as any rerun does;
  the sheet counters equal COUNT(*); the outbox entry is `done`; no array-input fact of the
  retired run is left (only the retained guard). The report counts boundaries as examples and
  kills as faults.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import uuid

import attrs
import trio

from runplane.actors import open_supervisor
from runplane.engine import PlayScope, RunScope, open_tenant, sheets
from runplane.engine.runs import outbox
from runplane.engine.runs.outbox import OutboxState
from runplane.engine.sheets import RowStatus
from runplane.engine.ports import SHEET_LANE
from runplane.engine.sheets.layout import column, layout_for
from runplane.engine.sql import quote_ident

from . import resolve_dsn
from .counters import counters_match
from .ports import Boundary, HookedPort
from .report import SimulationReport

NAME = "crash_anywhere"
ORG, TABLE = "org-crash", "companies"
ROWS = 24
CONCURRENCY = 4
CONTRACT = sheets.SheetContract(inputs=("name", "i"), outputs=("upper",))
LEASE_S = 1.0        # short leases, so a drainer takes over a killed holder's entry quickly
POLL_S = 0.2
CHILD_TIMEOUT_S = 60.0
DONE_TIMEOUT_S = 15.0
MAX_BOUNDARIES = 200


def source_rows() -> list[dict]:
    return [{"name": f"r{i}", "i": i} for i in range(ROWS)]


def expected(i: int) -> tuple[str, str | None, str | None]:
    """(status, upper, error) the model says row i ends with."""
    if i % 7 == 3:
        return "failed", None, f"no data for r{i}"
    return "enriched", f"R{i}", None


# -- the child processes -----------------------------------------------------------------------
@attrs.define(eq=False)
class CrashAtStatement:
    """A `HookedPort` hook: counts the statements sent through its port and kills the process
    with SIGKILL just before the `crash_at`-th (0: count only)."""

    crash_at: int
    sent: int = 0

    async def at_boundary(self, boundary: Boundary) -> None:
        if boundary.kind != "query":
            return
        self.sent += 1
        if self.sent == self.crash_at:
            where = " ".join((boundary.sql or "").split())[:100]
            os.write(2, f"crash-anywhere: SIGKILL before statement {self.sent}: {where}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)


async def play_child(dsn: str, schema: str, play: str, run_id: str,
                     crash_at: int | None = None) -> dict:
    """Run (or wake) the play under a supervisor; wait until its outbox entry is done. With
    `crash_at`, every statement goes through a `CrashAtStatement` hook (see the module doc)."""
    calls: list[int] = []

    async def enrich(row: dict) -> dict:
        await trio.lowlevel.checkpoint()
        calls.append(row["i"])
        status, upper, error = expected(row["i"])
        if status == RowStatus.FAILED:
            raise LookupError(error)
        return {"upper": upper}

    async def body(run):
        return await run.map(TABLE, source_rows(), enrich, contract=CONTRACT,
                             concurrency=CONCURRENCY)

    scope = RunScope(ORG, play, run_id)
    crash = None if crash_at is None else CrashAtStatement(crash_at)
    async with open_tenant(ORG, dsn, schema=schema) as tenant:
        port = tenant if crash is None else HookedPort(tenant, crash)
        async with open_supervisor(port, lease_s=LEASE_S, poll_interval=POLL_S) as sup:
            await sup.run(play, body, run_id=run_id)
            state = None
            with trio.move_on_after(DONE_TIMEOUT_S):
                while (state := await _outbox_state(port, scope)) != OutboxState.DONE:
                    sup.nudge()
                    await trio.sleep(POLL_S)
    return {"statements": 0 if crash is None else crash.sent, "calls": calls, "outbox": state}


async def _outbox_state(tenant, scope: RunScope) -> str | None:
    entry = await outbox.get(tenant, scope)
    return None if entry is None else entry.state


def child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="crash_anywhere child")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--play", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--crash-at", type=int, default=None)
    args = parser.parse_args(argv)
    out = trio.run(play_child, args.dsn, args.schema, args.play, args.run_id, args.crash_at)
    print(json.dumps(out), flush=True)
    return 0


# -- the harness -------------------------------------------------------------------------------
async def spawn(dsn: str, schema: str, play: str, run_id: str, crash_at: int | None):
    command = [sys.executable, "-m", "runplane.simulations.crash_anywhere", "--child",
               "--dsn", dsn, "--schema", schema, "--play", play, "--run-id", run_id]
    if crash_at is not None:
        command += ["--crash-at", str(crash_at)]
    with trio.fail_after(CHILD_TIMEOUT_S):
        return await trio.run_process(command, capture_stdout=True, capture_stderr=True,
                                      check=False)


def child_output(process) -> dict:
    lines = process.stdout.decode().strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


async def sheet_state(tenant, scope: PlayScope) -> dict[int, dict]:
    layout = layout_for(tenant, scope, TABLE)
    async with tenant.connection(SHEET_LANE) as conn:
        present = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", layout.qualified)
        if not present:
            return {}
        records = await conn.fetch(
            f"SELECT {column('i')}::text AS i, {column('upper')}::text AS upper, _status,"
            f" _error, _version FROM {layout.qualified}")
    return {int(json.loads(r["i"])): {"status": r["_status"], "error": r["_error"],
                                      "upper": None if r["upper"] is None else json.loads(r["upper"]),
                                      "version": r["_version"]} for r in records}


def statement_label(sql: str) -> str:
    """A short name for the statement a child was killed before (for the report's tally)."""
    words = sql.replace("(", " ").split()
    if not words:
        return "?"
    if words[0] == "WITH" and len(words) > 1:
        return f"WITH {words[1]}"
    return words[0]


async def check_boundary(tenant, dsn: str, k: int) -> tuple[list[str], str | None]:
    """Kill the play at statement k, wake it, check; return (violations, the label of the
    statement the play was killed before, or None when it finished first)."""
    play, run_id = f"play-k{k}", f"run-k{k}"
    scope = PlayScope(ORG, play)
    first = await spawn(dsn, tenant.schema, play, run_id, k)
    killed = None
    where = f"k={k}"
    if first.returncode == -signal.SIGKILL:
        line = next((line for line in first.stderr.decode().splitlines()
                     if line.startswith("crash-anywhere: SIGKILL before statement")), "")
        sql = line.split(": ", 2)[-1]
        killed = statement_label(sql)
        where += f" (before {sql[:90]})"
    elif first.returncode != 0:
        return [f"{where}: the first process failed ({first.returncode}): "
                f"{first.stderr.decode()[-400:]}"], killed
    before = await sheet_state(tenant, scope)
    # Finished = its outputs are stored. A failed row is run again by design (a rerun
    # re-executes failed rows), so only enriched rows must be left alone by the wake.
    finished = {i: row for i, row in before.items() if row["status"] == RowStatus.ENRICHED}
    wake = await spawn(dsn, tenant.schema, play, run_id, None)
    if wake.returncode != 0:
        return [f"{where}: the wake failed ({wake.returncode}): {wake.stderr.decode()[-400:]}"], killed
    woke = child_output(wake)
    out: list[str] = []
    after = await sheet_state(tenant, scope)
    if sorted(after) != list(range(ROWS)):
        out.append(f"{where}: the sheet holds rows {sorted(after)}, expected 0..{ROWS - 1}")
    for i, row in sorted(after.items()):
        status, upper, error = expected(i)
        got = (row["status"], row["upper"] if status == RowStatus.ENRICHED else None,
               row["error"] if status == RowStatus.FAILED else None)
        if got != (status, upper, error):
            out.append(f"{where}: row {i} is {got}, expected {(status, upper, error)}")
            break
    rewritten = sorted(i for i, row in finished.items()
                       if after.get(i, {}).get("version") != row["version"])
    if rewritten:
        out.append(f"{where}: rows finished before the wake were rewritten: {rewritten[:10]}")
    rerun = sorted(set(woke.get("calls", ())) & set(finished))
    if rerun:
        out.append(f"{where}: rows finished before the wake ran again: {rerun[:10]}")
    ok, detail = await counters_match(tenant, scope, TABLE)
    if not ok:
        out.append(f"{where}: {detail}")
    state = await _outbox_state(tenant, RunScope(ORG, play, run_id))
    if state != OutboxState.DONE:
        out.append(f"{where}: the outbox entry is {state!r}")
    async with tenant.connection(SHEET_LANE) as conn:
        records = await conn.fetch(
            f'SELECT output->>\'kind\' AS kind FROM "{tenant.schema}".work_receipts'
            " WHERE run_id = $1 AND output->>'kind' LIKE 'array_input_%'", run_id)
    kinds = sorted(row["kind"] for row in records)
    if kinds not in ([], ["array_input_guard"]):
        out.append(f"{where}: array facts left after retirement: {kinds}")
    return out, killed


def choose_boundaries(total: int, examples: int, seed: int | None) -> list[int]:
    """Every boundary 1..total, or a seeded sample of `examples` of them when there are more."""
    want = min(examples, MAX_BOUNDARIES)
    if total <= want:
        return list(range(1, total + 1))
    return sorted(random.Random(seed).sample(range(1, total + 1), want))


async def run_all(dsn: str, examples: int, seed: int | None) -> SimulationReport:
    report = SimulationReport(NAME)
    schema = f"sim_{uuid.uuid4().hex[:16]}"
    async with open_tenant(ORG, dsn, schema=schema) as tenant:
        try:
            reference = await spawn(dsn, schema, "play-reference", "run-reference", 0)
            if reference.returncode != 0:
                report.violations.append(
                    f"the reference play failed: {reference.stderr.decode()[-400:]}")
                return report
            total = child_output(reference)["statements"]
            boundaries = choose_boundaries(total, examples, seed)
            before = collections.Counter()
            for k in boundaries:
                violations, killed = await check_boundary(tenant, dsn, k)
                report.examples += 1
                if killed is not None:
                    report.faults += 1
                    report.fault_counts["sigkill"] += 1
                    before[killed] += 1
                report.violations.extend(violations)
            report.notes.append(f"the play sends {total} statements; killed before "
                                f"{len(boundaries)} of them: " + ", ".join(
                                    f"{label} {n}" for label, n in sorted(before.items())))
        finally:
            async with tenant.connection(SHEET_LANE) as conn:
                await conn.execute(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE")
    return report


def run(examples: int, seed: int | None, dsn: str | None = None) -> SimulationReport:
    """Kill the play at `examples` of its statement boundaries (all when it has no more)."""
    return trio.run(run_all, resolve_dsn(dsn), examples, seed)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child_main(sys.argv[2:]))
    report = run(int(sys.argv[1]) if len(sys.argv) > 1 else MAX_BOUNDARIES, None)
    print(report.summary())
    sys.exit(0 if report.ok else 1)
