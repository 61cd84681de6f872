"""A service SIGKILLed mid-run and started again by the launcher's supervisor costs the run nothing:
it completes its budget, and every attempt is trained exactly once into the final weights (see
evidence.py).

The trainer is the hard case: it dies several steps after its last checkpoint, so the steps since
are lost with it while the inference servers hold their newer weights and the journal holds their
acks. Its restart also finds what a crash mid-checkpoint leaves behind.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from pipelinerl.common.errors import PipelineError
from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch
from pipelinerl.trainer.client import TrainerClient
from tests.e2e.evidence import assert_trained_exactly_once

pytestmark = pytest.mark.slow

BUDGET = 2048  # 16 trainer steps of 128
CHECKPOINT_EVERY = 4
WATCH_S = 0.02
"""How often the trainer's version is read for its kill: steps take about 0.15 s, and the progress
reports (one a second) can miss the two steps after a checkpoint."""
KILLS = 3
LOST_STEPS = 6
"""Steps past its last checkpoint (every 8 steps) at which the trainer is killed, lost with it and
retrained."""
KILL_EVERY = 16
"""Versions from one kill to the next: the replay after a kill takes about 9 (the lost steps, the
window of samples that waited, the version the restart skips), then steps on fresh samples."""


def resumed_at(run_dir: Path) -> tuple[int, int]:
    """The version and durable version the restarted trainer resumed at, from its own log line:
    asked afterwards, it may already have trained and checkpointed past them."""
    line = [line for line in (run_dir / "trainer.log").read_text().splitlines() if "] resumed " in line][-1]
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    return int(fields["version"]), int(fields["durable_version"])


def fake_crash_mid_checkpoint(checkpoints: Path) -> None:
    """What a crash while writing the next checkpoint leaves: a partial folder and a new link."""
    (checkpoints / "v99999999.partial").mkdir()
    (checkpoints / "latest.link").symlink_to("v99999999.partial")


async def run_with_a_kill(tmp_path: Path, name: str, when: str, budget: int = BUDGET) -> tuple[Path, int]:
    """Run to the budget, SIGKILLing `name` once `when` holds; the launcher starts it again. Returns
    the run folder and the trainer version at the kill."""
    settings = RunSettings(
        run_dir=tmp_path / "run", max_samples=budget, inference_servers=2, duration_s=300,
        trainer={"checkpoint_every": CHECKPOINT_EVERY},
    )  # fmt: skip
    processes: list[ServiceProcess] = []
    killed: list[int] = []
    restarts: list[str] = []

    def kill(version: int) -> None:
        if not killed:
            victim = next(p for p in processes if p.name == name)
            victim.process.kill()  # SIGKILL, by handle: no drain, nothing flushed
            victim.process.wait()
            if name == "trainer":  # before the supervisor's next look at it
                fake_crash_mid_checkpoint(settings.run_dir / "checkpoints")
            killed.append(version)

    def kill_midway(run: RunInfo, elapsed_s: float) -> None:
        if run.progress.trained >= budget // 8:
            kill(run.progress.trainer_version)

    async def kill_after_lost_steps() -> None:
        """Two or three steps past a checkpoint, read from the trainer every WATCH_S."""
        while not any(p.name == "trainer" and p.port for p in processes):
            await asyncio.sleep(WATCH_S)
        trainer = next(p for p in processes if p.name == "trainer")
        async with TrainerClient(trainer.address) as client:
            while not killed:
                version = (await client.status()).version.version
                if version >= CHECKPOINT_EVERY + 2 and version % CHECKPOINT_EVERY >= 2:
                    kill(version)
                await asyncio.sleep(WATCH_S)

    watcher = asyncio.create_task(kill_after_lost_steps()) if when == "lost steps" else None
    try:
        on_progress = kill_midway if when == "midway" else None
        result = await launch(settings, on_progress, processes, lambda service, _: restarts.append(service))
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    assert killed, "the run ended before the kill"
    assert restarts == [name] and result.restarts == {name: 1}, (restarts, result.restarts)
    assert result.state == "completed", result
    return settings.run_dir, killed[0]


async def test_a_trainer_killed_steps_after_its_checkpoint_trains_everything_once(tmp_path: Path) -> None:
    run_dir, version_at_kill = await run_with_a_kill(tmp_path, "trainer", "lost steps")
    version, durable = resumed_at(run_dir)  # durable: the checkpoint it resumed from
    assert durable % CHECKPOINT_EVERY == 0 and durable < version_at_kill
    # Newer than anything it published before, so the inference servers take the resumed weights.
    assert version > version_at_kill
    lost = range(durable + 1, version)
    # Lag counts steps, not the versions the crash skipped: the resent samples are not stale, and
    # nothing was generated on weights the restarted trainer left behind (test below).
    assert assert_trained_exactly_once(run_dir, BUDGET, lost) == {"trained": BUDGET}


async def test_a_trainer_killed_again_and_again_under_the_default_lag_policy_drops_nothing(
    tmp_path: Path,
) -> None:
    """Each restarted trainer retrains the LOST_STEPS steps it lost and the window of samples that
    waited for it back to back, more versions than max_lag 4, in under a second. Samples
    generated meanwhile, or afterwards by a server still on the old weights, would be dropped as
    stale: the inference pool sends no prompt until the replay is over and the server holds the
    restarted trainer's weights (coordinator/lag_gate.py)."""
    settings = RunSettings(
        run_dir=tmp_path / "run", max_samples=2 * BUDGET, inference_servers=2, duration_s=300,
        trainer={"checkpoint_every": 8},
    )  # fmt: skip
    processes: list[ServiceProcess] = []
    kills: list[int] = []

    async def kill_again_and_again() -> None:
        """At LOST_STEPS or more steps past a checkpoint, KILL_EVERY versions after the last kill,
        read from the trainer every WATCH_S."""
        while not any(p.name == "trainer" and p.port for p in processes):
            await asyncio.sleep(WATCH_S)
        async with TrainerClient(next(p for p in processes if p.name == "trainer").address) as client:
            while len(kills) < KILLS:
                await asyncio.sleep(WATCH_S)
                try:
                    status = await client.status(timeout_s=1.0)
                except PipelineError:  # not serving again yet
                    continue
                version = status.version.version
                after = kills[-1] + KILL_EVERY if kills else 0
                if version >= after and version - status.durable_version >= LOST_STEPS:
                    trainer = next(p for p in processes if p.name == "trainer")
                    trainer.process.kill()  # SIGKILL, by handle; the launcher starts it again
                    trainer.process.wait()
                    kills.append(version)

    killer = asyncio.create_task(kill_again_and_again())
    try:
        result = await launch(settings, None, processes)
    finally:
        if not killer.done():
            killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
    if not killer.cancelled():
        killer.result()  # what stopped it, if anything did
    assert len(kills) == KILLS, f"the run ended after the kills at versions {kills}"
    assert result.state == "completed" and result.restarts == {"trainer": KILLS}, result
    assert assert_trained_exactly_once(settings.run_dir, 2 * BUDGET) == {"trained": 2 * BUDGET}, kills


# An inference server takes longer to start than the others; a bigger budget outlasts its restart.
@pytest.mark.parametrize(("name", "budget"), [("reward", 4 * BUDGET), ("inference-1", 12 * BUDGET)])
async def test_a_service_killed_and_restarted_mid_run_loses_nothing(
    tmp_path: Path, name: str, budget: int
) -> None:
    run_dir, _ = await run_with_a_kill(tmp_path, name, "midway", budget)
    dispositions = assert_trained_exactly_once(run_dir, budget)
    # Groups that waited out the restart may come back too stale for the lag policy: dropped, a
    # recorded reason. Nothing fails.
    assert set(dispositions) <= {"trained", "dropped"}, dispositions
    assert dispositions["trained"] >= budget * 0.8, dispositions
