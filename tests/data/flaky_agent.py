"""An agent whose first play of each episode calls the model once and then crashes; every later play
is the built-in guess_number agent. The coordinator names a play `<attempt>.<play>`, so `.0` is
the first: each episode is played again, and the first play's recorded call must never be trained."""

from __future__ import annotations

from openai import AsyncOpenAI

from pipelinerl.environment.agent import Episode, Result
from pipelinerl.environment.builtin.agents import guess_number

CRASHED_PROMPT = "lost"


async def flaky_guess_number(episode: Episode) -> Result:
    if episode.id.endswith(".0"):
        async with AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key) as client:
            messages = [{"role": "user", "content": CRASHED_PROMPT}]
            await client.chat.completions.create(model=episode.model, messages=messages)  # type: ignore[arg-type]
        raise RuntimeError("the agent crashed after its first call")
    return await guess_number(episode)
