"""`pipelinerl run --coordinator-address`: drive a run on services that are already up (as under
docker compose), starting no process, and still write metrics and the plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess, stop_all
from pipelinerl.launcher.run import launch, start_services

pytestmark = pytest.mark.slow

BUDGET = 1024


async def test_a_run_driven_on_running_services_meets_its_budget(tmp_path: Path) -> None:
    processes: list[ServiceProcess] = []
    try:
        coordinator = await start_services(RunSettings(run_dir=tmp_path / "services"), processes)
        driver = RunSettings(
            run_dir=tmp_path / "driver", max_samples=BUDGET, duration_s=120,
            coordinator_address=coordinator.address,
        )  # fmt: skip
        result = await launch(driver)
    finally:
        await stop_all(processes)
    assert result.state == "completed" and result.trained == BUDGET
    assert result.metrics_path.exists() and result.plot_path.exists()
    assert not (tmp_path / "driver" / "cpu_seconds.json").exists()  # it started nothing
