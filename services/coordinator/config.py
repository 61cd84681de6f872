"""Settings of the coordinator (env `PIPELINERL_COORDINATOR_*`, `--flags`, or a YAML/TOML file)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from pipelinerl.common.settings import ServiceSettings


def default_journal_path() -> Path:
    """`$XDG_STATE_HOME/pipelinerl/coordinator.sqlite` (`~/.local/state/...` when unset): state that
    outlives the process, in the place the XDG base-directory convention keeps it."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "pipelinerl" / "coordinator.sqlite"


class CoordinatorSettings(ServiceSettings):
    """The coordinator: drives runs through inference, reward and trainer, journalling every attempt."""

    model_config = SettingsConfigDict(env_prefix="PIPELINERL_COORDINATOR_")

    port: int = Field(default=50050, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    inference_addresses: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    """`host:port` of inference servers that are always members of the pool; attempts go to the
    least loaded member with room. May be empty when `inference_dns` or registrations supply them."""
    inference_dns: list[str] = Field(default_factory=list)
    """`host:port` names re-resolved every `membership_refresh_s`: every address a name resolves to
    is a member (a Kubernetes headless Service gives one per ready pod)."""
    membership_refresh_s: float = Field(default=5.0, gt=0)
    """How often DNS names are resolved again and lapsed registrations dropped."""
    inference_lease_s: float = Field(default=15.0, gt=0)
    """How long a registration (RegisterInferenceServer) holds without a renewal."""
    reward_address: str = "127.0.0.1:50053"
    """`host:port` of the reward service."""
    trainer_address: str = "127.0.0.1:50052"
    """`host:port` of the trainer."""
    services_auth_token: str | None = None
    """Bearer token the other services expect, if they need one."""
    services_tls_ca_file: Path | None = None
    """PEM CA bundle to verify the other services with, if they speak TLS; unset, calls are plaintext."""
    journal_path: Path = Field(default_factory=default_journal_path)
    """SQLite journal of every attempt (WAL); a restarted coordinator resumes its runs from it.
    Default `$XDG_STATE_HOME/pipelinerl/coordinator.sqlite` (`~/.local/state/pipelinerl/...`);
    its folder is created if missing."""
    tokenizer: str | None = None
    """Local HF tokenizer directory whose chat template wraps the prompts of file datasets."""
