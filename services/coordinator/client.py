"""Typed asyncio client of the coordinator, used by `pipelinerl run`, `pipelinerl eval` and the tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pipelinerl.common.channel import ChannelConfig, ServiceClient
from pipelinerl.common.status import domain_errors
from pipelinerl.coordinator.convert import (
    evaluation_result_from_proto,
    evaluation_to_proto,
    role_to_proto,
    run_from_proto,
    spec_to_proto,
)
from pipelinerl.coordinator.types import EvaluationResult, EvaluationSpec, InferenceRole, RunInfo, RunSpec
from pipelinerl.coordinator.v1 import coordinator_pb2 as pb
from pipelinerl.coordinator.v1 import coordinator_pb2_grpc


class CoordinatorClient(ServiceClient):
    def __init__(self, config: ChannelConfig | str) -> None:
        super().__init__(config)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    async def start_run(self, spec: RunSpec, run_id: str = "", timeout_s: float | None = None) -> RunInfo:
        with domain_errors():
            response = await self._stub.StartRun(
                pb.StartRunRequest(run_id=run_id, spec=spec_to_proto(spec)), timeout=timeout_s
            )
        return run_from_proto(response.run)

    async def get_run(self, run_id: str, timeout_s: float | None = None) -> RunInfo:
        with domain_errors():
            response = await self._stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=timeout_s)
        return run_from_proto(response.run)

    async def stop_run(self, run_id: str, timeout_s: float | None = None) -> RunInfo:
        with domain_errors():
            response = await self._stub.StopRun(pb.StopRunRequest(run_id=run_id), timeout=timeout_s)
        return run_from_proto(response.run)

    async def evaluate(self, spec: EvaluationSpec, timeout_s: float | None = None) -> EvaluationResult:
        """`spec`'s set evaluated once on the coordinator's inference servers (Evaluate)."""
        request = pb.EvaluateRequest(evaluation=evaluation_to_proto(spec))
        with domain_errors():
            response = await self._stub.Evaluate(request, timeout=timeout_s)
        return evaluation_result_from_proto(response.result)

    async def register_inference_server(
        self,
        address: str,
        leaving: bool = False,
        timeout_s: float | None = None,
        role: InferenceRole = InferenceRole.TRAINING,
    ) -> float:
        """Join the pool of `role` (or renew, or leave it); the lease granted, in seconds."""
        request = pb.RegisterInferenceServerRequest(
            address=address, leaving=leaving, role=role_to_proto(role)
        )
        with domain_errors():
            response = await self._stub.RegisterInferenceServer(request, timeout=timeout_s)
        return response.lease.ToTimedelta().total_seconds()

    async def watch_run(self, run_id: str) -> AsyncIterator[RunInfo]:
        with domain_errors():
            async for response in self._stub.WatchRun(pb.WatchRunRequest(run_id=run_id)):
                yield run_from_proto(response.run)
