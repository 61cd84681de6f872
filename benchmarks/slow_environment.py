"""An environment whose steps take time, as real tools do (a sandbox, a web call, a compiler):
another environment's episodes, each step answered after a wait drawn log-uniformly between
`latency_s[0]` and `latency_s[1]` seconds (from the episode's seed, so every run waits alike).

    pipelinerl serve environment --env benchmarks/slow_environment.py:Slow \\
        --env-args '{"env": "builtin:guess_number", "latency_s": [0.01, 1.0]}'

The wait is not CPU: the server's event loop sleeps, so it holds hundreds of episodes waiting at once.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from pipelinerl.environment.loader import load_environment
from pipelinerl.environment.sdk import Environment, Message, Opening, Step


class Slow(Environment):
    name = "slow"
    version = "1"
    description = "another environment's episodes, each step after a log-uniform wait"

    def __init__(
        self, env: str = "builtin:guess_number", env_args: dict[str, Any] | None = None,
        latency_s: tuple[float, float] = (0.01, 1.0),
    ) -> None:  # fmt: skip
        low, high = latency_s
        if not 0 < low <= high:
            raise ValueError(f"latency_s must be 0 < low <= high, not {latency_s}")
        self._inner = load_environment(env, env_args)(**(env_args or {}))
        self._log_range = (math.log(low), math.log(high))
        self._rng = random.Random(0)

    async def reset(self, seed: int, task: str) -> Opening:
        self._rng = random.Random(seed)
        opening = await _result(self._inner.reset(seed, task))
        max_turns = opening.max_turns if opening.max_turns is not None else type(self._inner).max_turns
        tools = opening.tools if opening.tools is not None else tuple(type(self._inner).tools)
        return Opening(opening.messages, tools, max_turns)

    async def step(self, action: Message) -> Step:
        await asyncio.sleep(math.exp(self._rng.uniform(*self._log_range)))
        return await _result(self._inner.step(action))

    async def close(self) -> None:
        await _result(self._inner.close())


async def _result(value: Any) -> Any:
    """What a plain or `async` method of an environment returned."""
    return await value if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future) else value
