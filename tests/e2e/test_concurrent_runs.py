"""Two runs started at the same moment on one machine both complete. Every service's ports are the
kernel's choice, bound by its launcher (with SO_REUSEPORT, which the service shares) before the
service starts and held until it stops, so no two services can be handed the same port; before,
the launcher picked free ports and released them for the services to bind later, and two runs
started together could collide (`Address already in use`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch
from tests.e2e.evidence import assert_trained_exactly_once

pytestmark = pytest.mark.slow

BUDGET = 32


async def test_two_runs_started_at_once_both_complete_on_ports_their_services_chose(tmp_path: Path) -> None:
    runs = [
        RunSettings(
            run_dir=tmp_path / name, max_samples=BUDGET, samples_per_step=8, group_size=4, duration_s=180,
            pin_cores=False,
        )
        for name in ("a", "b")
    ]  # fmt: skip
    processes: list[list[ServiceProcess]] = [[], []]
    results = await asyncio.gather(*(launch(s, processes=p) for s, p in zip(runs, processes, strict=True)))
    for settings, result in zip(runs, results, strict=True):
        assert result.state == "completed" and result.trained == BUDGET, result
        assert assert_trained_exactly_once(settings.run_dir, BUDGET) == {"trained": BUDGET}
    ports = [port for run in processes for p in run for port in (p.port, p.metrics_port)]
    assert all(port and port > 0 for port in ports) and len(set(ports)) == len(ports), ports
    for settings, run in zip(runs, processes, strict=True):
        for service in run:
            config = yaml.safe_load((settings.run_dir / f"{service.name}.yaml").read_text())
            assert (config["port"], config["metrics_port"]) == (service.port, service.metrics_port), config
            address, metrics = service.ready_file.read_text().splitlines()
            assert address == service.address and metrics == f"metrics 127.0.0.1:{service.metrics_port}"
