"""Finds the environment class the `env` setting names (or the agent function `agent` names) and
checks it before the server starts: `package.module:Class` (importable, or found from the current
directory), `path/to/file.py:Class`, or `builtin:<name>`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipelinerl.environment.sdk import Environment
from pipelinerl.environment.validation import check_tools

BUILTIN = {
    "guess_number": "pipelinerl.environment.builtin.guess_number:GuessNumber",
    "calculator": "pipelinerl.environment.builtin.calculator:Calculator",
    # Gymnasium's, as text (the `gymnasium` extra).
    "frozen_lake": "pipelinerl.environment.adapters.gymnasium:FrozenLake",
    "blackjack": "pipelinerl.environment.adapters.gymnasium:Blackjack",
}
"""`builtin:<name>` → where its class lives."""
BUILTIN_AGENTS = {
    "guess_number": "pipelinerl.environment.builtin.agents:guess_number",
    "calculator": "pipelinerl.environment.builtin.agents:calculator",
}
"""`builtin:<name>` → where its agent function lives (the environment of that name, played through
the chat-completions API)."""


class EnvironmentLoadError(ValueError):
    """The `env` setting names no usable environment class; the message says why."""


def load_environment(spec: str, env_args: dict[str, Any] | None = None) -> type[Environment]:
    """The class `spec` names, checked: a subclass of Environment whose tools and limits are valid
    and whose constructor accepts `env_args`."""
    cls = _load_attribute(spec, BUILTIN, "environment", "env", "Class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvironmentLoadError(f"{spec} is not a subclass of pipelinerl.environment.sdk.Environment")
    check_class(cls, env_args or {})
    return cls


def load_agent(spec: str) -> Callable[..., Any]:
    """The agent function `spec` names: a callable that takes the episode (`agent.Episode`)."""
    agent = _load_attribute(spec, BUILTIN_AGENTS, "agent", "agent", "function")
    if not callable(agent) or isinstance(agent, type):
        raise EnvironmentLoadError(f"agent {spec} is not a function")
    try:
        inspect.signature(agent).bind(None)
    except TypeError as exc:
        raise EnvironmentLoadError(f"agent {spec} must take one argument, the episode: {exc}") from exc
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return agent


def agent_name(spec: str) -> str:
    """The name an agent host describes itself with: a built-in's own, else its function's."""
    return spec.removeprefix("builtin:") if spec.startswith("builtin:") else load_agent(spec).__name__


def _load_attribute(spec: str, builtin: dict[str, str], what: str, setting: str, kind: str) -> Any:
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in builtin:
            raise EnvironmentLoadError(f"no built-in {what} {name!r}; there are: {', '.join(builtin)}")
        spec = builtin[name]
    where, sep, attribute = spec.rpartition(":")
    if not sep or not where or not attribute:
        raise EnvironmentLoadError(
            f"{setting} {spec!r} must be package.module:{kind}, path/to/file.py:{kind} or builtin:<name>"
        )
    found = getattr(_load_module(where), attribute, None)
    if found is None:
        raise EnvironmentLoadError(f"{where} has no attribute {attribute!r}")
    return found


def _load_module(where: str) -> Any:
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise EnvironmentLoadError(f"no file {where}")
        name = f"pipelinerl_env_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise EnvironmentLoadError(f"cannot load {where} as a module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise EnvironmentLoadError(f"importing {where} failed: {exc!r}") from exc
        return module
    if os.getcwd() not in sys.path:  # as `python -m` would: a module beside the caller is found
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise EnvironmentLoadError(f"cannot import {where}: {exc}") from exc
    except Exception as exc:
        raise EnvironmentLoadError(f"importing {where} failed: {exc!r}") from exc


def check_class(cls: type[Environment], env_args: dict[str, Any]) -> None:
    """Raise EnvironmentLoadError unless the class's description is valid and `cls(**env_args)`
    matches its constructor's signature (nothing is constructed)."""
    where = cls.__qualname__
    if cls.reset is Environment.reset or cls.step is Environment.step:
        raise EnvironmentLoadError(f"{where} must define reset and step")
    for attribute in ("name", "version", "description"):
        if not isinstance(getattr(cls, attribute), str):
            raise EnvironmentLoadError(f"{where}.{attribute} must be a string")
    if isinstance(cls.max_turns, bool) or not isinstance(cls.max_turns, int) or cls.max_turns < 0:
        raise EnvironmentLoadError(f"{where}.max_turns must be 0 (no limit) or more")
    try:
        check_tools(cls.tools, f"{where}.tools")
    except ValueError as exc:
        raise EnvironmentLoadError(str(exc)) from exc
    try:
        inspect.signature(cls).bind(**env_args)
    except TypeError as exc:
        raise EnvironmentLoadError(f"env_args {sorted(env_args)} do not fit {where}(): {exc}") from exc
