"""OpenEnv environments as text environments (`pip install 'pipelinerl[openenv]'`, openenv-core 0.3).

`OpenEnvRemote` plays an episode on an OpenEnv server that already runs (its WebSocket session, one
per episode); `OpenEnvLocal` makes the OpenEnv `Environment` class in this process, one instance
per episode. Both turn the model's reply into the action `{action_field: text}` and the observation
into one user message; the observation's reward is the reward component `env`, its `done` ends the
episode as terminated (OpenEnv has no truncation: `max_turns` truncates).

    pipelinerl serve environment --env pipelinerl.environment.adapters.openenv:OpenEnvRemote \\
        --env-args '{"base_url": "http://127.0.0.1:8000", "observation_field": "echoed_message"}'
    pipelinerl serve environment --env pipelinerl.environment.adapters.openenv:OpenEnvLocal \\
        --env-args '{"env": "echo_env.server.echo_environment:EchoEnvironment"}'

An action the OpenEnv action class refuses (pydantic's validation) is the model's mistake: it is
answered in-band with `invalid`, no reward. Whatever else fails (no server, a session refused, the
environment raising) is the environment's failure: the episode ends and is started again.
Neither starts containers or pulls from a hub (`from_docker_image`, `from_env`): the server or the
package must be there already.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
from typing import Any, ClassVar, get_type_hints

from pipelinerl.environment.sdk import Environment, Message, Opening, Step

try:
    from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
    from openenv.core.env_server.serialization import deserialize_action, serialize_observation
    from openenv.core.env_server.types import Action
    from openenv.core.generic_client import GenericEnvClient
    from pydantic import ValidationError
except ImportError as exc:  # the loader reports it as the reason the class cannot be loaded
    raise ImportError(
        "pipelinerl.environment.adapters.openenv needs openenv-core: pip install 'pipelinerl[openenv]'"
    ) from exc

__all__ = ["OpenEnvLocal", "OpenEnvRemote"]

VALIDATION_ERROR = "(code: VALIDATION_ERROR)"
"""How openenv-core's client words the server's answer to an action its class refused."""


class _OpenEnvText(Environment):
    version = "1"
    max_turns = 20

    invalid: ClassVar[str] = "invalid action"
    """The reply to a turn whose action the environment's action class refuses."""
    reward_name: ClassVar[str] = "env"

    def __init__(self, action_field: str, observation_field: str, turns: int) -> None:
        if not action_field:
            raise ValueError("action_field must name the action's text field")
        if turns < 0:
            raise ValueError("turns must be 0 (the class's max_turns) or more")
        self.action_field, self.observation_field = action_field, observation_field
        self.turns = turns or self.max_turns

    def action_data(self, action: Message) -> dict[str, Any] | None:
        """The action's JSON fields for the model's reply; None: it names no action (`invalid`)."""
        return {self.action_field: action.content}

    def render_observation(self, observation: dict[str, Any]) -> str:
        """The observation's fields (without reward, done and metadata) as the model reads them:
        `observation_field`'s value, or the only field's, or all of them as JSON."""
        if self.observation_field:
            if self.observation_field not in observation:
                raise RuntimeError(
                    f"the observation has no field {self.observation_field!r}: {sorted(observation)}"
                )
            value = observation[self.observation_field]
        elif len(observation) == 1:
            (value,) = observation.values()
        else:
            value = observation
        return value if isinstance(value, str) else json.dumps(value)

    def _opening(self, payload: dict[str, Any]) -> Opening:
        return Opening(
            [Message.user(self.render_observation(payload.get("observation") or {}))], max_turns=self.turns
        )

    def _step(self, payload: dict[str, Any]) -> Step:
        text = self.render_observation(payload.get("observation") or {})
        reward = payload.get("reward")
        rewards = {} if reward is None else {self.reward_name: float(reward)}
        return Step([Message.user(text)] if text else [], rewards, terminated=bool(payload.get("done")))


class OpenEnvRemote(_OpenEnvText):
    """An OpenEnv server at `base_url` (http:// or ws://), one WebSocket session per episode."""

    name = "openenv"
    description = "an OpenEnv environment served elsewhere"

    def __init__(
        self,
        base_url: str,
        action_field: str = "message",
        observation_field: str = "",
        turns: int = 0,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(action_field, observation_field, turns)
        self.client = GenericEnvClient(
            base_url=base_url, connect_timeout_s=connect_timeout_s, message_timeout_s=message_timeout_s
        )

    async def reset(self, seed: int, task: str) -> Opening:
        """`seed` (and `task`, when not empty) go to the environment's reset; OpenEnv's server drops
        an argument its reset does not take."""
        await self.client.connect()
        result = await self.client.reset(seed=seed, **({"task": task} if task else {}))
        return self._opening(
            {"observation": result.observation, "reward": result.reward, "done": result.done}
        )

    async def step(self, action: Message) -> Step:
        data = self.action_data(action)
        if data is None:
            return Step([Message.user(self.invalid)])
        try:
            result = await self.client.step(data)
        except RuntimeError as exc:
            if VALIDATION_ERROR in str(exc):
                return Step([Message.user(self.invalid)])
            raise
        return self._step({"observation": result.observation, "reward": result.reward, "done": result.done})

    async def close(self) -> None:
        await self.client.close()


class OpenEnvLocal(_OpenEnvText):
    """An OpenEnv `Environment` class made in this process: `env` is `package.module:Class`, made
    with `env_kwargs`; `action` its Action class (default: the annotation of its `step`'s action)."""

    name = "openenv"
    description = "an OpenEnv environment in this process"

    def __init__(
        self,
        env: str,
        action: str = "",
        action_field: str = "message",
        observation_field: str = "",
        env_kwargs: dict[str, Any] | None = None,
        turns: int = 0,
    ) -> None:
        super().__init__(action_field, observation_field, turns)
        cls = _import(env)
        if not (isinstance(cls, type) and issubclass(cls, OpenEnvEnvironment)):
            raise TypeError(f"{env} is not an OpenEnv Environment class")
        self.action_cls = _import(action) if action else _action_annotation(cls)
        if not (isinstance(self.action_cls, type) and issubclass(self.action_cls, Action)):
            raise TypeError(
                f"{env}'s action class is not an OpenEnv Action ({self.action_cls!r}): name it in `action`"
            )
        if action_field not in self.action_cls.model_fields:
            raise ValueError(f"{self.action_cls.__name__} has no field {action_field!r}")
        self.env: OpenEnvEnvironment[Any, Any, Any] = cls(**(env_kwargs or {}))

    async def reset(self, seed: int, task: str) -> Opening:
        """As OpenEnv's server calls it: `seed` (and `task`, when not empty), less what its reset does
        not take."""
        arguments: dict[str, Any] = {"seed": seed, **({"task": task} if task else {})}
        if _overrides(self.env, "reset_async"):
            observation = await self.env.reset_async(**_accepted(self.env.reset_async, arguments))
        else:
            observation = await asyncio.to_thread(self.env.reset, **_accepted(self.env.reset, arguments))
        return self._opening(serialize_observation(observation))

    async def step(self, action: Message) -> Step:
        data = self.action_data(action)
        if data is None:
            return Step([Message.user(self.invalid)])
        try:
            parsed = deserialize_action(data, self.action_cls)
        except ValidationError:
            return Step([Message.user(self.invalid)])
        if _overrides(self.env, "step_async"):
            observation = await self.env.step_async(parsed)
        else:
            observation = await asyncio.to_thread(self.env.step, parsed)
        return self._step(serialize_observation(observation))

    async def close(self) -> None:
        await asyncio.to_thread(self.env.close)


def _import(spec: str) -> Any:
    module, sep, attribute = spec.rpartition(":")
    if not sep or not module or not attribute:
        raise ValueError(f"{spec!r} is not package.module:Name")
    return getattr(importlib.import_module(module), attribute)


def _action_annotation(cls: type) -> Any:
    try:
        return get_type_hints(cls.step).get("action")  # type: ignore[attr-defined]
    except Exception:  # an annotation that does not resolve: `action` must name the class
        return None


def _overrides(env: object, method: str) -> bool:
    return getattr(type(env), method) is not getattr(OpenEnvEnvironment, method)


def _accepted(function: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return arguments
    return {key: value for key, value in arguments.items() if key in parameters}
