"""Every service's server: health, reflection, bearer-token auth (sent by the client channel on every
call type), and malformed requests (bytes that do not parse included) answered with
INVALID_ARGUMENT, over real gRPC on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from pipelinerl.common.channel import ChannelConfig, open_channel
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.server import GrpcServer, Registration
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.coordinator import server as coordinator_server
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.types import RunSpec
from pipelinerl.inference import server as inference_server
from pipelinerl.inference.v1 import inference_pb2, inference_pb2_grpc
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


async def test_reflection_answers_under_v1_too(start_server) -> None:
    """grpc.reflection.v1 (what current grpcurl asks first) as well as v1alpha."""
    address = await start_server(REGISTRATIONS["pipelinerl.reward.v1.RewardService"]())
    async with grpc.aio.insecure_channel(address) as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in info(iter([request]), timeout=5)]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"pipelinerl.reward.v1.RewardService", "grpc.reflection.v1.ServerReflection"} <= names


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


async def _echo_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def _echo_stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
    yield request


async def _join(requests, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[no-untyped-def]
    return b"".join([r async for r in requests])


async def _echo_each(requests, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
    async for request in requests:
        yield request


ECHO = Registration(
    "test.Echo",
    lambda server: server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Echo",
                {
                    "UnaryUnary": grpc.unary_unary_rpc_method_handler(_echo_unary),
                    "UnaryStream": grpc.unary_stream_rpc_method_handler(_echo_stream),
                    "StreamUnary": grpc.stream_unary_rpc_method_handler(_join),
                    "StreamStream": grpc.stream_stream_rpc_method_handler(_echo_each),
                },
            )
        ]
    ),
)


async def _call_each_type(channel: grpc.aio.Channel) -> list[list[bytes]]:
    """One call of each of the four types on raw bytes, each answered with what it echoed."""

    async def listed(call) -> list[bytes]:  # type: ignore[no-untyped-def]
        return [r async for r in call]

    return [
        [await channel.unary_unary("/test.Echo/UnaryUnary")(b"a", timeout=5)],
        await listed(channel.unary_stream("/test.Echo/UnaryStream")(b"b", timeout=5)),
        [await channel.stream_unary("/test.Echo/StreamUnary")(iter([b"c"]), timeout=5)],
        await listed(channel.stream_stream("/test.Echo/StreamStream")(iter([b"d"]), timeout=5)),
    ]


async def test_every_call_type_carries_the_bearer_token(start_server) -> None:
    address = await start_server(ECHO, auth_token="s3cret")
    async with open_channel(ChannelConfig(address, auth_token="s3cret")) as channel:
        assert await _call_each_type(channel) == [[b"a"], [b"b"], [b"c"], [b"d"]]
    # The server does check: without the right token, no call type gets through.
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        async with open_channel(ChannelConfig(address, auth_token="wrong", max_attempts=1)) as channel:
            call = getattr(channel, kind)(f"/test.Echo/{kind.title().replace('_', '')}")
            request = b"x" if kind.startswith("unary_") else iter([b"x"])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                response = call(request, timeout=5)
                _ = [r async for r in response] if kind.endswith("_stream") else await response
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _every_method() -> list[tuple[str, str, bool, bool]]:
    pool = descriptor_pool.Default()
    return [
        (service, m.name, m.client_streaming, m.server_streaming)
        for service in sorted(REGISTRATIONS)
        for m in pool.FindServiceByName(service).methods
    ]


@pytest.mark.parametrize(("service", "method", "client_streaming", "server_streaming"), _every_method())
async def test_bytes_that_are_no_message_get_invalid_argument_and_end_the_call(
    start_server, service: str, method: str, client_streaming: bool, server_streaming: bool
) -> None:
    address = await start_server(REGISTRATIONS[service]())
    garbage = b"\xff\xff\xff"
    kind = f"{'stream' if client_streaming else 'unary'}_{'stream' if server_streaming else 'unary'}"
    async with grpc.aio.insecure_channel(address) as channel:
        multicallable = getattr(channel, kind)(f"/{service}/{method}")  # no (de)serializers: raw bytes
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if client_streaming:  # the client never half-closes: the server must end the call itself
                call = multicallable(timeout=10)
                await call.write(garbage)
                if server_streaming:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                await call
            elif server_streaming:
                _ = [r async for r in multicallable(garbage, timeout=10)]
            else:
                await multicallable(garbage, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


async def test_health_watch_streams_serving_then_not_serving() -> None:
    """Watch (what a client follows instead of polling Check) answers SERVING, then NOT_SERVING
    once the server can no longer work; grpc's handler writes with context.write, not yield."""
    settings = ServiceSettings(host="127.0.0.1", port=0, drain_seconds=1)
    server = GrpcServer(settings, [REGISTRATIONS["pipelinerl.reward.v1.RewardService"]()])
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            request = health_pb2.HealthCheckRequest(service="")
            watch = health_pb2_grpc.HealthStub(channel).Watch(request, timeout=10)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await server.set_not_serving("the test says so")
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
    finally:
        await server.stop(grace=0)


async def test_inference_status_reports_the_servers_capacity(start_server) -> None:
    address = await start_server(REGISTRATIONS["pipelinerl.inference.v1.InferenceService"]())
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        status = await stub.GetStatus(inference_pb2.GetStatusRequest(), timeout=5)
    assert status.max_running == FakeBackend.limits.max_running == 4  # was always 0


def test_a_service_on_port_0_writes_its_address_to_the_ready_file(tmp_path: Path) -> None:
    ready = tmp_path / "reward.address"
    command = [sys.executable, "-m", "pipelinerl.reward", "--port", "0", "--ready-file", str(ready)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if ready.exists() or process.poll() is not None:
                break
            time.sleep(0.05)
        address = ready.read_text().strip()
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        health = subprocess.run(
            [Path(sys.executable).parent / "pipelinerl", "health", address], capture_output=True, timeout=60
        )
        assert health.returncode == 0, health.stderr.decode()[-2000:]
    finally:
        process.terminate()  # by handle
        process.wait(timeout=30)
