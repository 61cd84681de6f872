"""What an environment author writes: one subclass of `Environment`; `pipelinerl serve environment
--env package.module:Class` serves it (leases, retries, limits, health and metrics come with it).

    from pipelinerl.environment.sdk import Environment, Message, Opening, Step

    class Echo(Environment):
        name = "echo"
        version = "1"
        max_turns = 3

        def reset(self, seed: int, task: str) -> Opening:
            return Opening([Message.user("say 7")])

        def step(self, action: Message) -> Step:
            right = action.content.strip() == "7"
            return Step([] if right else [Message.user("no")], {"correct": float(right)}, terminated=right)

One instance serves one episode: the server makes it (`Class(**env_args)`), calls `reset` once, then
`step` once per turn, and `close` when the episode ends, fails or is reaped. Methods may be plain or
`async`: a plain one runs on a worker thread no other call is using at the time, so one slow
episode does not hold the others up; an `async` one runs in the server's event loop and must not
block it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import ClassVar

from pipelinerl.environment.types import (
    Message,
    Opening,
    RewardComponent,
    Role,
    Step,
    Tool,
    ToolCall,
)

__all__ = ["Environment", "Message", "Opening", "RewardComponent", "Role", "Step", "Tool", "ToolCall"]


class Environment:
    """Base of an environment: one instance per episode.

    A model's mistake (an unparsable tool call, an illegal move, a wrong answer) is answered in the
    reply, with the reward it earns. Raising is for the environment's own failures: the episode is
    ended and the caller starts a fresh one with the same seed; the failure is never scored.
    """

    name: ClassVar[str] = ""
    """Name of the environment; empty: the class name."""
    version: ClassVar[str] = "0"
    """Version of its behaviour; change it when the behaviour changes."""
    description: ClassVar[str] = ""
    """What an episode is about, for people."""
    tools: ClassVar[Sequence[Tool]] = ()
    """The tools its episodes offer (an episode's `Opening.tools` may offer fewer)."""
    max_turns: ClassVar[int] = 0
    """Most turns of an episode; the server truncates an episode that reaches it. 0: no limit."""

    def reset(self, seed: int, task: str) -> Opening | Awaitable[Opening]:
        """Start the episode: `seed` draws its randomness (every attempt of a group gets the same),
        `task` names a task in the environment's own terms (empty: draw one from `seed`)."""
        raise NotImplementedError

    def step(self, action: Message) -> Step | Awaitable[Step]:
        """Answer the model's turn (an assistant message, with its tool calls)."""
        raise NotImplementedError

    def close(self) -> Awaitable[None] | None:
        """Release what the episode holds; called once, also after a failure."""
        return None

    @classmethod
    def display_name(cls) -> str:
        return cls.name or cls.__name__
