"""A real Prometheus server (Debian's `prometheus`, 2.42) scraping a live `pipelinerl run` through the
targets file the run writes: every service is `up`, the trainer's version and trained samples rise
as Prometheus sees them, `deploy/prometheus.yml` passes `promtool check config`, and every query of
the Grafana dashboard parses and names only metrics the scrape returned.

`make prometheus-test` runs it (and installs `prometheus` when missing); `make test` leaves it out.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pipelinerl.json"
ROLES = {"coordinator", "inference", "trainer", "reward", "environment"}
LISTENING = re.compile(r'msg="Listening on" address=(\S+)')
METRIC = re.compile(r"\bpipelinerl_\w+")
# Grafana's variable; Prometheus itself knows no `$__rate_interval`.
GRAFANA_VARIABLES = {"$__rate_interval": "30s"}

T = TypeVar("T")

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus (make prometheus-test)"),
]


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, *alive: subprocess.Popen) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in alive:
            assert process.poll() is None, f"{process.args} exited {process.returncode} before {what}"
        found = probe()
        if found is not None:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout_s} s")


def stop(process: subprocess.Popen, timeout_s: float = 60) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Prometheus:
    """The HTTP API of a Prometheus server."""

    def __init__(self, address: str) -> None:
        self.base = f"http://{address}/api/v1"

    def get(self, path: str, **params: str) -> dict[str, Any]:
        url = f"{self.base}/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:  # a bad query is a 400 with a JSON body
            return json.load(error)

    def vector(self, expr: str) -> list[dict[str, Any]]:
        answer = self.get("query", query=expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.vector(expr)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[Path]:
    """An environment run (all five roles), long enough to be watched; stopped by its handle."""
    run_dir = tmp_path / "run"
    command = [str(Path(sys.executable).parent / "pipelinerl"), "run", "--environment", "guess_number"]
    command += ["--run-dir", str(run_dir), "--duration-s", "150", "--log-level", "warning"]
    log = (tmp_path / "run.log").open("wb")
    run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        targets = run_dir / "prometheus_targets.json"
        wait_for("targets file", lambda: targets if targets.exists() else None, 90, run)
        yield targets
        assert run.poll() is None, f"the run ended early: {(tmp_path / 'run.log').read_text()[-3000:]}"
    finally:
        stop(run)
        log.close()


@pytest.fixture
def prometheus(live_run: Path, tmp_path: Path) -> Iterator[Prometheus]:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "pipelinerl",
                        "file_sd_configs": [{"files": [str(live_run)], "refresh_interval": "1s"}],
                    }
                ],
            }
        )
    )
    log_path = tmp_path / "prometheus.log"
    log = log_path.open("wb")
    command = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}"]
    command += ["--web.listen-address=127.0.0.1:0", "--storage.tsdb.retention.time=1h"]
    server = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def address() -> str | None:
            match = LISTENING.search(log_path.read_text())
            return match.group(1) if match else None

        api = Prometheus(wait_for("Prometheus listening", address, 30, server))
        wait_for("Prometheus ready", lambda: api.get("status/buildinfo").get("data"), 30, server)
        yield api
    finally:
        stop(server)
        log.close()


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    for variable, value in GRAFANA_VARIABLES.items():
        exprs = [expr.replace(variable, value) for expr in exprs]
    assert exprs and not any("$" in expr for expr in exprs), "a Grafana variable this test does not fill"
    return exprs


def test_the_scrape_config_of_compose_is_valid() -> None:
    check = subprocess.run(
        ["promtool", "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_prometheus_watches_a_run(prometheus: Prometheus) -> None:
    def every_role_up() -> set[str] | None:
        up = {sample["metric"]["job"] for sample in prometheus.vector("up == 1")}
        return up if up >= ROLES else None

    wait_for("every service up", every_role_up, 60)
    down = prometheus.vector("up == 0")
    assert not down, f"targets down: {[s['metric'] for s in down]}"

    progress = {
        "version": "max(pipelinerl_trainer_version)",
        "trained": 'sum(pipelinerl_trainer_samples_total{disposition="trained"})',
    }
    first = {name: wait_for(name, lambda e=expr: prometheus.scalar(e), 30) for name, expr in progress.items()}

    def risen() -> dict[str, float] | None:
        now = {name: prometheus.scalar(expr) or 0.0 for name, expr in progress.items()}
        return now if all(now[name] > first[name] for name in progress) else None

    wait_for(f"a rise of the trainer's version and trained samples past {first}", risen, 90)

    queries = dashboard_queries()
    for expr in queries:  # each parses and evaluates
        prometheus.vector(expr)
    named = {name for expr in queries for name in METRIC.findall(expr)}

    def all_scraped() -> set[str] | None:
        scraped = set(prometheus.get("label/__name__/values")["data"])
        return scraped if named <= scraped else None

    try:
        wait_for("every metric the dashboard names", all_scraped, 30)
    except AssertionError:
        scraped = set(prometheus.get("label/__name__/values")["data"])
        raise AssertionError(
            f"the dashboard names metrics no service exported: {sorted(named - scraped)}"
        ) from None
