"""`pipelinerl run` supervises what it started: a service that dies or freezes is started again and
the run completes, every attempt trained exactly once; a service that keeps dying fails the run,
named; and Ctrl-C, SIGTERM or SIGHUP to a real launcher leave no process of its behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.report import read_evaluations
from pipelinerl.launcher.run import launch
from pipelinerl.launcher.supervisor import ServiceFailed
from tests.e2e.evidence import assert_trained_exactly_once

pytestmark = pytest.mark.slow

# A restart of the trainer or the coordinator takes a few seconds on two cores, where the run trains
# about 1,400 samples/s: the budget outlasts three faults in a row with room.
BUDGET = 40960
PIPELINERL = str(Path(sys.executable).parent / "pipelinerl")
QUICK = {"health_every_s": 0.5, "unhealthy_after_s": 3.0, "backoff_initial_s": 0.2}


class Faults:
    """trainer SIGKILLed ─► coordinator SIGKILLed ─► reward frozen (SIGSTOP) ─► evaluation server
    SIGKILLed, each once the previous one's service is back, as the run's progress shows."""

    def __init__(self, processes: list[ServiceProcess]) -> None:
        self.processes = processes
        self.done: list[str] = []
        self.restarted: list[str] = []
        self.frozen: int | None = None
        self.evaluation_killed_at: float | None = None

    def on_restart(self, service: str, restarts: int) -> None:
        self.restarted.append(service)

    def on_progress(self, run: RunInfo, elapsed_s: float) -> None:
        if len(self.done) > len(self.restarted) or run.progress.trained < 2048 * (len(self.done) + 1):
            return
        if len(self.done) == 0:
            self._signal("trainer", signal.SIGKILL)
        elif len(self.done) == 1 and all(p.process.poll() is None for p in self.processes):
            self._signal("coordinator", signal.SIGKILL)
        elif len(self.done) == 2 and all(p.process.poll() is None for p in self.processes):
            self.frozen = self._signal("reward", signal.SIGSTOP)
        elif len(self.done) == 3 and all(p.process.poll() is None for p in self.processes):
            self._signal("evaluation-0", signal.SIGKILL)
            self.evaluation_killed_at = elapsed_s

    def _signal(self, name: str, sig: signal.Signals) -> int:
        victim = next(p for p in self.processes if p.name == name)
        victim.process.send_signal(sig)  # by handle
        self.done.append(name)
        return victim.process.pid


async def test_services_killed_or_frozen_are_restarted_and_the_run_trains_everything_once(
    tmp_path: Path,
) -> None:
    settings = RunSettings(run_dir=tmp_path / "run", max_samples=BUDGET, duration_s=300, restart=QUICK)
    processes: list[ServiceProcess] = []
    faults = Faults(processes)
    try:
        result = await launch(settings, faults.on_progress, processes, faults.on_restart)
    finally:
        if faults.frozen is not None and _alive(faults.frozen):  # the supervisor did not kill it
            os.kill(faults.frozen, signal.SIGCONT)
    assert faults.done == ["trainer", "coordinator", "reward", "evaluation-0"], faults.done
    assert result.state == "completed", result
    assert result.restarts == {"trainer": 1, "coordinator": 1, "reward": 1, "evaluation-0": 1}, (
        result.restarts
    )
    why = (settings.run_dir / "launcher.log").read_text()
    assert "trainer killed by SIGKILL; restart 1" in why, why
    assert "coordinator killed by SIGKILL; restart 1" in why, why
    assert "evaluation-0 killed by SIGKILL; restart 1" in why, why
    # held-out evaluations went on after the evaluation server died (there, once it was back, or
    # on the training server meanwhile), each at one version, none twice
    evaluated = [e.evaluation["weight_version"] for e in read_evaluations(settings.run_dir / "metrics.jsonl")]
    assert evaluated == sorted(set(evaluated)), evaluated
    finished = [e.elapsed_s for e in read_evaluations(settings.run_dir / "metrics.jsonl")]
    assert faults.evaluation_killed_at is not None
    assert len([t for t in finished if t > faults.evaluation_killed_at]) >= 2, (
        faults.evaluation_killed_at,
        finished,
    )
    # A frozen peer's health check ends DEADLINE_EXCEEDED, or UNAVAILABLE once keepalive drops the link.
    frozen = r"reward answered no health check for 3s \(last: no answer, (DEADLINE_EXCEEDED|UNAVAILABLE)\)"
    frozen += "; killed"
    assert re.search(frozen, why), why
    dispositions = assert_trained_exactly_once(settings.run_dir, BUDGET)
    assert set(dispositions) <= {"trained", "dropped"}, dispositions
    assert dispositions["trained"] >= BUDGET * 0.9, dispositions


async def test_a_service_that_keeps_dying_fails_the_run_naming_it(tmp_path: Path) -> None:
    settings = RunSettings(
        run_dir=tmp_path / "run", max_samples=BUDGET, duration_s=120, restart=QUICK | {"max_restarts": 1}
    )
    processes: list[ServiceProcess] = []
    killed: list[int] = []

    def kill_reward(run: RunInfo, elapsed_s: float) -> None:
        reward = next(p for p in processes if p.name == "reward")
        if run.progress.trained > 0 and reward.process.pid not in killed and reward.process.poll() is None:
            reward.process.kill()  # by handle
            killed.append(reward.process.pid)

    started = time.monotonic()
    with pytest.raises(ServiceFailed) as failed:
        await launch(settings, kill_reward, processes)
    assert time.monotonic() - started < 90
    assert len(killed) == 2, killed
    message = str(failed.value)
    assert message.startswith("reward killed by SIGKILL, after 1 restarts within 600s; its log ends:")
    assert "serving" in message  # the end of its log
    assert all(p.process.poll() is not None for p in processes), "a service outlived the failed run"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda sig: sig.name)
def test_a_signal_to_the_launcher_stops_every_process_it_started(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [PIPELINERL, "run", "--run-dir", str(run_dir), "--duration-s", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():  # every service up, the run going
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        started = _descendants(launcher.pid)
        assert len(started) >= 4, started  # reward (and its worker), trainer, coordinator, inference
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + sig, err
    assert f"stopped by {sig.name} before the run ended" in err.decode(), err
    # The reward service's forkserver sees its parent gone on a pipe's EOF, a moment after it exits.
    deadline = time.monotonic() + 5
    while (alive := {pid: _command(pid) for pid in started if _alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"processes outlived the launcher: {alive}"


def _descendants(pid: int) -> set[int]:
    """Every process below `pid`, read from /proc."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found |= {int(child)} | _descendants(int(child))
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (exited, not yet reaped) is not alive."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
