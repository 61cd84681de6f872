"""gRPC servicer of the reward service: proto <-> domain conversion around a `RewardCore`."""

from __future__ import annotations

import grpc

from pipelinerl.common.server import Registration
from pipelinerl.reward.convert import item_from_proto, result_to_proto, stats_to_proto, verifier_to_proto
from pipelinerl.reward.types import RewardCore
from pipelinerl.reward.v1 import reward_pb2 as pb
from pipelinerl.reward.v1 import reward_pb2_grpc


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, core: RewardCore) -> None:
        self._core = core

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        results = await self._core.score([item_from_proto(item) for item in request.items])
        return pb.ScoreResponse(results=[result_to_proto(r) for r in results])

    async def ListVerifiers(
        self, request: pb.ListVerifiersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListVerifiersResponse:
        verifiers = sorted(self._core.list_verifiers(), key=lambda v: v.name)
        return pb.ListVerifiersResponse(verifiers=[verifier_to_proto(v) for v in verifiers])

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        return stats_to_proto(self._core.stats)


def registration(core: RewardCore) -> Registration:
    return Registration(
        pb.DESCRIPTOR.services_by_name["RewardService"].full_name,
        lambda server: reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(core), server),
    )
