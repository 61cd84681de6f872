"""The coordinator's view of N inference servers: one Generate stream each, least-loaded routing
within the capacity each advertises, and reconnection when a server goes away.

    generate(request) ─► wait for a server with a free slot ─► least loaded (in_flight / window)
                          └─► its GenerateSession ─► Completion
                               │ server gone (stream ended: drain, crash, restart), busy, or aborted
                               └─► retry on a server with room; the stream is reopened once it ended

A server going away never fails an attempt: the attempt runs again elsewhere, or on the same
server once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import PipelineError, Unavailable
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import FinishReason
from pipelinerl.inference.client import GenerateSession, InferenceClient
from pipelinerl.inference.types import Completion, GenerationRequest

log = get_logger(__name__)

RECONNECT_S = 1.0
BUSY_RETRY_S = 0.5
STATUS_EVERY_S = 1.0
# Per-request codes that say the server cannot run it now, not that the request is bad.
_RETRIED = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED")


@dataclass(frozen=True)
class ServerLimits:
    """What every inference server that has connected accepts: the smallest of their limits."""

    max_new_tokens: int
    max_context: int


@dataclass
class _Server:
    address: str
    client: InferenceClient
    session: GenerateSession | None = None
    in_flight: int = 0
    version: int = -1
    limits: ServerLimits | None = None
    """As last advertised; kept while the server is away."""
    task: asyncio.Task[None] | None = field(default=None, repr=False)

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
            server.task = asyncio.create_task(self._keep_connected(server))
        self._status_task = asyncio.create_task(self._poll_status())

    async def close(self) -> None:
        tasks = [t for t in (self._status_task, *(s.task for s in self._servers)) if t is not None]
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

    async def limits(self, timeout_s: float) -> ServerLimits:
        """The limits of every server, waiting up to `timeout_s` for each to connect once (then
        those that did); Unavailable if none did."""
        deadline = time.monotonic() + timeout_s
        while not all(s.limits for s in self._servers) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        known = [s.limits for s in self._servers if s.limits is not None]
        if not known:
            raise Unavailable(f"no inference server connected within {timeout_s:g}s")
        return ServerLimits(min(k.max_new_tokens for k in known), min(k.max_context for k in known))

    async def generate(self, request: GenerationRequest) -> tuple[str, Completion]:
        """Run `request` on the least-loaded server with room; run again, on whichever server has
        room then, if its server goes away, is busy or aborts it."""
        while True:
            server, session = await self._reserve()
            try:
                completion = await session.generate(request)
                if completion.finish_reason is not FinishReason.ABORT:
                    return server.address, completion
                # Never one we cancelled (that raises CancelledError here): the server gave up on it.
                code, why = "ABORTED", "the server aborted the generation"
            except PipelineError as exc:
                if exc.code not in _RETRIED:
                    raise
                code, why = exc.code, exc.message
                if code == "UNAVAILABLE" and session.window > 0:
                    # The server failed the request, not the stream: take nothing new there, and let
                    # the stream end once idle, so that it is reopened (a drain ends it anyway).
                    await session.close_when_idle()
            finally:
                async with self._changed:
                    server.in_flight -= 1
                    # One slot freed: wake one waiter, not all (hundreds wait in pipeline mode).
                    self._changed.notify(1)
            log.warning(
                "generation interrupted; retrying", server=server.address, code=code, error=why,
                sample_id=request.request_id,
            )  # fmt: skip
            if code != "UNAVAILABLE":  # the server may still look free: do not spin on it
                await asyncio.sleep(BUSY_RETRY_S)

    async def wait_for_version(self, version: int) -> None:
        """Until every connected server serves `version` or newer (the sync baseline's barrier)."""
        while any(s.session is not None and s.version < version for s in self._servers):
            await asyncio.sleep(0.05)
            await self._refresh_status()

    async def _reserve(self) -> tuple[_Server, GenerateSession]:
        async with self._changed:
            try:
                await self._changed.wait_for(lambda: any(s.free > 0 for s in self._servers))
            except asyncio.CancelledError:
                self._changed.notify(1)  # pass on the wakeup this waiter may have been given
                raise
            server = max(self._servers, key=lambda s: s.free / max(s.session.window, 1) if s.session else -1)
            assert server.session is not None
            server.in_flight += 1
            return server, server.session

    async def _keep_connected(self, server: _Server) -> None:
        """One Generate stream to `server` at a time: open it, wait until it ends, open another."""
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
                server.limits = ServerLimits(session.max_new_tokens, session.max_context)
                self._changed.notify_all()
            log.info("inference server connected", server=server.address, window=session.window)
            why = await session.wait_closed()
            async with self._changed:
                server.session = None
            await session.__aexit__(None, None, None)
            log.warning("inference server stream ended; reconnecting", server=server.address, error=why)
            await asyncio.sleep(RECONNECT_S)

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
