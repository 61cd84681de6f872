"""Settings of the environment service (env `PIPELINERL_ENVIRONMENT_*`, `--flags`, or a YAML/TOML file)."""

from __future__ import annotations

from typing import Any, Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from pipelinerl.common.settings import ServiceSettings
from pipelinerl.environment.agent_host import AgentLimits
from pipelinerl.environment.episodes import EpisodeLimits

DEFAULTS = EpisodeLimits()
AGENT_DEFAULTS = AgentLimits()


class EnvironmentSettings(ServiceSettings):
    """The environment service: the episodes of one environment class, each with its own instance;
    or, with `agent`, an agent host that runs whole episodes of one agent function."""

    model_config = SettingsConfigDict(env_prefix="PIPELINERL_ENVIRONMENT_")

    port: int = Field(default=50054, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    env: str | None = Field(default=None, min_length=1)
    """The environment class: `package.module:Class`, `path/to/file.py:Class`, or `builtin:<name>`
    (`builtin:guess_number`, `builtin:calculator`). A subclass of
    `pipelinerl.environment.sdk.Environment`; the server does not start when it cannot be loaded.
    Exactly one of `env` and `agent` is set."""
    agent: str | None = Field(default=None, min_length=1)
    """An agent function instead (`package.module:function`, `path/to/file.py:function` or
    `builtin:<name>`): the server is an agent host, which runs each episode by calling it
    (docs/agents.md)."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class's constructor, the same for every episode (JSON on the command
    line: `--env-args '{"low": 1, "high": 50}'`); an agent's `Episode.args`."""
    max_episodes: int = Field(default=DEFAULTS.max_episodes, ge=1)
    """Most episodes held at once (running, or finished and not yet ended); one more start is
    RESOURCE_EXHAUSTED."""
    lease_s: float = Field(default=DEFAULTS.lease_s, gt=0)
    """An episode with no call for this long is ended and its instance closed (NOT_FOUND from then on)."""
    max_observation_bytes: int = Field(default=DEFAULTS.max_observation_bytes, ge=1)
    """Most bytes of message content (UTF-8) in one answer of the environment; an answer over it
    ends the episode with INTERNAL. Keep it well under `max_message_bytes`."""
    step_timeout_s: float = Field(default=DEFAULTS.step_timeout_s, gt=0)
    """Time limit of each call into the environment's code (making the instance and `reset`
    together, each `step`, `close`); one past it ends the episode with INTERNAL."""

    max_agent_episodes: int = Field(default=AGENT_DEFAULTS.max_episodes, ge=1)
    """An agent host: most episodes run at once; one more is RESOURCE_EXHAUSTED."""
    episode_timeout_s: float = Field(default=AGENT_DEFAULTS.episode_timeout_s, gt=0)
    """An agent host: time limit of one episode of the agent's code; past it the episode fails
    with INTERNAL (and is played again by the run)."""

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        if (self.env is None) == (self.agent is None):
            raise ValueError("set exactly one of env (an environment class) and agent (an agent function)")
        return self

    def agent_limits(self) -> AgentLimits:
        return AgentLimits(self.max_agent_episodes, self.episode_timeout_s)

    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(self.max_episodes, self.lease_s, self.max_observation_bytes, self.step_timeout_s)
