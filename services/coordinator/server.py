"""gRPC servicer of the coordinator: proto <-> domain conversion around a `CoordinatorCore`."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta

import grpc

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.common.server import Registration
from pipelinerl.coordinator.convert import (
    evaluation_from_proto,
    evaluation_result_to_proto,
    role_from_proto,
    run_id_from_proto,
    run_to_proto,
    spec_from_proto,
)
from pipelinerl.coordinator.membership import Membership
from pipelinerl.coordinator.types import CoordinatorCore, InferenceRole
from pipelinerl.coordinator.v1 import coordinator_pb2 as pb
from pipelinerl.coordinator.v1 import coordinator_pb2_grpc


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(
        self, core: CoordinatorCore, memberships: Mapping[InferenceRole, Membership] | None = None
    ) -> None:
        """RegisterInferenceServer adds to the membership of the server's role: FAILED_PRECONDITION
        for a role without one."""
        self._core = core
        self._memberships = memberships or {}

    async def StartRun(
        self, request: pb.StartRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartRunResponse:
        run_id = run_id_from_proto(request.run_id) if request.run_id else uuid.uuid4().hex[:12]
        run = await self._core.start_run(run_id, spec_from_proto(request.spec))
        return pb.StartRunResponse(run=run_to_proto(run))

    async def GetRun(self, request: pb.GetRunRequest, context: grpc.aio.ServicerContext) -> pb.GetRunResponse:
        return pb.GetRunResponse(run=run_to_proto(self._core.get_run(run_id_from_proto(request.run_id))))

    async def StopRun(
        self, request: pb.StopRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopRunResponse:
        run = await self._core.stop_run(run_id_from_proto(request.run_id))
        return pb.StopRunResponse(run=run_to_proto(run))

    async def WatchRun(
        self, request: pb.WatchRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchRunResponse]:
        async for run in self._core.watch_run(run_id_from_proto(request.run_id)):
            yield pb.WatchRunResponse(run=run_to_proto(run))

    async def Evaluate(
        self, request: pb.EvaluateRequest, context: grpc.aio.ServicerContext
    ) -> pb.EvaluateResponse:
        result = await self._core.evaluate(evaluation_from_proto(request.evaluation))
        return pb.EvaluateResponse(result=evaluation_result_to_proto(result))

    async def RegisterInferenceServer(
        self, request: pb.RegisterInferenceServerRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterInferenceServerResponse:
        role = role_from_proto(request.role)
        membership = self._memberships.get(role)
        if membership is None:
            raise FailedPrecondition(f"this coordinator takes no registrations of {role.value} servers")
        lease_s = membership.register(request.address, request.leaving)
        response = pb.RegisterInferenceServerResponse()
        response.lease.FromTimedelta(timedelta(seconds=lease_s))
        return response


def registration(
    core: CoordinatorCore, memberships: Mapping[InferenceRole, Membership] | None = None
) -> Registration:
    return Registration(
        pb.DESCRIPTOR.services_by_name["CoordinatorService"].full_name,
        lambda server: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
            CoordinatorServicer(core, memberships), server
        ),
    )
