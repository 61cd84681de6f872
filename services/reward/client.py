"""Typed asyncio client of the reward service, used by the coordinator and the tests."""

from __future__ import annotations

from pipelinerl.common.channel import ChannelConfig, ServiceClient
from pipelinerl.common.status import domain_errors
from pipelinerl.reward.convert import item_to_proto, result_from_proto, stats_from_proto, verifier_from_proto
from pipelinerl.reward.types import ScoreItem, ScoreResult, ScorerStats, VerifierInfo
from pipelinerl.reward.v1 import reward_pb2 as pb
from pipelinerl.reward.v1 import reward_pb2_grpc


class RewardClient(ServiceClient):
    """Raises `pipelinerl.common.errors.*` when a whole call fails; per-item errors are in results."""

    def __init__(self, config: ChannelConfig | str) -> None:
        super().__init__(config)
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)

    async def score(self, items: list[ScoreItem], timeout_s: float | None = None) -> list[ScoreResult]:
        with domain_errors():
            response = await self._stub.Score(
                pb.ScoreRequest(items=[item_to_proto(i) for i in items]), timeout=timeout_s
            )
        return [result_from_proto(r) for r in response.results]

    async def list_verifiers(self, timeout_s: float | None = None) -> list[VerifierInfo]:
        with domain_errors():
            response = await self._stub.ListVerifiers(pb.ListVerifiersRequest(), timeout=timeout_s)
        return [verifier_from_proto(v) for v in response.verifiers]

    async def status(self, timeout_s: float | None = None) -> ScorerStats:
        with domain_errors():
            return stats_from_proto(await self._stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s))
