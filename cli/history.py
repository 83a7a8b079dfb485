"""`runplane runs PLAY [RUN_ID]`: what each run did, from the run history.

How it works
- `runs PLAY` lists the play's recent runs: id, epoch, start, state (open, retiring, done),
  how long its maps took (first start to last end), and what its maps did — admitted, cached,
  completed, failed, retried, summed over its maps from `engine.runs.history` (a run from before
  the run history shows `-`) — and `unfinished`, the rows the run holds that have no outcome
  yet; then the resume command of each open run.
- `runs PLAY RUN_ID` shows one run: its state, start and resume command, then one line per map
  (its table, state, counts and duration; a map whose entry stopped being written while
  `running` was interrupted) and the reason of a map that stopped early.
- `--json` prints the same as one document.
"""

from __future__ import annotations

import argparse
import os
import urllib.parse

from runplane.engine import PlayScope, runs, sheets
from runplane.engine.runs import history, outbox
from runplane.engine.runs.history import MapRunState
from runplane.engine.runs.outbox import OutboxState
from runplane.engine.errors import EngineError
from runplane.engine.ports import Port
from runplane.engine.values.scopes import RunScope

from .operators import CommandError, play_tables, require_schema
from .progress import duration
from .terminal import emit_json, say, table_lines

DONE = ("admitted", "cached", "completed", "failed", "retried")


async def maps_of(tenant: Port, scope: PlayScope, run_ids: list[str]) -> dict[str, list]:
    """Each run's history entries (none for a schema or gateway without run history)."""
    found: dict[str, list] = {run_id: [] for run_id in run_ids}
    try:
        stored = await history.list_maps(tenant, scope, run_ids)
    except EngineError:
        return found
    for entry in stored:
        found[entry.run_id].append(entry)
    return found


def map_state(entry: history.StoredMap) -> str:
    if entry.record.state == MapRunState.RUNNING and entry.age_s > history.LIVE_S:
        return MapRunState.INTERRUPTED.value
    return entry.record.state.replace("_", " ")


def span_s(entries: list) -> float | None:
    """First start to last end (or last write, for a map still running)."""
    if not entries:
        return None
    start = min(e.record.started_at for e in entries)
    ends = [e.record.ended_at for e in entries if e.record.ended_at is not None]
    return (max(ends) - start).total_seconds() if ends else None


def totals(entries: list) -> dict[str, int] | None:
    if not entries:
        return None
    return {name: sum(getattr(e.record, name) for e in entries) for name in DONE}


async def unfinished_rows(tenant: Port, scope: PlayScope, run_ids: list[str]) -> dict[str, int]:
    counts = {run_id: 0 for run_id in run_ids}
    for table in await play_tables(tenant, scope):
        for run_id, rows in (await sheets.run_rows(tenant, scope, table, run_ids)).items():
            counts[run_id] += rows.pending + rows.running
    return counts


async def show_runs(tenant: Port, args: argparse.Namespace) -> int:
    await require_schema(tenant)
    scope = PlayScope(tenant.org_id, args.play)
    if getattr(args, "run_id", None):
        return await show_run(tenant, scope, args.run_id, args)
    recent = await runs.list_runs(tenant, scope, limit=args.limit)
    if not recent:
        raise CommandError(f"play {scope.play!r} has no runs")
    ids = [info.run_id for info in recent]
    entries = await outbox.get_many(tenant, scope, ids)
    maps = await maps_of(tenant, scope, ids)
    unfinished = await unfinished_rows(tenant, scope, ids)
    listing = []
    for info in recent:
        entry = entries.get(info.run_id)
        state = (entry.state if entry is not None else OutboxState.OPEN).word
        done = totals(maps[info.run_id])
        listing.append({
            "run_id": info.run_id, "epoch": info.epoch, "started": info.created_at,
            "state": state, "duration_s": span_s(maps[info.run_id]),
            **{name: (done[name] if done else None) for name in DONE},
            "unfinished": unfinished[info.run_id],
            "resume_command": info.command if state == OutboxState.OPEN.word else None,
        })
    if args.json:
        emit_json({"play": scope.play, "runs": [
            {**row, "started": row["started"].isoformat()} for row in listing]}, args.json_stream)
        return 0
    header = ("run id", "epoch", "started", "state", "took", *DONE, "unfinished")
    rows = [(row["run_id"], row["epoch"],
             row["started"].astimezone().strftime("%Y-%m-%d %H:%M:%S"), row["state"],
             duration(row["duration_s"]),
             *("-" if row[name] is None else row[name] for name in DONE), row["unfinished"])
            for row in listing]
    for line in table_lines(header, rows, right=(1, 4, 5, 6, 7, 8, 9, 10)):
        say(line)
    for row in listing:
        if row["state"] != OutboxState.OPEN.word:
            continue
        command = row["resume_command"] or (
            f"(started from Python: wake it with actors.open_run(tenant, "
            f"{scope.play!r}, {row['run_id']!r}))")
        say(f"resume {row['run_id']}: {command}")
    console = os.environ.get("RUNPLANE_CONSOLE_URL", "").strip().rstrip("/")
    for row in listing if console else ():  # a page of the web console per run
        say(f"console {row['run_id']}: {console}/ui/runs/"
            f"{urllib.parse.quote(scope.play, safe='')}/"
            f"{urllib.parse.quote(row['run_id'], safe='')}?org={urllib.parse.quote(scope.org_id)}")
    return 0


async def show_run(tenant: Port, scope: PlayScope, run_id: str, args: argparse.Namespace) -> int:
    info = await runs.get(tenant, RunScope(scope.org_id, scope.play, run_id))
    if info is None:
        raise CommandError(f"play {scope.play!r} has no run {run_id!r}")
    entry = (await outbox.get_many(tenant, scope, [run_id])).get(run_id)
    state = (entry.state if entry is not None else OutboxState.OPEN).word
    entries = (await maps_of(tenant, scope, [run_id]))[run_id]
    unfinished = (await unfinished_rows(tenant, scope, [run_id]))[run_id]
    maps = [{"map": e.record.map_id, "table": e.record.table_namespace, "state": map_state(e),
             "source_rows": e.record.source_rows, "admitted": e.record.admitted,
             "cached": e.record.cached, "completed": e.record.completed,
             "failed": e.record.failed, "blocked": e.record.blocked,
             "retried": e.record.retried, "duration_s": e.record.duration_s,
             "started": e.record.started_at.isoformat(), "stop_reason": e.record.stop_reason}
            for e in entries]
    resume = info.command if state == OutboxState.OPEN.word else None
    if args.json:
        emit_json({"play": scope.play, "run_id": run_id, "epoch": info.epoch,
                   "started": info.created_at.isoformat(), "state": state,
                   "duration_s": span_s(entries), "unfinished": unfinished,
                   "resume_command": resume, "maps": maps}, args.json_stream)
        return 0
    say(f"run {run_id} of play {scope.play}: {state}, epoch {info.epoch}, started "
        f"{info.created_at.astimezone():%Y-%m-%d %H:%M:%S}, took {duration(span_s(entries))}, "
        f"{unfinished} rows unfinished")
    if not maps:
        say("  no maps recorded (a run from before the run history, or one that mapped nothing)")
    columns = ("map", "table", "state", "admitted", "cached", "completed", "failed", "blocked",
               "retried")
    listing = [(*(m[c] for c in columns), duration(m["duration_s"])) for m in maps]
    if maps:
        for line in table_lines((*columns, "took"), listing, right=(3, 4, 5, 6, 7, 8, 9)):
            say("  " + line)
    for m in maps:
        if m["stop_reason"]:
            say(f"  map {m['map']} ({m['table']}) stopped early: {m['stop_reason']}")
    if resume:
        say(f"resume it: {resume}")
    return 0
