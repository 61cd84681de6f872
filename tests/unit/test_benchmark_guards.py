"""`benchmarks/pipeline_vs_sync.py` never prints figures of a run it did not make: a folder that holds
a run is refused before anything starts, and a resumed or failed run is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.pipeline_vs_sync import NoFigures, check_run
from pipelinerl.launcher.report import Point
from pipelinerl.launcher.run import RunResult

ROOT = Path(__file__).resolve().parents[2]


def result(state: str = "completed", elapsed_s: float = 60.0, trained: int = 256) -> RunResult:
    return RunResult(
        mode="pipeline", elapsed_s=elapsed_s, trained=trained, samples_per_s=trained / max(elapsed_s, 1e-9),
        final_reward=0.5, final_correct=0.4, mean_lag=1.0, time_to_target_s=None, state=state,
        metrics_path=Path("metrics.jsonl"), plot_path=Path("plot.png"), restarts={},
    )  # fmt: skip


def points(*trained: int) -> list[Point]:
    return [Point(float(i), t, 0.5, 0.0, 0.0, 0.0, 0, (), 0.0, 0.0) for i, t in enumerate(trained)]


def test_a_folder_holding_a_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "coordinator.sqlite").write_bytes(b"")
    done = subprocess.run(
        [sys.executable, "benchmarks/pipeline_vs_sync.py", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "holds an earlier run" in done.stderr
    assert "{" not in done.stdout  # no JSON line of figures


def test_a_fresh_completed_run_passes() -> None:
    check_run(result(), points(0, 64, 128, 256), samples=256)


@pytest.mark.parametrize(
    ("run", "progress", "why"),
    [
        (result(state="failed"), points(0, 64), "ended failed"),
        (result(elapsed_s=0.0), points(256, 256), "no progress of its own"),  # resumed, already done
        (result(elapsed_s=0.0), points(0, 128, 256), "took 0.0 s"),
        (result(trained=0), points(0, 0), "no progress of its own"),
    ],
)
def test_a_resumed_failed_or_empty_run_gives_no_figures(run: RunResult, progress: list, why: str) -> None:
    with pytest.raises(NoFigures, match=why):
        check_run(run, progress, samples=256)
