"""Typed asyncio client of the environment service, used by the coordinator and the tests.

    async with EnvironmentClient("127.0.0.1:50054") as env:
        opening = await env.start("run-p3-a1", seed=3)
        result = await env.step("run-p3-a1", 1, Message.assistant("50"))
        await env.end("run-p3-a1")

Start and step are safe to retry (the channel retries UNAVAILABLE by itself); a failure of the
environment's code raises PipelineError with code INTERNAL, and the episode is gone (NotFound).
"""

from __future__ import annotations

from pipelinerl.common.channel import ChannelConfig, ServiceClient
from pipelinerl.common.status import domain_errors
from pipelinerl.environment.convert import (
    agent_call_to_proto,
    info_from_proto,
    message_to_proto,
    opening_from_proto,
    outcome_from_proto,
    stats_from_proto,
    step_from_proto,
)
from pipelinerl.environment.types import (
    AgentCall,
    AgentOutcome,
    EnvironmentInfo,
    EnvironmentStats,
    EpisodeOpening,
    Message,
    StepResult,
)
from pipelinerl.environment.v1 import environment_pb2 as pb
from pipelinerl.environment.v1 import environment_pb2_grpc


class EnvironmentClient(ServiceClient):
    """Raises `pipelinerl.common.errors.*` when a call fails (see the proto for each code)."""

    def __init__(self, config: ChannelConfig | str) -> None:
        super().__init__(config)
        self._stub = environment_pb2_grpc.EnvironmentServiceStub(self._channel)

    async def describe(self, timeout_s: float | None = None) -> EnvironmentInfo:
        with domain_errors():
            response = await self._stub.DescribeEnvironment(
                pb.DescribeEnvironmentRequest(), timeout=timeout_s
            )
        return info_from_proto(response)

    async def start(
        self, episode_id: str, seed: int = 0, task: str = "", timeout_s: float | None = None
    ) -> EpisodeOpening:
        request = pb.StartEpisodeRequest(episode_id=episode_id, seed=seed, task=task)
        with domain_errors():
            response = await self._stub.StartEpisode(request, timeout=timeout_s)
        return opening_from_proto(response)

    async def step(
        self, episode_id: str, turn: int, action: Message, timeout_s: float | None = None
    ) -> StepResult:
        request = pb.StepEpisodeRequest(episode_id=episode_id, turn=turn, action=message_to_proto(action))
        with domain_errors():
            response = await self._stub.StepEpisode(request, timeout=timeout_s)
        return step_from_proto(response)

    async def end(self, episode_id: str, timeout_s: float | None = None) -> None:
        with domain_errors():
            await self._stub.EndEpisode(pb.EndEpisodeRequest(episode_id=episode_id), timeout=timeout_s)

    async def run_episode(self, call: AgentCall, timeout_s: float | None = None) -> AgentOutcome:
        """An agent host's whole episode (not idempotent: a failed one is run again under a new id)."""
        with domain_errors():
            response = await self._stub.RunEpisode(agent_call_to_proto(call), timeout=timeout_s)
        return outcome_from_proto(response)

    async def status(self, timeout_s: float | None = None) -> EnvironmentStats:
        with domain_errors():
            return stats_from_proto(await self._stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s))
