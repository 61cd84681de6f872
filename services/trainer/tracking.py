"""Experiment tracking: every optimizer step's metrics to TensorBoard and Weights & Biases.

Chosen by `TrackingConfig` (both off by default). Each backend is imported only when chosen, from
its extra: `pipelinerl[tensorboard]`, `pipelinerl[wandb]`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from pipelinerl.trainer.config import TrackingConfig


class StepLog(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLog:
    """Scalars in event files under `<dir>/tensorboard`, one per step and name."""

    def __init__(self, config: TrackingConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(config.dir / "tensorboard"), flush_secs=10)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbLog:
    """A W&B run named after the trainer's run id, its folder under `<dir>/wandb`."""

    def __init__(
        self,
        config: TrackingConfig,
        mode: Literal["online", "offline"],
        run_id: str,
        run_config: Mapping[str, Any],
    ) -> None:
        import wandb

        config.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=config.wandb_project,
            name=run_id,
            mode=mode,
            dir=config.dir,
            config=dict(run_config),
            settings=wandb.Settings(console="off", silent=True),  # the service's stderr is its log
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class StepLogs:
    """Every chosen backend; none when tracking is off."""

    def __init__(self, logs: Sequence[StepLog] = ()) -> None:
        self._logs = list(logs)

    @classmethod
    def open(cls, config: TrackingConfig, run_id: str, run_config: Mapping[str, Any]) -> StepLogs:
        logs: list[StepLog] = []
        if config.tensorboard:
            logs.append(TensorBoardLog(config))
        if config.wandb != "off":
            logs.append(WandbLog(config, config.wandb, run_id, run_config))
        return cls(logs)

    def log(self, step: int, line: Mapping[str, Any]) -> None:
        """Log a step's metrics line (the trainer's `metrics_file` line) at `step`."""
        if self._logs:
            values = step_values(line)
            for log in self._logs:
                log.log(step, values)

    def close(self) -> None:
        for log in self._logs:
            log.close()


def step_values(line: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a step's metrics line, with its lag histogram as the mean and largest lag of
    the step's tokens (`lag_mean`, `lag_max`)."""
    values = {
        name: float(value)
        for name, value in line.items()
        if isinstance(value, int | float) and name != "version"
    }
    lags = {int(lag): n for lag, n in line.get("lag_histogram", {}).items()}
    tokens = sum(lags.values())
    if tokens:
        values["lag_mean"] = sum(lag * n for lag, n in lags.items()) / tokens
        values["lag_max"] = float(max(lags))
    return values
