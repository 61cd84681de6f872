"""Settings of the reward service (env `PIPELINERL_REWARD_*`, `--flags`, or a YAML/TOML file)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from pipelinerl.common.settings import ServiceSettings
from pipelinerl.reward.verifiers import RewardSpec


class RewardSettings(ServiceSettings):
    """The reward service: verifiers in a process pool with a per-sample timeout."""

    model_config = SettingsConfigDict(env_prefix="PIPELINERL_REWARD_")

    port: int = Field(default=50053, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    workers: int = Field(default=2, ge=1)
    """Verifier worker processes."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Per-sample time limit; a verifier past it gives its sample DEADLINE_EXCEEDED."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """How verifier scores combine into the reward (weights, tolerances, format pattern, python function)."""
