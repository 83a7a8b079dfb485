"""What `runplane run` says about what the play returned: a line, a JSON document, and the one
error of a map that stopped early."""

from __future__ import annotations

from runplane.actors import MapResult, Run
from runplane.engine.canonical import JsonObject, JsonValue

from .operators import RunNotice, StoppedEarly

RESULT_FIELDS = ("admitted", "cached", "completed", "failed", "blocked", "fenced", "skipped",
                 "executed", "retried", "timed_out", "superseded", "superseded_by",
                 "stopped_early", "stop_reason")


def describe_result(result: object) -> str:
    if isinstance(result, MapResult):
        return (f"admitted {result.admitted}, cached {result.cached}, completed {result.completed}, "
                f"failed {result.failed}, blocked {result.blocked}, fenced {result.fenced}")
    return repr(result)


def run_document(run: Run, notice: RunNotice, result: object, failed: int | None) -> JsonObject:
    """`run --json`: the run and what its play returned (a MapResult's counts)."""
    returned: JsonValue = None if result is None else repr(result)
    if isinstance(result, MapResult):
        returned = {name: getattr(result, name) for name in RESULT_FIELDS}
    return {"run_id": run.run_id, "play": run.play, "epoch": run.epoch, "status": "finished",
            "result": returned, "failed_rows": failed, "resume_command": notice.resume_command}


def stopped_early(run: Run) -> StoppedEarly:
    """The one error of a run whose maps stopped early: each map's reason, and the way out."""
    return StoppedEarly("; ".join(
        f"map {table} stopped early: {result.stop_reason}"
        for table, result in run.stopped_early_maps)
        + ". Fix the function and run again (run.map(..., fail_fast=False) runs every row "
        "whatever fails)")
