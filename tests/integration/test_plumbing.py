"""Every service's server: health, reflection, bearer-token auth, and malformed requests answered
with INVALID_ARGUMENT and a field violation, over real gRPC on 127.0.0.1."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.coordinator import server as coordinator_server
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.types import RunSpec
from pipelinerl.inference import server as inference_server
from pipelinerl.reward import server as reward_server
from pipelinerl.reward.client import RewardClient
from pipelinerl.reward.types import ScoreItem
from pipelinerl.reward.v1 import reward_pb2, reward_pb2_grpc
from pipelinerl.trainer import server as trainer_server
from tests.fakes import FakeBackend, FakeCoordinator, FakeReward, FakeTrainer

REGISTRATIONS = {
    "pipelinerl.reward.v1.RewardService": lambda: reward_server.registration(FakeReward()),
    "pipelinerl.trainer.v1.TrainerService": lambda: trainer_server.registration(FakeTrainer()),
    "pipelinerl.inference.v1.InferenceService": lambda: inference_server.registration(
        inference_server.InferenceServicer(FakeBackend())
    ),
    "pipelinerl.coordinator.v1.CoordinatorService": lambda: coordinator_server.registration(
        FakeCoordinator()
    ),
}


@pytest.mark.parametrize("service", sorted(REGISTRATIONS))
async def test_health_and_reflection(start_server, service: str) -> None:
    address = await start_server(REGISTRATIONS[service]())
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            response = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for response in reflection.ServerReflectionInfo(iter([request]), timeout=5):
            names = {s.name for s in response.list_services_response.service}
            assert service in names
            assert "grpc.health.v1.Health" in names


async def test_bearer_token_required_except_for_health(start_server) -> None:
    address = await start_server(REGISTRATIONS["pipelinerl.reward.v1.RewardService"](), auth_token="s3cret")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        for metadata in [(), (("authorization", "Bearer wrong"),)]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListVerifiers(reward_pb2.ListVerifiersRequest(), metadata=metadata, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with RewardClient(ChannelConfig(address, auth_token="s3cret")) as client:
        assert [v.name for v in await client.list_verifiers()] == ["exact"]


def field_violations(err: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    fields = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        assert detail.Unpack(bad_request)
        fields += [v.field for v in bad_request.field_violations]
    return fields


async def test_reward_malformed_request(start_server) -> None:
    address = await start_server(REGISTRATIONS["pipelinerl.reward.v1.RewardService"]())
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Score(reward_pb2.ScoreRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(err.value) == ["items"]
    async with RewardClient(address) as client:
        item = ScoreItem("a", "1+1", "2", "2", "exact")
        with pytest.raises(InvalidArgument) as exc:
            await client.score([item, item])
        assert exc.value.violations[0].field == "items[1].sample_id"
        [result] = await client.score([item])
        assert result.reward == 1.0 and result.error is None


async def test_coordinator_malformed_request(start_server) -> None:
    address = await start_server(REGISTRATIONS["pipelinerl.coordinator.v1.CoordinatorService"]())
    async with CoordinatorClient(address) as client:
        with pytest.raises(InvalidArgument) as exc:
            await client.start_run(RunSpec("builtin:digits", group_size=1), run_id="r1")
        assert [v.field for v in exc.value.violations] == ["spec.group_size"]
        with pytest.raises(InvalidArgument) as exc:
            await client.get_run("not a valid id!")
        assert [v.field for v in exc.value.violations] == ["run_id"]
        run = await client.start_run(RunSpec("builtin:digits", group_size=4), run_id="r1")
        assert (await client.get_run("r1")).spec == run.spec
        assert [r.progress.trained async for r in client.watch_run("r1")] == [1, 2]
