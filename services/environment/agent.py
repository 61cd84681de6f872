"""What an agent author writes: one function that plays one episode through a chat-completions API;
`pipelinerl run --agent package.module:function` trains it, `pipelinerl serve environment --agent
...` hosts it for a run elsewhere.

    from openai import AsyncOpenAI
    from pipelinerl.environment.agent import Episode

    async def solve(episode: Episode) -> float:
        client = AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key)
        reply = await client.chat.completions.create(
            model=episode.model, messages=[{"role": "user", "content": f"say {episode.seed % 10}"}]
        )
        return float(reply.choices[0].message.content == str(episode.seed % 10))

The function runs its own loop: any number of calls, tools in the OpenAI shape, its own history
(it may rewrite it). Every token the model samples at `base_url` is recorded under the episode and
trained on with the episode's reward. It may be plain or `async def`: a plain one runs in a thread
of its own, an `async` one in the host's event loop (it must not block it).

It returns the episode's reward: a number (the component `reward`), a dict of named components
(`{"correct": 1.0}`: `correct` at 1 or more counts the episode correct), or a `Result` that also
says the episode was cut short. Raising is for the agent's own failures (a sandbox that died):
the episode is played again, with the same seed, and the failure is never scored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipelinerl.environment.types import AgentOutcome, RewardComponent
from pipelinerl.environment.validation import EnvironmentFailed, check_rewards

DEFAULT_COMPONENT = "reward"
"""The component a plain number returned by an agent is reported as."""


@dataclass(frozen=True)
class Episode:
    """One episode as the agent receives it."""

    id: str
    seed: int
    """Draws the episode's randomness: every attempt of a group gets the same one."""
    task: str
    """A task in the agent's own terms; empty: draw one from `seed`."""
    base_url: str
    """An OpenAI-compatible API for this episode only: an OpenAI client's `base_url`."""
    api_key: str
    """The key to call `base_url` with: an OpenAI client's `api_key`."""
    model: str
    """The model name to send."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """The host's `env_args` (`--agent-args`), the same for every episode."""


@dataclass(frozen=True)
class Result:
    """An episode's reward with how it ended: `Result({"correct": 0.0}, truncated=True)`."""

    rewards: float | Mapping[str, float]
    truncated: bool = False


def outcome(value: object) -> AgentOutcome:
    """What an agent returned, as the host reports it; EnvironmentFailed for anything else."""
    truncated = False
    if isinstance(value, Result):
        value, truncated = value.rewards, bool(value.truncated)
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = {DEFAULT_COMPONENT: value}
    if not isinstance(value, Mapping):
        raise EnvironmentFailed(
            f"the agent returned a {type(value).__name__}; it returns a number, a dict of named "
            "numbers or a Result"
        )
    components = [RewardComponent(str(name), reward) for name, reward in value.items()]
    return AgentOutcome(check_rewards(components, "the agent's result"), truncated)
