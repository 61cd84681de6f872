"""An inference server that goes away, by crash or by drain, loses nothing: its attempts are
generated again elsewhere (or on it once it is back), and every attempt is trained exactly once."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path

import pytest

from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch
from tests.e2e.evidence import assert_trained_exactly_once

pytestmark = pytest.mark.slow

BUDGET = 6144
# A drain-restart cycle (drain, process start, health, reconnect, busy again) takes ~9 s on two
# cores, where the run trains ~1,000-1,400 samples/s: the budget (a minute or more) outlasts the
# three cycles with room.
DRAIN_BUDGET = 98304
DRAINS = 3


def assert_nothing_failed(run_dir: Path, run_id: str, budget: int) -> None:
    """Every attempt final, none failed, each trained one exactly once. Groups whose attempts were
    generated again may come back too stale for the lag policy: dropped, a recorded reason."""
    journal = Journal(run_dir / "journal.sqlite")
    try:
        counts = journal.counts(run_id)
    finally:
        journal.close()
    assert set(counts) <= {"acked:trained", "acked:dropped"}, counts
    assert counts.get("acked:trained", 0) >= budget * 0.9, counts
    assert_trained_exactly_once(run_dir, budget)


async def test_killed_inference_server_loses_no_sample(tmp_path: Path) -> None:
    settings = RunSettings(run_dir=tmp_path / "run", max_samples=BUDGET, inference_servers=2, duration_s=600)
    processes: list[ServiceProcess] = []
    killed: list[int] = []

    def kill_one_midway(run: RunInfo, elapsed_s: float) -> None:
        if not killed and run.progress.trained >= BUDGET // 4:
            victim = next(p for p in processes if p.name == "inference-1")
            victim.process.kill()  # SIGKILL: no drain, requests in flight die with it
            killed.append(run.progress.trained)

    result = await launch(settings, kill_one_midway, processes)

    assert killed, "the run ended before the server could be killed"
    assert result.state == "completed", result
    assert_nothing_failed(settings.run_dir, settings.run_id, BUDGET)
    journal = sqlite3.connect(settings.run_dir / "journal.sqlite")
    servers = dict(journal.execute("SELECT server, COUNT(*) FROM attempts GROUP BY server").fetchall())
    journal.close()
    survivor = next(p.address for p in processes if p.name == "inference-0")
    assert servers[survivor] > BUDGET // 2  # the survivor took over the rest of the run


async def test_inference_server_drained_and_restarted_again_and_again_fails_nothing(tmp_path: Path) -> None:
    """SIGTERM (a graceful drain) ends the server's Generate stream while the coordinator writes
    to it; each time the launcher starts it again, the run goes on and the server takes prompts
    again once it is back."""
    run_dir = tmp_path / "run"
    settings = RunSettings(run_dir=run_dir, max_samples=DRAIN_BUDGET, inference_servers=2, duration_s=300)
    processes: list[ServiceProcess] = []
    drained: list[int] = []  # the pid of each server drained, each while it was busy
    restarts: list[str] = []

    def drain_when_busy(run: RunInfo, elapsed_s: float) -> None:
        victim = next(p for p in processes if p.name == "inference-1")
        if len(drained) == DRAINS or victim.process.pid in drained or victim.process.poll() is not None:
            return  # drained already; the supervisor has not brought it back yet
        if any(s.address == victim.address and s.in_flight > 0 for s in run.progress.servers):
            victim.process.send_signal(signal.SIGTERM)  # by handle
            drained.append(victim.process.pid)

    result = await launch(settings, drain_when_busy, processes, lambda service, _: restarts.append(service))

    assert result.state == "completed", result
    # Each restarted server was given prompts again, and was drained busy with them.
    assert len(drained) == DRAINS, f"{len(drained)} drains: the restarted server got no prompts"
    assert restarts[: DRAINS - 1] == ["inference-1"] * (DRAINS - 1), restarts
    assert_nothing_failed(run_dir, settings.run_id, DRAIN_BUDGET)
