"""`runplane demo --retries N --rate PER_SECOND`, and two overlapping demos."""

from __future__ import annotations

import re
import time

import trio

from runplane.cli.main import main
from runplane.engine import PlayScope, open_tenant, sheets
from runplane.engine.errors import EngineError

from .cli_helpers import cli_env, schema, start_cli  # noqa: F401  (fixture)


def demo_counts(out: str) -> dict[str, int | str]:
    match = re.search(r"demo: run (\S+) admitted (\d+) cached (\d+) executed (\d+) "
                      r"completed (\d+) failed (\d+)", out)
    assert match, out
    names = ("run_id", "admitted", "cached", "executed", "completed", "failed")
    return {name: value if name == "run_id" else int(value)
            for name, value in zip(names, match.groups())}


def test_retries_turn_transient_tool_failures_into_completions(schema, capsys):
    """At a 30% failure rate, 300 rows fail ~90 times without retries; with 6 retries a row
    fails only if all 7 calls do (p = 0.0002)."""
    assert main(["demo", "--rows", "300", "--schema", schema, "--fail-rate", "0.3",
                 "--latency-ms", "0", "--retries", "6", "--rate", "5000"]) == 0
    out = capsys.readouterr().out
    counts = demo_counts(out)
    assert counts["executed"] == 300 and counts["failed"] <= 3
    retried = int(re.search(r"demo: (\d+) retried tool calls", out).group(1))
    assert retried >= 30
    assert re.search(r"retries, [\d,]+ calls/s", out)


def test_bad_policy_options_are_refused(schema, capsys):
    for option in (["--retries", "-1"], ["--retries", "x"], ["--rate", "0"], ["--rate", "inf"]):
        try:
            code = main(["demo", "--rows", "5", "--schema", schema, *option])
        except SystemExit as exc:
            code = exc.code
        assert code == 2, option
    capsys.readouterr()


def test_an_older_demo_stops_when_a_newer_one_overlaps_and_names_it(schema, dsn, tmp_path,
                                                                      capsys):
    log = tmp_path / "older.log"
    older = start_cli("demo", "--rows", "6000", "--latency-ms", "20", "--concurrency", "8",
                      "--fail-rate", "0", "--schema", schema, stdout_path=log, env=cli_env())
    try:
        async def wait_for_progress() -> None:
            async with open_tenant("local", dsn, schema=schema) as tenant:
                while True:
                    try:
                        summary = await sheets.summary(tenant, PlayScope("local", "demo"),
                                                       "companies")
                        if summary.completed >= 100:
                            return
                    except EngineError:  # the older demo has not created its schema yet
                        pass
                    assert older.poll() is None, log.read_text()
                    await trio.sleep(0.1)

        trio.run(wait_for_progress)
        assert main(["demo", "--rows", "6000", "--latency-ms", "0", "--fail-rate", "0",
                     "--schema", schema]) == 0
        newer = demo_counts(capsys.readouterr().out)
        deadline = time.monotonic() + 120
        while older.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert older.returncode == 0, older.stderr.read()
    finally:
        if older.poll() is None:
            older.kill()
    out = log.read_text()
    assert f"was superseded by run {newer['run_id']}: it stopped early" in out, out
    first = demo_counts(out)
    assert first["executed"] < 6000  # stopped early
    assert newer["cached"] + newer["executed"] == 6000
