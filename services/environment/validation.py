"""Checks of what callers send (InvalidArgument naming the field) and of what an environment returns
(EnvironmentFailed: the episode is ended), written once for every environment."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

from pipelinerl.common.errors import InvalidArgument, PipelineError
from pipelinerl.environment.types import (
    EpisodeOpening,
    Message,
    Opening,
    RewardComponent,
    Role,
    Step,
    StepResult,
    Tool,
    ToolCall,
)

ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TASK_BYTES = 64 * 1024
"""Longest `task` of a StartEpisode, in UTF-8 bytes: a task names a problem, it is not one."""
MAX_TOOL_CALLS = 256
"""Most tool calls of one assistant message."""


class EnvironmentFailed(PipelineError):
    """The environment's code raised, ran past its time limit, or returned what the contract forbids.
    The episode is ended; the caller starts a fresh one with the same seed."""

    code = "INTERNAL"


def check_episode_id(episode_id: str) -> None:
    if not ID_PATTERN.fullmatch(episode_id):
        raise InvalidArgument.field("episode_id", "must be 1 to 128 characters of [A-Za-z0-9._:-]")


def check_task(task: str) -> None:
    if len(task.encode("utf-8", "surrogatepass")) > MAX_TASK_BYTES:
        raise InvalidArgument.field("task", f"is longer than {MAX_TASK_BYTES} bytes")


def check_turn(turn: int) -> None:
    if turn < 1:
        raise InvalidArgument.field("turn", f"is {turn}; the model's first answer is turn 1")


def check_action(action: Message) -> None:
    """The model's turn: an assistant message whose tool calls have distinct, well-formed ids. Their
    names and arguments are the model's to get wrong, and the environment's to answer."""
    if action.role != Role.ASSISTANT:
        role = action.role.name if isinstance(action.role, Role) else "UNSPECIFIED"
        raise InvalidArgument.field("action.role", f"is {role}; the model's turn is ASSISTANT")
    if len(action.tool_calls) > MAX_TOOL_CALLS:
        raise InvalidArgument.field("action.tool_calls", f"has more than {MAX_TOOL_CALLS} calls")
    seen: dict[str, int] = {}
    for index, call in enumerate(action.tool_calls):
        path = f"action.tool_calls[{index}].id"
        if not ID_PATTERN.fullmatch(call.id):
            raise InvalidArgument.field(path, "must be 1 to 128 characters of [A-Za-z0-9._:-]")
        if (first := seen.setdefault(call.id, index)) != index:
            raise InvalidArgument.field(path, f"{call.id!r} repeats action.tool_calls[{first}].id")


def check_tools(tools: Sequence[Tool], where: str) -> tuple[Tool, ...]:
    """Tools with valid names, distinct, and an object schema that is JSON; raises ValueError."""
    out: list[Tool] = []
    names: set[str] = set()
    for tool in tools:
        if not isinstance(tool, Tool):
            raise ValueError(f"{where}: {tool!r} is not a Tool")
        if not TOOL_NAME_PATTERN.fullmatch(tool.name):
            raise ValueError(f"{where}: tool name {tool.name!r} is not 1 to 64 characters of [A-Za-z0-9_-]")
        if tool.name in names:
            raise ValueError(f"{where}: tool {tool.name!r} is named twice")
        names.add(tool.name)
        try:
            schema = json.loads(json.dumps(dict(tool.parameters), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: the parameters of tool {tool.name!r} are not JSON: {exc}") from exc
        if schema.get("type") != "object":
            raise ValueError(f"{where}: the parameters of tool {tool.name!r} are not an object schema")
        out.append(tool)
    return tuple(out)


def _content_bytes(messages: Sequence[Message], where: str) -> int:
    total = 0
    for message in messages:
        try:
            total += len(message.content.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise EnvironmentFailed(f"{where}: a message's content is not valid Unicode text: {exc}") from exc
        for text in (message.tool_call_id, message.name):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise EnvironmentFailed(f"{where}: a message is not valid Unicode text: {exc}") from exc
    return total


def _check_messages(
    messages: object, allowed: set[Role], where: str, max_bytes: int, calls: Sequence[ToolCall] = ()
) -> tuple[Message, ...]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise EnvironmentFailed(f"{where}: messages must be a list of Message, not {type(messages).__name__}")
    call_ids = {call.id for call in calls}
    out: list[Message] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Message):
            kind = type(message).__name__
            raise EnvironmentFailed(f"{where}: messages[{index}] is a {kind}, not a Message")
        if message.role not in allowed:
            names = ", ".join(sorted(r.name for r in allowed))
            role = message.role.name if isinstance(message.role, Role) else repr(message.role)
            raise EnvironmentFailed(f"{where}: messages[{index}] is {role}; an environment writes {names}")
        if not isinstance(message.content, str):
            raise EnvironmentFailed(f"{where}: messages[{index}].content is not text")
        if message.tool_calls:
            raise EnvironmentFailed(f"{where}: messages[{index}] has tool calls; only the model makes them")
        if message.role == Role.TOOL and message.tool_call_id not in call_ids:
            raise EnvironmentFailed(
                f"{where}: messages[{index}] answers tool call {message.tool_call_id!r}, "
                "which the model's turn did not make"
            )
        out.append(message)
    size = _content_bytes(out, where)
    if size > max_bytes:
        raise EnvironmentFailed(f"{where}: {size} bytes of content; the limit is {max_bytes}")
    return tuple(out)


def check_opening(opening: object, tools: tuple[Tool, ...], max_turns: int, max_bytes: int) -> EpisodeOpening:
    """What `reset` returned, with the environment's tools and turn limit filled in."""
    where = "reset"
    if not isinstance(opening, Opening):
        raise EnvironmentFailed(f"{where} returned a {type(opening).__name__}, not an Opening")
    messages = _check_messages(opening.messages, {Role.SYSTEM, Role.USER}, where, max_bytes)
    offered = tools
    if opening.tools is not None:
        try:
            offered = check_tools(opening.tools, where)
        except ValueError as exc:
            raise EnvironmentFailed(str(exc)) from exc
    limit = max_turns if opening.max_turns is None else opening.max_turns
    if not isinstance(limit, int) or limit < 0:
        raise EnvironmentFailed(f"{where}: max_turns is {limit!r}; it must be 0 (no limit) or more")
    return EpisodeOpening(messages, offered, limit)


def check_step(step: object, action: Message, turn: int, max_turns: int, max_bytes: int) -> StepResult:
    """What `step` returned; an episode that reaches `max_turns` without ending is truncated."""
    where = f"step of turn {turn}"
    if not isinstance(step, Step):
        raise EnvironmentFailed(f"{where} returned a {type(step).__name__}, not a Step")
    messages = _check_messages(step.messages, {Role.USER, Role.TOOL}, where, max_bytes, action.tool_calls)
    try:
        rewards = check_rewards(step.components, where)
    except (TypeError, ValueError, AttributeError) as exc:
        raise EnvironmentFailed(f"{where}: rewards are not named values: {exc}") from exc
    terminated, truncated = bool(step.terminated), bool(step.truncated)
    if max_turns and turn >= max_turns and not terminated:
        truncated = True
    return StepResult(messages, rewards, terminated, truncated, turn)


def check_rewards(rewards: Sequence[object], where: str) -> tuple[RewardComponent, ...]:
    """Named, finite numbers (an environment's step, an agent's episode); EnvironmentFailed otherwise."""
    for reward in rewards:
        if not isinstance(reward, RewardComponent) or not isinstance(reward.name, str) or not reward.name:
            raise EnvironmentFailed(f"{where}: reward {reward!r} has no name")
        if isinstance(reward.value, bool) or not isinstance(reward.value, int | float):
            raise EnvironmentFailed(f"{where}: reward {reward.name!r} is not a number")
        if not math.isfinite(reward.value):
            raise EnvironmentFailed(f"{where}: reward {reward.name!r} is {reward.value}")
    return tuple(RewardComponent(r.name, float(r.value)) for r in rewards if isinstance(r, RewardComponent))
