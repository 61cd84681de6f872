"""A small OpenEnv environment, on openenv-core's own base classes, for test_openenv_adapter.py: say
the number of the seed; a reply over 12 characters is an action its class refuses; `boom` breaks it."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class SayAction(Action):
    message: str = Field(max_length=12)


class SayObservation(Observation):
    prompt: str = ""


class SayNumber(Environment[SayAction, SayObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, top: int = 10) -> None:
        super().__init__()
        self.top = top
        self.target = 0
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SayObservation:
        self.target = (seed or 0) % self.top
        self._state = State(episode_id=episode_id, step_count=0)
        return SayObservation(prompt=f"say {self.target}")

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:
        self._state.step_count += 1
        if action.message.strip() == "boom":
            raise RuntimeError("the environment broke")
        right = action.message.strip() == str(self.target)
        return SayObservation(prompt="yes" if right else "no", reward=float(right), done=right)

    @property
    def state(self) -> State:
        return self._state
