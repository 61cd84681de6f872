"""gRPC servicer of the environment service: proto <-> domain conversion around an `EpisodeTable`
(StartEpisode, StepEpisode) or an `AgentHost` (RunEpisode)."""

from __future__ import annotations

import grpc

from pipelinerl.common.errors import InvalidArgument, PipelineError
from pipelinerl.common.server import Registration
from pipelinerl.environment.agent_host import AgentHost
from pipelinerl.environment.convert import (
    agent_call_from_proto,
    info_to_proto,
    message_from_proto,
    opening_to_proto,
    outcome_to_proto,
    stats_to_proto,
    step_to_proto,
)
from pipelinerl.environment.episodes import EpisodeTable
from pipelinerl.environment.v1 import environment_pb2 as pb
from pipelinerl.environment.v1 import environment_pb2_grpc


class Unimplemented(PipelineError):
    code = "UNIMPLEMENTED"


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, episodes: EpisodeTable | AgentHost) -> None:
        self._episodes = episodes

    async def DescribeEnvironment(
        self, request: pb.DescribeEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeEnvironmentResponse:
        return info_to_proto(self._episodes.info)

    async def StartEpisode(
        self, request: pb.StartEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartEpisodeResponse:
        opening = await self._table().start(request.episode_id, request.seed, request.task)
        return opening_to_proto(opening)

    async def StepEpisode(
        self, request: pb.StepEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.StepEpisodeResponse:
        try:
            action = message_from_proto(request.action)
        except InvalidArgument as exc:
            raise exc.under("action") from None
        return step_to_proto(await self._table().step(request.episode_id, request.turn, action))

    async def EndEpisode(
        self, request: pb.EndEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndEpisodeResponse:
        if isinstance(self._episodes, EpisodeTable):  # an agent host holds no episode to end
            await self._episodes.end(request.episode_id)
        return pb.EndEpisodeResponse()

    async def RunEpisode(
        self, request: pb.RunEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RunEpisodeResponse:
        if not isinstance(self._episodes, AgentHost):
            raise Unimplemented("this server serves StartEpisode and StepEpisode; it runs no agent")
        return outcome_to_proto(await self._episodes.run(agent_call_from_proto(request)))

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        return stats_to_proto(self._episodes.stats)

    def _table(self) -> EpisodeTable:
        if not isinstance(self._episodes, EpisodeTable):
            raise Unimplemented("this server is an agent host: it runs whole episodes (RunEpisode)")
        return self._episodes


def registration(episodes: EpisodeTable | AgentHost) -> Registration:
    return Registration(
        pb.DESCRIPTOR.services_by_name["EnvironmentService"].full_name,
        lambda server: environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(
            EnvironmentServicer(episodes), server
        ),
    )
