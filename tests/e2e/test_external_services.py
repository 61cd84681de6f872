"""`pipelinerl run --coordinator-address`: drive a run on services that are already up (as under
docker compose), starting no process, and still write metrics and the plot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess, start_service, stop_all
from pipelinerl.launcher.run import HEALTH_TIMEOUT_S, _service_settings, launch, merge

pytestmark = pytest.mark.slow

BUDGET = 1024


async def test_a_run_driven_on_running_services_meets_its_budget(tmp_path: Path) -> None:
    services_dir = tmp_path / "services"
    services_dir.mkdir()
    configs = _service_settings(RunSettings(run_dir=services_dir), services_dir, threads=1)
    processes: list[ServiceProcess] = []
    try:
        processes.append(start_service("reward", "pipelinerl.reward", configs["reward"], services_dir))
        trainer = start_service("trainer", "pipelinerl.trainer", configs["trainer"], services_dir)
        processes.append(trainer)
        await asyncio.gather(*(p.wait_healthy(HEALTH_TIMEOUT_S) for p in processes))
        inference = start_service(
            "inference-0", "pipelinerl.inference",
            merge(configs["inference"], {"trainer_address": trainer.address}), services_dir,
        )  # fmt: skip
        processes.append(inference)
        await inference.wait_healthy(HEALTH_TIMEOUT_S)
        addresses = {"inference_addresses": [inference.address], "reward_address": processes[0].address,
                     "trainer_address": trainer.address}  # fmt: skip
        coordinator = start_service(
            "coordinator", "pipelinerl.coordinator", merge(configs["coordinator"], addresses), services_dir
        )
        processes.append(coordinator)
        await coordinator.wait_healthy(HEALTH_TIMEOUT_S)

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
