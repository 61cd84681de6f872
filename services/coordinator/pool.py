"""The coordinator's view of N inference servers: one Generate stream each, least-loaded routing
within the capacity each advertises, and reconnection when a server goes away.

    generate(request) ─► wait for a server with a free slot ─► least loaded (in_flight / window)
                          └─► its GenerateSession ─► Completion
                               │ server gone (UNAVAILABLE)
                               └─► mark it down, reconnect in the background, retry elsewhere
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.inference.client import GenerateSession, InferenceClient
from pipelinerl.inference.types import Completion, GenerationRequest

log = get_logger(__name__)

RECONNECT_S = 1.0
STATUS_EVERY_S = 1.0


@dataclass
class _Server:
    address: str
    client: InferenceClient
    session: GenerateSession | None = None
    in_flight: int = 0
    version: int = -1
    connect_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def free(self) -> int:
        return 0 if self.session is None else self.session.window - self.in_flight


class InferencePool:
    def __init__(self, configs: list[ChannelConfig]) -> None:
        if not configs:
            raise ValueError("at least one inference server is needed")
        self._servers = [_Server(c.address, InferenceClient(c)) for c in configs]
        self._changed = asyncio.Condition()
        self._status_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for server in self._servers:
            server.connect_task = asyncio.create_task(self._connect(server))
        self._status_task = asyncio.create_task(self._poll_status())

    async def close(self) -> None:
        tasks = [t for t in (self._status_task, *(s.connect_task for s in self._servers)) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._servers:
            if server.session is not None:
                await server.session.__aexit__(None, None, None)
            await server.client.close()

    def snapshot(self) -> list[tuple[str, int, int]]:
        """(address, weight version, requests in flight) of every server."""
        return [(s.address, s.version, s.in_flight) for s in self._servers]

    async def generate(self, request: GenerationRequest) -> tuple[str, Completion]:
        """Run `request` on the least-loaded server with room; retried elsewhere if its server goes away."""
        while True:
            server = await self._reserve()
            try:
                assert server.session is not None
                return server.address, await server.session.generate(request)
            except PipelineError as exc:
                if exc.code != "UNAVAILABLE":
                    raise
                log.warning(
                    "inference server lost; retrying elsewhere", server=server.address, error=exc.message
                )
                await self._mark_down(server)
            finally:
                async with self._changed:
                    server.in_flight -= 1
                    # One slot freed: wake one waiter, not all (hundreds wait in pipeline mode).
                    self._changed.notify(1)

    async def wait_for_version(self, version: int) -> None:
        """Until every connected server serves `version` or newer (the sync baseline's barrier)."""
        while any(s.session is not None and s.version < version for s in self._servers):
            await asyncio.sleep(0.05)
            await self._refresh_status()

    async def _reserve(self) -> _Server:
        async with self._changed:
            try:
                await self._changed.wait_for(lambda: any(s.free > 0 for s in self._servers))
            except asyncio.CancelledError:
                self._changed.notify(1)  # pass on the wakeup this waiter may have been given
                raise
            server = max(self._servers, key=lambda s: s.free / max(s.session.window, 1) if s.session else -1)
            server.in_flight += 1
            return server

    async def _connect(self, server: _Server) -> None:
        while True:
            session = server.client.session()
            try:
                await session.__aenter__()
            except PipelineError as exc:
                log.info("inference server not reachable yet", server=server.address, error=exc.message)
                await asyncio.sleep(RECONNECT_S)
                continue
            async with self._changed:
                server.session = session
                self._changed.notify_all()
            log.info("inference server connected", server=server.address, window=session.window)
            return

    async def _mark_down(self, server: _Server) -> None:
        async with self._changed:
            session, server.session = server.session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await session.__aexit__(None, None, None)
            server.connect_task = asyncio.create_task(self._connect(server))

    async def _poll_status(self) -> None:
        while True:
            await self._refresh_status()
            await asyncio.sleep(STATUS_EVERY_S)

    async def _refresh_status(self) -> None:
        for server in self._servers:
            if server.session is None:
                continue
            with contextlib.suppress(PipelineError):
                server.version = (await server.client.status(timeout_s=2.0)).weight_version.version
