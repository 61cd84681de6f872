"""Client side of grpc.health.v1: one check of a service's health, and waiting until it reports SERVING
(launchers, the supervisor, probes, tests)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipelinerl.common.channel import ChannelConfig, open_channel


async def wait_until_serving(
    address: str,
    service: str = "",
    timeout_s: float = 0.0,
    auth_token: str | None = None,
    tls_ca_file: Path | None = None,
) -> bool:
    """True once `service` on `address` is SERVING; False if it is not within `timeout_s`. A server
    that speaks TLS is verified with `tls_ca_file` (PEM CA bundle; unset, the channel is plaintext)."""
    deadline = time.monotonic() + timeout_s
    config = ChannelConfig(address, auth_token=auth_token, tls_ca_file=tls_ca_file, max_attempts=1)
    channel = open_channel(config)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        while await check(stub, service) != "SERVING":
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.2)
        return True
    finally:
        await channel.close()


async def check(stub: health_pb2_grpc.HealthStub, service: str = "", timeout_s: float = 2.0) -> str:
    """`service`'s health as one `Check` answers it (`SERVING`, `NOT_SERVING`, ...), or why there
    was no answer (`no answer, DEADLINE_EXCEEDED`)."""
    try:
        response = await stub.Check(  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's HealthStub omits the methods its __init__ sets
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    except grpc.aio.AioRpcError as exc:
        return f"no answer, {exc.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
