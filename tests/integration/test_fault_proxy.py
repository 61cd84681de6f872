"""The chaos soak's fault proxy (benchmarks/fault_proxy.py) in front of an echo server and a gRPC
server on 127.0.0.1: bytes and gRPC pass unchanged with no fault on; latency delays without closing;
a stall forwards nothing and keeps the connection open; reset and drop close it, with RST and FIN."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from benchmarks.fault_proxy import Fault, FaultProxy


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.fixture
async def echo_address() -> AsyncIterator[str]:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


@pytest.fixture
async def proxy_to() -> AsyncIterator[Callable[[Callable[[], str | None]], FaultProxy]]:
    proxies: list[FaultProxy] = []

    def make(upstream: Callable[[], str | None]) -> FaultProxy:
        proxies.append(FaultProxy(upstream))
        return proxies[-1]

    yield make
    for proxy in proxies:
        await proxy.close()


async def connect(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), 10)


async def test_bytes_pass_unchanged_both_ways_with_no_fault_on(echo_address: str, proxy_to) -> None:
    proxy = proxy_to(lambda: echo_address)
    reader, writer = await connect(proxy)  # before start: it waits in the backlog
    await proxy.start()
    data = os.urandom(3 * 1024 * 1024)
    assert await round_trip(reader, writer, data) == data
    writer.close()


async def test_a_connection_waits_until_the_upstream_address_is_known(echo_address: str, proxy_to) -> None:
    known: list[str] = []
    proxy = proxy_to(lambda: known[0] if known else None)
    await proxy.start()
    reader, writer = await connect(proxy)
    writer.write(b"early")
    await asyncio.sleep(0.3)
    known.append(echo_address)
    assert await asyncio.wait_for(reader.readexactly(5), 10) == b"early"
    writer.close()


async def test_latency_delays_each_chunk_then_goes_when_switched_off(echo_address: str, proxy_to) -> None:
    proxy = proxy_to(lambda: echo_address)
    await proxy.start()
    reader, writer = await connect(proxy)
    proxy.set_fault(Fault.LATENCY, delay_s=0.2)
    started = time.monotonic()
    assert await round_trip(reader, writer, b"ping") == b"ping"
    assert time.monotonic() - started >= 0.4  # 0.2 s each way
    proxy.set_fault(None)
    started = time.monotonic()
    assert await round_trip(reader, writer, b"pong") == b"pong"
    assert time.monotonic() - started < 0.2
    writer.close()


async def test_a_stall_forwards_nothing_and_keeps_the_connection_open(echo_address: str, proxy_to) -> None:
    proxy = proxy_to(lambda: echo_address)
    await proxy.start()
    reader, writer = await connect(proxy)
    assert await round_trip(reader, writer, b"before") == b"before"
    proxy.set_fault(Fault.STALL)
    writer.write(b"held")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(4), 0.5)  # neither data nor EOF: the connection is open
    proxy.set_fault(None)
    assert await asyncio.wait_for(reader.readexactly(4), 10) == b"held"
    writer.close()


@pytest.mark.parametrize("fault", [Fault.RESET, Fault.DROP])
async def test_reset_and_drop_close_open_and_new_connections(
    echo_address: str, proxy_to, fault: Fault
) -> None:
    proxy = proxy_to(lambda: echo_address)
    await proxy.start()
    reader, writer = await connect(proxy)
    assert await round_trip(reader, writer, b"hello") == b"hello"
    proxy.set_fault(fault)
    for _ in range(2):  # the open connection, then one made while the fault is on
        if fault is Fault.RESET:
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(1), 10)
        else:
            assert await asyncio.wait_for(reader.read(1), 10) == b""  # FIN: a clean end of stream
        writer.close()
        reader, writer = await connect(proxy)
    proxy.set_fault(None)
    reader, writer = await connect(proxy)
    assert await round_trip(reader, writer, b"again") == b"again"
    writer.close()


async def test_grpc_unary_calls_and_streams_pass_with_no_fault_on(proxy_to) -> None:
    server = grpc.aio.server()
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await health.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
        proxy = proxy_to(lambda: f"127.0.0.1:{port}")
        await proxy.start()
        async with grpc.aio.insecure_channel(proxy.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="svc")
            answer = await stub.Check(request, timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch = stub.Watch(request, timeout=10)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await health.set("svc", health_pb2.HealthCheckResponse.SERVING)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
    finally:
        await server.stop(0)
