"""The trainer's experiment tracking: step metrics written to TensorBoard and to an offline W&B
run, read back with each library's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelinerl.trainer.config import TrackingConfig
from pipelinerl.trainer.tracking import StepLogs
from tests.tracking import tensorboard_series, wandb_series


def test_every_step_reaches_tensorboard_and_an_offline_wandb_run(tmp_path: Path) -> None:
    config = TrackingConfig(dir=tmp_path, tensorboard=True, wandb="offline")
    logs = StepLogs.open(config, "run-1", {"model": "tiny"})
    for version in (1, 2, 3):
        line = {"version": version, "stepped": True, "reward_mean": version / 10, "ess": 0.9,
                "kl": None, "lag_histogram": {"0": 3, str(version): 1}}  # fmt: skip
        logs.log(version, line)
    logs.close()

    for series in (tensorboard_series(tmp_path / "tensorboard"), wandb_series(tmp_path / "wandb")):
        assert [step for step, _ in series["reward_mean"]] == [1, 2, 3]
        assert [value for _, value in series["reward_mean"]] == pytest.approx([0.1, 0.2, 0.3])
        assert [value for _, value in series["ess"]] == pytest.approx([0.9] * 3)
        assert [value for _, value in series["lag_mean"]] == pytest.approx([0.25, 0.5, 0.75])
        assert [value for _, value in series["lag_max"]] == [1, 2, 3]
        assert "kl" not in series and "version" not in series  # no value, and the step itself


def test_tracking_is_off_by_default(tmp_path: Path) -> None:
    logs = StepLogs.open(TrackingConfig(dir=tmp_path), "run-1", {})
    logs.log(1, {"reward_mean": 0.5})
    logs.close()
    assert list(tmp_path.iterdir()) == []
