"""Settings of the coordinator (env `PIPELINERL_COORDINATOR_*`, `--flags`, or a YAML/TOML file)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

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
    evaluation_addresses: list[str] = Field(default_factory=list)
    """`host:port` of evaluation servers (inference servers that take no training attempt) that are
    always members of the evaluation pool: while one is connected, held-out evaluations run there
    instead of on a training server. Servers with `role: evaluation` join it by registering too."""
    evaluation_dns: list[str] = Field(default_factory=list)
    """`host:port` names of evaluation servers, re-resolved as `inference_dns` is."""
    membership_refresh_s: float = Field(default=5.0, gt=0)
    """How often DNS names (`inference_dns`, `reward_dns`) are resolved again and lapsed
    registrations dropped."""
    inference_lease_s: float = Field(default=15.0, gt=0)
    """How long a registration (RegisterInferenceServer) holds without a renewal."""
    reward_address: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["127.0.0.1:50053"])
    """`host:port` of the reward replicas that are always members of the reward pool: one, or
    several (comma-separated, the flag repeated, or a JSON list); each Score call goes to the
    least loaded replica that is up, and to another if it fails there. May be empty (`[]`) when
    `reward_dns` supplies them."""
    reward_dns: list[str] = Field(default_factory=list)
    """`host:port` names re-resolved every `membership_refresh_s`: every address a name resolves to
    is a reward replica (a Kubernetes headless Service gives one per ready pod)."""
    environment_addresses: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """`host:port` of the environment replicas that are always members of the environment pool
    (runs with `spec.environment`): comma-separated, the flag repeated, or a JSON list. Each episode
    goes to the replica with the fewest episodes that is up, and stays there to its end."""
    environment_dns: list[str] = Field(default_factory=list)
    """`host:port` names re-resolved every `membership_refresh_s`: every address a name resolves to
    is an environment replica."""
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
    agent_gateway_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the chat-completions endpoint that agent runs call (docs/agents.md); 0 picks a free
    one. Unset: no endpoint, and a run on an agent host is refused."""
    agent_gateway_host: str = "127.0.0.1"
    """Address the endpoint binds (`0.0.0.0` for agent hosts on other machines)."""
    agent_gateway_url: str | None = None
    """Base URL the agent hosts are given for the endpoint (`http://coordinator:8000`); unset:
    `http://<agent_gateway_host>:<port>`."""
    tokenizer: str | None = None
    """Local HF tokenizer directory (or a preset's name: `tiny`) whose chat template wraps the
    prompts of file datasets and renders the episodes of environment runs."""

    @field_validator("reward_address", "environment_addresses", mode="before")
    @classmethod
    def _address_list(cls, value: Any) -> Any:
        """A single `host:port`, as the field once was, or several comma-separated, from a flag,
        the environment or a file; a JSON list as for any list."""
        if isinstance(value, str):
            value = value.strip()
            return (
                json.loads(value)
                if value.startswith("[")
                else [a.strip() for a in value.split(",") if a.strip()]
            )
        return value
