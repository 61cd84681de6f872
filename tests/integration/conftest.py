"""Servers on 127.0.0.1 with ephemeral ports, stopped by their own handle after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from pipelinerl.common.server import GrpcServer, Registration
from pipelinerl.common.settings import ServiceSettings

StartServer = Callable[..., "AsyncIterator[str]"]


@pytest.fixture
async def start_server() -> AsyncIterator[Callable[..., object]]:
    """`address = await start_server(registration, auth_token=None)`."""
    servers: list[GrpcServer] = []

    async def start(registration: Registration, **settings: object) -> str:
        server = GrpcServer(
            ServiceSettings(host="127.0.0.1", port=0, drain_seconds=1, **settings), [registration]
        )
        await server.start()
        servers.append(server)
        return server.address

    yield start
    for server in servers:
        await server.stop(grace=0)
