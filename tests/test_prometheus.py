"""A real Prometheus (Debian's `prometheus`) scrapes a gateway and a run through it, each on its
own `--metrics-bind`; a PromQL query over Prometheus' HTTP API returns the run's completed count
as `runplane runs --json` gives it (SPEC §31).

Without the binary the test skips with one line saying how to install it; under `CI=true` it
fails (like the pooler and browser tests)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from .cli_helpers import RUNPLANE, ROOT, cli_env, run_cli, schema, wait_for_text, write_play  # noqa: F401

pytestmark = pytest.mark.prometheus

INSTALL = "prometheus is not installed (apt-get install prometheus)"
QUERY_TIMEOUT_S = 90.0


def prometheus_or_skip() -> str:
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(INSTALL)
        pytest.skip(INSTALL)
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics_target(err: Path, proc: subprocess.Popen) -> str:
    """host:port of the `runplane: metrics at URL` line a command printed on stderr."""
    line = wait_for_text(err, "runplane: metrics at ", proc)
    url = line.split("runplane: metrics at ", 1)[1].split()[0]
    return url.removeprefix("http://").removesuffix("/metrics")


def _start(args: list[str], tmp_path: Path, name: str, env: dict[str, str]):
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([*RUNPLANE, *args], stdout=stdout, stderr=stderr, text=True,
                                env=env, cwd=ROOT)
    return proc, out, err


def _config(path: Path, targets: dict[str, str]) -> Path:
    jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
                   for job, target in targets.items())
    path.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    f"scrape_configs:\n{jobs}")
    return path


def _query_until(api: str, query: str, want: float) -> float:
    """Poll Prometheus' `/api/v1/query` until `query` returns `want` (or the timeout)."""
    deadline, value = time.monotonic() + QUERY_TIMEOUT_S, None
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(f"{api}/api/v1/query", params={"query": query}, timeout=10).json()
        except httpx.HTTPError:
            answer = {}
        result = answer.get("data", {}).get("result", [])
        if result:
            value = float(result[0]["value"][1])
            if value == want:
                return value
        time.sleep(0.5)
    raise AssertionError(f"{query} never returned {want} (last: {value})")


def test_prometheus_scrapes_a_gateway_and_a_run(tmp_path, schema):
    binary = prometheus_or_skip()
    env = cli_env(RUNPLANE_SCHEMA=schema)
    names = [f"n{i}" for i in range(60)] + ["bad1", "bad2"]
    play, rows = write_play(tmp_path, names)
    procs: list[subprocess.Popen] = []
    try:
        gateway, gateway_out, gateway_err = _start(
            ["serve", "--dev", "--bind", "127.0.0.1:0", "--metrics-bind", "127.0.0.1:0"],
            tmp_path, "gateway", env)
        procs.append(gateway)
        listening = wait_for_text(gateway_out, "dev token for org local: ", gateway)
        url = listening.split("gateway listening on ", 1)[1].split()[0]
        token = listening.split("dev token for org local: ", 1)[1].split()[0]
        run, run_out, run_err = _start(
            ["run", str(play), "--input", str(rows), "--gateway", url,
             "--metrics-bind", "127.0.0.1:0"],
            tmp_path, "run", {**env, "RUNPLANE_TOKEN": token, "PLAY_HOLD": "1"})
        procs.append(run)
        wait_for_text(run_out, "held", run)
        targets = {"gateway": _metrics_target(gateway_err, gateway),
                   "run": _metrics_target(run_err, run)}
        port = _free_port()
        prometheus = subprocess.Popen(
            [binary, f"--config.file={_config(tmp_path / 'prometheus.yml', targets)}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
        procs.append(prometheus)
        api = f"http://127.0.0.1:{port}"
        listed = run_cli("runs", "ops", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        (entry,) = json.loads(listed.stdout)["runs"]
        assert entry["completed"] == 60
        assert _query_until(api, 'sum(runplane_rows_total{job="run",play="ops",'
                            'outcome="completed"})', entry["completed"]) == 60
        assert _query_until(api, 'sum(runplane_rows_total{job="run",outcome="failed"})',
                            entry["failed"]) == 2
        assert _query_until(api, 'count(runplane_gateway_requests_total{job="gateway",'
                            'action="sheets.complete",code="200"} > 0)', 1) == 1
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
