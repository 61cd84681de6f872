"""An environment server that answers the wrong turn, for the hostile-environment end-to-end tests.

The Python SDK server always answers the turn it is asked, so this one is served differently: the
SDK server's own servicer and episode table, except that every StepEpisode of an episode of
`bad_seed` says it answers the next turn (an off-by-one in the server's turn count: it counts the
opening as turn 1). The coordinator cannot tell which turn's reply it holds, so the reply is
broken, whatever its messages.

    server = wrong_turn_server(EnvironmentSettings(env="path/to/file.py:Class", port=0), bad_seed)
    await server.start()  # served in the caller's event loop; server.address to reach it
    ...
    await server.stop(0)
"""

from __future__ import annotations

import grpc

from pipelinerl.common.server import GrpcServer, Registration
from pipelinerl.environment.config import EnvironmentSettings
from pipelinerl.environment.episodes import EpisodeTable
from pipelinerl.environment.loader import load_environment
from pipelinerl.environment.server import EnvironmentServicer
from pipelinerl.environment.v1 import environment_pb2 as pb
from pipelinerl.environment.v1 import environment_pb2_grpc


class WrongTurnServicer(EnvironmentServicer):
    def __init__(self, episodes: EpisodeTable, bad_seed: int) -> None:
        super().__init__(episodes)
        self._bad_seed = bad_seed
        self._bad: set[str] = set()
        """Ids of the episodes of `bad_seed`."""

    async def StartEpisode(
        self, request: pb.StartEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartEpisodeResponse:
        response = await super().StartEpisode(request, context)
        if request.seed == self._bad_seed:
            self._bad.add(request.episode_id)
        return response

    async def StepEpisode(
        self, request: pb.StepEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.StepEpisodeResponse:
        response = await super().StepEpisode(request, context)
        if request.episode_id in self._bad:
            response.turn = request.turn + 1
        return response


def wrong_turn_server(settings: EnvironmentSettings, bad_seed: int) -> GrpcServer:
    """The environment server of `settings.env`, answering every turn of `bad_seed` as the next."""
    cls = load_environment(settings.env, settings.env_args)
    episodes = EpisodeTable(cls, settings.env_args, settings.limits())
    servicer = WrongTurnServicer(episodes, bad_seed)
    service = pb.DESCRIPTOR.services_by_name["EnvironmentService"].full_name
    registration = Registration(
        service,
        lambda server: environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server),
    )
    return GrpcServer(settings, [registration], on_close=[episodes.close])
