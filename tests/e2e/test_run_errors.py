"""`pipelinerl run` with a wrong setting: one line `error: <setting>: <reason>` on stderr, exit
status 2, no run directory left behind. A missing dataset is found before any process starts (before,
all four services started and a 158-line traceback came 11 s later); a dataset the coordinator
refuses at StartRun reads the same way, once the services it started are stopped. A service that
exits while starting fails the start at once, not after the health timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelinerl.launcher.processes import start_service
from pipelinerl.launcher.run import HEALTH_TIMEOUT_S

PIPELINERL = Path(sys.executable).parent / "pipelinerl"


def pipelinerl_run(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PIPELINERL), "run", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_a_missing_dataset_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = pipelinerl_run("--dataset", "/nonexistent.jsonl", "--run-dir", str(run_dir), timeout_s=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["error: dataset: no such file: /nonexistent.jsonl"]
    assert elapsed < 15, elapsed  # no service was started (a service alone takes longer to be healthy)
    assert not run_dir.exists()

    debug = pipelinerl_run(
        "--dataset", "/nonexistent.jsonl", "--run-dir", str(run_dir), "--debug", timeout_s=60
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    assert not run_dir.exists()


async def test_a_service_that_exits_while_starting_fails_the_start_at_once(tmp_path: Path) -> None:
    service = start_service("reward", "pipelinerl.reward", {"wrokers": 1}, tmp_path)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reward exited with status \d+; its log ends:(.|\n)*wrokers"):
        await service.wait_healthy(HEALTH_TIMEOUT_S)
    assert time.monotonic() - started < HEALTH_TIMEOUT_S / 4


@pytest.mark.slow
def test_a_dataset_the_coordinator_refuses_is_one_line_after_the_services_stop(tmp_path: Path) -> None:
    dataset = tmp_path / "unanswered.jsonl"
    dataset.write_text('{"prompt": "1+1="}\n')  # no `answer`: only reading the file tells
    run_dir = tmp_path / "run"
    result = pipelinerl_run("--dataset", str(dataset), "--run-dir", str(run_dir), timeout_s=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"error: dataset: {dataset} lacks the field(s) answer"]
    assert not run_dir.exists()
    assert not _processes_naming(run_dir), "a service of the refused run is still running"


def _processes_naming(path: Path) -> list[int]:
    """Pids whose command line names `path` (each service's config file lies in the run directory)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids
