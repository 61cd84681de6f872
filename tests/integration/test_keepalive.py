"""Keepalive between a client channel and a service's server, over real gRPC on 127.0.0.1: a
stream to a server the network stopped carrying for fails UNAVAILABLE within the keepalive bound;
a server takes pings at the shortest interval a client may be set to, on a stream and on a
connection without calls, without ending the connection as abuse (`too_many_pings`)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.fault_proxy import Fault, FaultProxy
from pipelinerl.common.channel import ChannelConfig, open_channel
from pipelinerl.common.keepalive import MIN_PING_INTERVAL_S, Keepalive
from pipelinerl.reward import server as reward_server
from tests.fakes import FakeReward

QUICK = Keepalive(time_s=1.0, timeout_s=1.0)
SLACK_S = 2.0
"""For a 2-core box shared with other work."""


def watch(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamCall:
    """A long-lived stream every server has: health Watch, which sends only on a change."""
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Watch(health_pb2.HealthCheckRequest())  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's HealthStub omits the methods its __init__ sets


async def test_a_stream_through_a_stalled_network_fails_within_the_keepalive_bound(start_server) -> None:
    address = await start_server(reward_server.registration(FakeReward()))
    proxy = FaultProxy(lambda: address)
    await proxy.start()
    try:
        async with open_channel(ChannelConfig(proxy.address, keepalive=QUICK)) as channel:
            call = watch(channel)
            assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            proxy.set_fault(Fault.STALL)  # both sockets stay open; nothing is forwarded
            stalled = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(call.read(), QUICK.time_s + QUICK.timeout_s + SLACK_S)
            assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value
            assert time.monotonic() - stalled <= QUICK.time_s + QUICK.timeout_s + SLACK_S
    finally:
        await proxy.close()


async def test_a_server_takes_pings_as_often_as_a_client_may_send_them(start_server) -> None:
    address = await start_server(reward_server.registration(FakeReward()))
    often = Keepalive(time_s=MIN_PING_INTERVAL_S, timeout_s=1.0)
    async with open_channel(ChannelConfig(address, keepalive=often)) as channel:
        call = watch(channel)
        assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
        # Five pings on a stream that carries nothing: a third one too soon would end it.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call.read(), 5 * MIN_PING_INTERVAL_S)
        call.cancel()
        await asyncio.sleep(5 * MIN_PING_INTERVAL_S)  # five more with no call open
        assert channel.get_state() is grpc.ChannelConnectivity.READY
