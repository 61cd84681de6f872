"""Domain types of the environment service: messages, tools, an episode's opening and steps, the
environment's description and the server's counters.

Plain dataclasses, apart from the protos: an environment author builds them (`sdk.py`), the episode
table checks them (`episodes.py`), and `convert.py` turns them into `pipelinerl.environment.v1`
messages and back, for the servicer and the client alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Role(StrEnum):
    """Who wrote a message. An environment writes SYSTEM, USER and TOOL messages, never ASSISTANT."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant message, in the OpenAI function-call shape."""

    id: str
    """Unique within the episode; the tool message answering it names it."""
    name: str
    arguments: str
    """JSON text as the model wrote it, which may be invalid: a mistake to answer in-band."""

    def json_arguments(self) -> dict[str, Any] | None:
        """The arguments as a JSON object, or None when they are not one."""
        try:
            value = json.loads(self.arguments)
        except (ValueError, RecursionError):
            return None
        return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class Message:
    """One message of an episode.

    Message.user("Guess a number from 1 to 100.")
    Message.tool(call, "42")  # answers `call`, a ToolCall of the model's turn
    """

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    """Assistant messages only."""
    tool_call_id: str = ""
    """Tool messages only: the call this message answers."""
    name: str = ""
    """Tool messages only: the tool that answered."""

    @classmethod
    def system(cls, content: str) -> Message:
        return cls(Role.SYSTEM, content)

    @classmethod
    def user(cls, content: str) -> Message:
        return cls(Role.USER, content)

    @classmethod
    def assistant(cls, content: str, tool_calls: Sequence[ToolCall] = ()) -> Message:
        return cls(Role.ASSISTANT, content, tuple(tool_calls))

    @classmethod
    def tool(cls, call: ToolCall, content: str) -> Message:
        """The result of `call`."""
        return cls(Role.TOOL, content, tool_call_id=call.id, name=call.name)


@dataclass(frozen=True)
class Tool:
    """A tool an episode offers, in the OpenAI/MCP function shape."""

    name: str
    """1 to 64 characters of [A-Za-z0-9_-]."""
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON Schema of the arguments (an object schema)."""


@dataclass(frozen=True)
class RewardComponent:
    """One named part of a reward; an episode's reward is the sum of all components of all steps."""

    name: str
    value: float


def _components(rewards: Mapping[str, float] | Sequence[RewardComponent]) -> tuple[RewardComponent, ...]:
    if isinstance(rewards, Mapping):
        return tuple(RewardComponent(name, value) for name, value in rewards.items())
    return tuple(rewards)


@dataclass(frozen=True)
class Opening:
    """What `reset` returns: the opening messages (system and user), the tools this episode offers
    (None: the environment's `tools`) and its turn limit (None: the environment's `max_turns`)."""

    messages: Sequence[Message]
    tools: Sequence[Tool] | None = None
    max_turns: int | None = None


@dataclass(frozen=True)
class Step:
    """What `step` returns: the reply (tool results and user messages), the rewards this turn earned
    (a dict of named values or RewardComponents), and whether the episode ended.

        Step([Message.user("higher")])
        Step([], rewards={"correct": 1.0}, terminated=True)
    """

    messages: Sequence[Message] = ()
    rewards: Mapping[str, float] | Sequence[RewardComponent] = ()
    terminated: bool = False
    """Ended by its own rules (solved, lost, answered)."""
    truncated: bool = False
    """Cut short by a limit (turns, time)."""

    @property
    def components(self) -> tuple[RewardComponent, ...]:
        return _components(self.rewards)

    @property
    def reward(self) -> float:
        """The sum of this step's components."""
        return sum(c.value for c in self.components)

    @property
    def ended(self) -> bool:
        return self.terminated or self.truncated


@dataclass(frozen=True)
class EpisodeOpening:
    """The opening of an episode as the server answers it: checked, with its tools and limit."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...]
    max_turns: int
    """0: no limit."""


@dataclass(frozen=True)
class StepResult:
    """The answer to one turn as the server sends it: checked, its turn limit applied."""

    messages: tuple[Message, ...]
    rewards: tuple[RewardComponent, ...]
    terminated: bool
    truncated: bool
    turn: int
    """The turn it answers; 0 from a server that predates the field (then unknown)."""

    @property
    def reward(self) -> float:
        return sum(c.value for c in self.rewards)

    @property
    def ended(self) -> bool:
        return self.terminated or self.truncated


@dataclass(frozen=True)
class EnvironmentInfo:
    """What the environment is and offers, and the server's limits."""

    name: str
    version: str
    description: str
    tools: tuple[Tool, ...]
    max_turns: int
    """0: no limit."""
    max_episodes: int
    lease_s: float
    max_observation_bytes: int
    agent: bool = False
    """An agent host: it runs whole episodes (`RunEpisode`), not StartEpisode and StepEpisode."""


@dataclass(frozen=True)
class AgentCall:
    """What an agent host is asked to run: one episode, whose model calls go to `base_url`."""

    episode_id: str
    seed: int
    task: str
    base_url: str
    """An OpenAI-compatible API for this episode only (`<base_url>/chat/completions`)."""
    api_key: str
    model: str


@dataclass(frozen=True)
class AgentOutcome:
    """How an agent's episode ended: its named rewards, and whether it was cut short."""

    rewards: tuple[RewardComponent, ...]
    truncated: bool = False

    @property
    def reward(self) -> float:
        return sum(c.value for c in self.rewards)


@dataclass(frozen=True)
class EnvironmentStats:
    """Load and counters since the server started."""

    active_episodes: int
    max_episodes: int
    episodes_started: int
    steps: int
    """Steps answered; a retried step counts once."""
    episodes_reaped: int
    failures: int
    """Calls whose environment code failed, ran past its time limit or broke the contract."""
