"""Two reward replicas share a run's scoring; one is SIGKILLed mid-run: the run completes its budget
on the other, and every attempt is trained exactly once (a batch the dead replica held is scored
again elsewhere, its first scoring never read)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch
from tests.e2e.test_failover import assert_nothing_failed

pytestmark = pytest.mark.slow

BUDGET = 6144


def scored_ids(log: Path) -> list[str]:
    """The attempts a reward replica's log says it scored (not the run's held-out evaluations,
    whose completions it scores too: ids `<run>-e<set>-v<version>...`)."""
    scored = re.findall(r"item scored\s.*?sample_id=(\S+)", log.read_text())
    return [sample_id for sample_id in scored if re.fullmatch(r".+-p\d+-a\d+", sample_id)]


async def test_a_killed_reward_replica_loses_no_sample_and_scores_none_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    settings = RunSettings(  # debug: each replica logs the items it scores
        run_dir=run_dir, max_samples=BUDGET, reward_servers=2, duration_s=300, log_level="debug"
    )
    processes: list[ServiceProcess] = []
    killed: list[int] = []

    def kill_one_midway(run: RunInfo, elapsed_s: float) -> None:
        if not killed and run.progress.trained >= BUDGET // 4:
            victim = next(p for p in processes if p.name == "reward-1")
            victim.process.kill()  # SIGKILL, by handle: its Score calls in flight die with it
            killed.append(run.progress.trained)

    result = await launch(settings, kill_one_midway, processes)

    assert killed, "the run ended before the replica could be killed"
    assert result.state == "completed", result
    assert_nothing_failed(run_dir, settings.run_id, BUDGET)
    before, survivor = scored_ids(run_dir / "reward-1.log"), scored_ids(run_dir / "reward-0.log")
    # Both took calls (least loaded: about half each) until one died; the other scored the rest.
    assert len(before) > killed[0] // 4, (len(before), killed)
    assert len(survivor) >= BUDGET - len(before)
    assert set(before) | set(survivor) == {f"{settings.run_id}-p{i // 8}-a{i % 8}" for i in range(BUDGET)}
    victim = next(p for p in processes if p.name == "reward-1")
    coordinator_log = (run_dir / "coordinator.log").read_text().splitlines()
    down = [line for line in coordinator_log if "reward replica down" in line]
    assert any(f"replica={victim.address}" in line for line in down), down
