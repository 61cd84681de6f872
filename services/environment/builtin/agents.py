"""Built-in agents (`--agent builtin:<name>`): a built-in environment's game played by an agent
that runs its own loop with the official `openai` SDK, as any third-party agent would.

    opening = env.reset(seed) ──► messages
    loop: client.chat.completions.create(messages, tools) ──► the assistant message, appended as
          the API returned it ──► env.step(it) ──► its reply appended ──► until the game ends
    return the summed rewards (truncated when a turn was cut by max_tokens or the turn limit)

The rules, the seed's task and the rewards are the environment's own (the same class serves
`--environment <name>`), so the two ways of training compare on the same game.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from pipelinerl.environment.agent import Episode, Result
from pipelinerl.environment.builtin.calculator import Calculator
from pipelinerl.environment.builtin.guess_number import GuessNumber
from pipelinerl.environment.calls import run_code
from pipelinerl.environment.openai_shape import message_to_openai, tool_to_openai
from pipelinerl.environment.sdk import Environment, Message, Opening, Step, ToolCall

_CONNECTIONS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DefaultAsyncHttpxClient] = (
    weakref.WeakKeyDictionary()
)
"""One HTTP client per event loop, shared by its episodes' OpenAI clients: a client of its own costs
an episode ~35 ms of CPU (its TLS context), in the event loop every episode of the host shares."""


def _connections() -> DefaultAsyncHttpxClient:
    loop = asyncio.get_running_loop()
    if loop not in _CONNECTIONS:
        _CONNECTIONS[loop] = DefaultAsyncHttpxClient()
    return _CONNECTIONS[loop]


def environment_agent(cls: type[Environment]) -> Callable[[Episode], Awaitable[Result]]:
    """An agent that plays `cls`'s episodes (`cls(**episode.args)`) through the episode's API."""

    async def play(episode: Episode) -> Result:
        env = cls(**episode.args)
        try:
            opening: Opening = await run_code(env.reset, episode.seed, episode.task)
            client = AsyncOpenAI(
                base_url=episode.base_url, api_key=episode.api_key, http_client=_connections()
            )
            return await _turns(client, episode.model, env, opening, cls)
        finally:
            await run_code(env.close)

    play.__name__ = play.__qualname__ = cls.display_name()
    play.__doc__ = f"{cls.display_name()} played through the chat-completions API"
    return play


async def _turns(
    client: AsyncOpenAI, model: str, env: Environment, opening: Opening, cls: type[Environment]
) -> Result:
    tools = [tool_to_openai(t) for t in (cls.tools if opening.tools is None else opening.tools)]
    max_turns = cls.max_turns if opening.max_turns is None else opening.max_turns
    messages: list[Any] = [message_to_openai(m) for m in opening.messages]
    rewards: dict[str, float] = {}
    turn = 0
    while True:
        turn += 1
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        reply = await client.chat.completions.create(model=model, messages=messages, **extra)
        choice = reply.choices[0]
        if choice.finish_reason == "length":  # cut by max_tokens: the game is not played on
            return Result(rewards, truncated=True)
        said = choice.message
        calls = [
            ToolCall(c.id, c.function.name, c.function.arguments)
            for c in said.tool_calls or ()
            if c.type == "function"
        ]
        messages.append(said.model_dump(exclude_none=True))
        step: Step = await run_code(env.step, Message.assistant(said.content or "", calls))
        for component in step.components:
            rewards[component.name] = rewards.get(component.name, 0.0) + component.value
        if step.ended:
            return Result(rewards, truncated=step.truncated and not step.terminated)
        if max_turns and turn >= max_turns:
            return Result(rewards, truncated=True)
        messages += [message_to_openai(m) for m in step.messages]


guess_number = environment_agent(GuessNumber)
calculator = environment_agent(Calculator)
