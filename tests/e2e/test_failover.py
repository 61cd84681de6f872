"""A killed inference server loses nothing: its attempts are generated again elsewhere, and every
attempt is trained exactly once."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch

pytestmark = pytest.mark.slow

BUDGET = 6144


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
    assert result.state == "completed" and result.trained == BUDGET
    journal = sqlite3.connect(tmp_path / "run" / "journal.sqlite")
    states = journal.execute("SELECT state, disposition, COUNT(*) FROM attempts GROUP BY 1, 2").fetchall()
    assert states == [("acked", "trained", BUDGET)]
    servers = dict(journal.execute("SELECT server, COUNT(*) FROM attempts GROUP BY server").fetchall())
    survivor = next(p.address for p in processes if p.name == "inference-0")
    assert servers[survivor] > BUDGET // 2  # the survivor took over the rest of the run
