"""Environment messages <-> environment domain types, both directions (servicer and client)."""

from __future__ import annotations

import json
from dataclasses import asdict, fields

from google.protobuf.duration_pb2 import Duration

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.environment.types import (
    AgentCall,
    AgentOutcome,
    EnvironmentInfo,
    EnvironmentStats,
    EpisodeOpening,
    Message,
    RewardComponent,
    Role,
    StepResult,
    Tool,
    ToolCall,
)
from pipelinerl.environment.v1 import environment_pb2 as pb

_ROLES = {
    Role.SYSTEM: pb.ROLE_SYSTEM,
    Role.USER: pb.ROLE_USER,
    Role.ASSISTANT: pb.ROLE_ASSISTANT,
    Role.TOOL: pb.ROLE_TOOL,
}
_ROLES_BACK = {value: role for role, value in _ROLES.items()}


def message_to_proto(message: Message) -> pb.Message:
    return pb.Message(
        role=_ROLES[message.role],
        content=message.content,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls],
        tool_call_id=message.tool_call_id,
        name=message.name,
    )


def message_from_proto(msg: pb.Message) -> Message:
    """Raises InvalidArgument (field `role`) for a role that is unset or unknown."""
    role = _ROLES_BACK.get(msg.role)
    if role is None:
        raise InvalidArgument.field("role", f"is {msg.role}: unset or unknown")
    return Message(
        role=role,
        content=msg.content,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls),
        tool_call_id=msg.tool_call_id,
        name=msg.name,
    )


def tool_to_proto(tool: Tool) -> pb.Tool:
    return pb.Tool(name=tool.name, description=tool.description, parameters=json.dumps(dict(tool.parameters)))


def tool_from_proto(msg: pb.Tool) -> Tool:
    return Tool(msg.name, msg.description, json.loads(msg.parameters) if msg.parameters else {})


def opening_to_proto(opening: EpisodeOpening) -> pb.StartEpisodeResponse:
    return pb.StartEpisodeResponse(
        messages=[message_to_proto(m) for m in opening.messages],
        tools=[tool_to_proto(t) for t in opening.tools],
        max_turns=opening.max_turns,
    )


def opening_from_proto(msg: pb.StartEpisodeResponse) -> EpisodeOpening:
    return EpisodeOpening(
        messages=tuple(message_from_proto(m) for m in msg.messages),
        tools=tuple(tool_from_proto(t) for t in msg.tools),
        max_turns=msg.max_turns,
    )


def step_to_proto(result: StepResult) -> pb.StepEpisodeResponse:
    return pb.StepEpisodeResponse(
        messages=[message_to_proto(m) for m in result.messages],
        rewards=[pb.RewardComponent(name=r.name, value=r.value) for r in result.rewards],
        terminated=result.terminated,
        truncated=result.truncated,
        turn=result.turn,
    )


def step_from_proto(msg: pb.StepEpisodeResponse) -> StepResult:
    return StepResult(
        messages=tuple(message_from_proto(m) for m in msg.messages),
        rewards=tuple(RewardComponent(r.name, r.value) for r in msg.rewards),
        terminated=msg.terminated,
        truncated=msg.truncated,
        turn=msg.turn,
    )


def info_to_proto(info: EnvironmentInfo) -> pb.DescribeEnvironmentResponse:
    lease = Duration()
    lease.FromNanoseconds(round(info.lease_s * 1e9))
    return pb.DescribeEnvironmentResponse(
        name=info.name,
        version=info.version,
        description=info.description,
        tools=[tool_to_proto(t) for t in info.tools],
        max_turns=info.max_turns,
        max_episodes=info.max_episodes,
        lease=lease,
        max_observation_bytes=info.max_observation_bytes,
        agent=info.agent,
    )


def info_from_proto(msg: pb.DescribeEnvironmentResponse) -> EnvironmentInfo:
    return EnvironmentInfo(
        name=msg.name,
        version=msg.version,
        description=msg.description,
        tools=tuple(tool_from_proto(t) for t in msg.tools),
        max_turns=msg.max_turns,
        max_episodes=msg.max_episodes,
        lease_s=msg.lease.ToNanoseconds() / 1e9,
        max_observation_bytes=msg.max_observation_bytes,
        agent=msg.agent,
    )


def agent_call_to_proto(call: AgentCall) -> pb.RunEpisodeRequest:
    return pb.RunEpisodeRequest(**asdict(call))


def agent_call_from_proto(msg: pb.RunEpisodeRequest) -> AgentCall:
    return AgentCall(**{f.name: getattr(msg, f.name) for f in fields(AgentCall)})


def outcome_to_proto(outcome: AgentOutcome) -> pb.RunEpisodeResponse:
    rewards = [pb.RewardComponent(name=r.name, value=r.value) for r in outcome.rewards]
    return pb.RunEpisodeResponse(rewards=rewards, truncated=outcome.truncated)


def outcome_from_proto(msg: pb.RunEpisodeResponse) -> AgentOutcome:
    return AgentOutcome(tuple(RewardComponent(r.name, r.value) for r in msg.rewards), msg.truncated)


def stats_to_proto(stats: EnvironmentStats) -> pb.GetStatusResponse:
    return pb.GetStatusResponse(**asdict(stats))


def stats_from_proto(msg: pb.GetStatusResponse) -> EnvironmentStats:
    return EnvironmentStats(**{f.name: getattr(msg, f.name) for f in fields(EnvironmentStats)})
