"""gRPC servicer of the reward service: proto <-> domain conversion around a `RewardCore`."""

from __future__ import annotations

import grpc

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.server import Registration
from pipelinerl.reward.convert import item_from_proto, result_to_proto, verifier_to_proto
from pipelinerl.reward.types import RewardCore
from pipelinerl.reward.v1 import reward_pb2 as pb
from pipelinerl.reward.v1 import reward_pb2_grpc

MAX_ITEMS = 4096


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, core: RewardCore) -> None:
        self._core = core

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        if not 1 <= len(request.items) <= MAX_ITEMS:
            raise InvalidArgument.field(
                "items", f"must hold 1 to {MAX_ITEMS} items, not {len(request.items)}"
            )
        seen: set[str] = set()
        for i, item in enumerate(request.items):
            if not item.sample_id:
                raise InvalidArgument.field(f"items[{i}].sample_id", "must not be empty")
            if item.sample_id in seen:
                raise InvalidArgument.field(f"items[{i}].sample_id", f"duplicate id {item.sample_id!r}")
            seen.add(item.sample_id)
        results = await self._core.score([item_from_proto(item) for item in request.items])
        return pb.ScoreResponse(results=[result_to_proto(r) for r in results])

    async def ListVerifiers(
        self, request: pb.ListVerifiersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListVerifiersResponse:
        verifiers = sorted(self._core.list_verifiers(), key=lambda v: v.name)
        return pb.ListVerifiersResponse(verifiers=[verifier_to_proto(v) for v in verifiers])


def registration(core: RewardCore) -> Registration:
    return Registration(
        pb.DESCRIPTOR.services_by_name["RewardService"].full_name,
        lambda server: reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(core), server),
    )
