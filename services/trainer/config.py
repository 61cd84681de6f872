"""Settings of the trainer (env `PIPELINERL_TRAINER_*`, `--flags`, or a YAML/TOML file)."""

from __future__ import annotations

import enum
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from pipelinerl.common.settings import ServiceSettings
from pipelinerl.trainer.deepspeed_learner import ZeroConfig
from pipelinerl.trainer.learner import LearnerConfig
from pipelinerl.weights.settings import PublisherSettings


class LagPolicy(enum.StrEnum):
    DROP = "drop"
    """A sample older than `max_lag` is discarded (acked DROPPED, counted)."""
    WAIT = "wait"
    """The trainer does not outrun generation: it holds its next step (version v → v + 1) until it
    has admitted a sample with a token of version ≥ v + 1 − max_lag, i.e. until the inference servers
    have caught up. The held step fills the buffer, so SubmitSamples stops reading (backpressure)
    until fresh data arrives. A sample that is still over `max_lag` (a sequence that outlived that
    many versions) is kept, as with `reweight`. Needs max_lag ≥ 1; with a full buffer the trainer
    steps anyway (logged), so a stalled generator cannot deadlock it."""
    REWEIGHT = "reweight"
    """A sample older than `max_lag` is trained on anyway; the loss's truncated importance weight
    bounds its influence."""


class TrainerSettings(ServiceSettings, PublisherSettings):
    """The trainer: admits scored samples, takes optimizer steps, publishes every version (the
    publisher's settings, from `PublisherSettings`, are the trainer's own)."""

    model_config = SettingsConfigDict(env_prefix="PIPELINERL_TRAINER_")

    port: int = Field(default=50052, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    run_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Names this training run; weight versions carry it so receivers never mix two runs."""
    model: str = "tiny"
    """A preset name (`tiny`) or a local HF model directory: the policy's initial weights (version 0)."""
    seed: int = 0
    """Seed of a preset's random initial weights (use the inference servers' seed)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training dtype of the weights."""
    device: str = "cpu"
    """`cpu` or `cuda[:N]`."""
    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads for training; unset keeps torch's default."""
    samples_per_step: int = Field(default=64, ge=1)
    """Samples (whole groups) per optimizer step; each step publishes a new weight version."""
    max_lag: int = Field(default=4, ge=0)
    """Largest lag, in versions, of a sample's oldest token at admission."""
    lag_policy: LagPolicy = LagPolicy.DROP
    """What happens to a sample over `max_lag`."""
    max_buffered_samples: int = Field(default=1024, ge=1)
    """Admitted samples waiting for a step; beyond this, SubmitSamples stops reading (backpressure)."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Optimizer, micro-batching, loss and advantages."""

    @model_validator(mode="after")
    def _wait_needs_lag(self) -> TrainerSettings:
        if self.lag_policy is LagPolicy.WAIT and self.max_lag < 1:
            raise ValueError(
                "lag_policy wait needs max_lag >= 1: version v + 1 cannot be generated before it exists"
            )
        return self

    backend: Literal["torch", "deepspeed"] = "torch"
    """`torch`: one process, AdamW. `deepspeed`: ZeRO over every rank of a torchrun world
    (`torchrun --nproc-per-node N -m pipelinerl.trainer --backend deepspeed`); rank 0 serves."""
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO stage and extra DeepSpeed config (`--backend deepspeed`)."""
    checkpoint_dir: Path | None = None
    """Where checkpoints go (`<dir>/latest`); the trainer resumes from it at start. Unset: no checkpoints."""
    checkpoint_every: int = Field(default=50, ge=1)
    """Save a checkpoint every this many versions."""
    metrics_file: Path | None = None
    """Append one JSON line of metrics per optimizer step here."""
