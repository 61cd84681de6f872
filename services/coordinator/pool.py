"""The coordinator's view of the inference servers: one Generate stream each, least-loaded routing
within the capacity each advertises, and reconnection when a server goes away.

    generate(request) ─► wait for a server with a free slot ─► least loaded (in_flight / window)
                          └─► its GenerateSession ─► Completion
                               │ server gone (stream ended: drain, crash, restart), busy, or aborted
                               └─► retry on a server with room; the stream is reopened once it ended

A server going away never fails an attempt: the attempt runs again elsewhere, or on the same
server once it is back. Members change while runs go on (`add`, `remove`: see membership.py); a
removed server takes nothing new and leaves once its requests are done. A server takes prompts only
while the version it serves would not have its samples dropped for lag (lag_gate.py: within the
trainer's `max_lag`, and after a trainer restart not older than the restarted trainer's weights);
a joiner first fetches the current weights. A server's version is read from each completion it
returns and from its GetStatus, asked every second, or every STALE_POLL_S while a server is
behind, so that it takes prompts again soon after it has caught up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import InvalidArgument, PipelineError, Unavailable
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import FinishReason
from pipelinerl.coordinator.lag_gate import LagGate, StreamState
from pipelinerl.inference.client import GenerateSession, InferenceClient
from pipelinerl.inference.types import Completion, GenerationRequest
from pipelinerl.trainer.client import TrainerClient

log = get_logger(__name__)

RECONNECT_S = 1.0
BUSY_RETRY_S = 0.5
STATUS_EVERY_S = 1.0
STALE_POLL_S = 0.1
# Per-request codes that say the server cannot run it now, not that the request is bad.
_RETRIED = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED")


@dataclass(frozen=True)
class ServerLimits:
    """What every inference server that has connected accepts: the smallest of their limits."""

    max_new_tokens: int
    max_context: int

    def check_new_tokens(self, tokens: int, field: str) -> None:
        """InvalidArgument on `field` when `tokens` is over what the servers generate per request."""
        if tokens > self.max_new_tokens:
            raise InvalidArgument.field(
                field, f"{tokens} is over the inference servers' limit of {self.max_new_tokens}"
            )


@dataclass
class _Server:
    address: str
    client: InferenceClient
    session: GenerateSession | None = None
    in_flight: int = 0
    version: int = -1
    limits: ServerLimits | None = None
    """As last advertised; kept while the server is away."""
    leaving: bool = False
    """Removed from the pool: takes nothing new, leaves once idle."""
    admitted: bool = False
    """Whether the lag gate let it take prompts at the last poll (logged when that changes)."""
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class InferencePool:
    def __init__(
        self,
        channel: Callable[[str], ChannelConfig],
        addresses: Iterable[str] = (),
        trainer: TrainerClient | None = None,
    ) -> None:
        """`channel(address)` configures the client of a member; `trainer`, when given, is asked
        for its version and max_lag, which with `follow` decide which members may take prompts."""
        self._channel = channel
        self._trainer = trainer
        self._servers: dict[str, _Server] = {}
        self._changed = asyncio.Condition()
        self._gate = LagGate(known=trainer is None)
        self._gate_moved = asyncio.Event()
        self._status_tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._pinned_waiters = 0
        self.redispatches = 0
        """Requests run again after their server went away, was busy or aborted them."""
        for address in addresses:
            self.add(address)

    @property
    def version_floor(self) -> int:
        """Members serving an older version take no prompt."""
        return self._gate.floor

    async def start(self) -> None:
        self._started = True
        for server in self._servers.values():
            server.task = asyncio.create_task(self._keep_connected(server))
        self._status_tasks = [asyncio.create_task(self._poll_servers())]
        if self._trainer is not None:
            self._status_tasks.append(asyncio.create_task(self._poll_trainer(self._trainer)))

    def follow(self, state: StreamState) -> None:
        """What the trainer's SubmitSamples stream says (`TrainerSubmitter`'s `on_state`)."""
        self._move_gate(partial(self._gate.stream, state))

    async def close(self) -> None:
        tasks = [t for t in (*self._status_tasks, *(s.task for s in self._servers.values())) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in list(self._servers.values()):
            await self._release(server)

    @property
    def members(self) -> set[str]:
        """Addresses of the servers in the pool (those leaving excluded)."""
        return {a for a, s in self._servers.items() if not s.leaving}

    def add(self, address: str) -> None:
        """Make `address` a member; a server that is leaving stays, as the same member."""
        server = self._servers.get(address)
        if server is not None:
            server.leaving = False
            return
        server = self._servers[address] = _Server(address, InferenceClient(self._channel(address)))
        if self._started:
            server.task = asyncio.create_task(self._keep_connected(server))
        log.info("inference server joined the pool", server=address)

    def remove(self, address: str) -> None:
        """`address` takes no new request; it leaves the pool once its requests in flight are done
        (a request it then fails runs again elsewhere)."""
        server = self._servers.get(address)
        if server is None or server.leaving:
            return
        server.leaving = True
        log.info("inference server leaves the pool", server=address, in_flight=server.in_flight)
        if server.session is not None:
            asyncio.get_running_loop().create_task(server.session.close_when_idle())
        elif server.task is not None:
            server.task.cancel()

    def snapshot(self) -> list[tuple[str, int, int]]:
        """(address, weight version, requests in flight) of every server."""
        return [(s.address, s.version, s.in_flight) for s in self._servers.values()]

    async def versions(self) -> dict[str, int]:
        """The weight version of every connected server, asked of each now."""
        await self._refresh_servers()
        return {s.address: s.version for s in self._servers.values() if self._pinned(s.address)}

    def _spare_fraction(self, server: _Server, gated: bool = True) -> float:
        """Free share of `server`'s window; -1 when it may take nothing."""
        free = self._free(server, gated)
        return free / max(server.session.window, 1) if server.session is not None and free > 0 else -1.0

    def _free(self, server: _Server, gated: bool = True) -> int:
        """Requests `server` may take now: none while it leaves, is away, or (`gated`) lags the
        trainer."""
        if server.session is None or server.leaving or (gated and not self._gate.admits(server.version)):
            return 0
        return server.session.window - server.in_flight

    async def limits(self, timeout_s: float) -> ServerLimits:
        """The limits of every server, waiting up to `timeout_s` for each to connect once (then
        those that did); Unavailable if none did."""
        deadline = time.monotonic() + timeout_s
        while not (self._servers and all(s.limits for s in self._servers.values())):
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        known = [s.limits for s in self._servers.values() if s.limits is not None]
        if not known:
            raise Unavailable(f"no inference server connected within {timeout_s:g}s")
        return ServerLimits(min(k.max_new_tokens for k in known), min(k.max_context for k in known))

    async def generate(self, request: GenerationRequest, prefer: str = "") -> tuple[str, Completion]:
        """Run `request` on the least-loaded server with room, or on `prefer` (an episode's server,
        waiting for room there) while that one is a connected member; run again, on whichever
        server has room then, if its server goes away, is busy or aborts it."""
        # A request pinned to a version (an evaluation's) is trained on never: no lag gate for it,
        # or a server that holds a version for an evaluation past the trainer's max_lag would starve
        # the rest of that very evaluation.
        gated = request.weight_version is None
        while True:
            server, session = await self._reserve(prefer, gated)
            try:
                completion = await session.generate(request)
                if completion.tokens.versions:  # its last token's: the server's version now
                    server.version = max(server.version, completion.tokens.versions[-1])
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
                    # One slot freed: wake one waiter, not all (hundreds wait in pipeline mode),
                    # unless some wait for one server only (the one woken may wait for another).
                    if self._pinned_waiters:
                        self._changed.notify_all()
                    else:
                        self._changed.notify(1)
            log.warning(
                "generation interrupted; retrying", server=server.address, code=code, error=why,
                sample_id=request.request_id,
            )  # fmt: skip
            self.redispatches += 1
            if code != "UNAVAILABLE":  # the server may still look free: do not spin on it
                await asyncio.sleep(BUSY_RETRY_S)

    async def wait_for_version(self, version: int) -> None:
        """Until every connected server serves `version` or newer (the sync baseline's barrier)."""
        while any(s.session is not None and s.version < version for s in self._servers.values()):
            await asyncio.sleep(0.05)
            await self._refresh_servers()

    def _pinned(self, address: str) -> _Server | None:
        """`address`'s server while it is a connected member."""
        server = self._servers.get(address) if address else None
        return server if server is not None and server.session is not None and not server.leaving else None

    def _ready(self, prefer: str, gated: bool) -> bool:
        pinned = self._pinned(prefer)
        if pinned is not None:
            return self._free(pinned, gated) > 0
        return any(self._free(s, gated) > 0 for s in self._servers.values())

    async def _reserve(self, prefer: str = "", gated: bool = True) -> tuple[_Server, GenerateSession]:
        async with self._changed:
            self._pinned_waiters += bool(prefer)
            try:
                await self._changed.wait_for(partial(self._ready, prefer, gated))
            except asyncio.CancelledError:
                self._changed.notify(1)  # pass on the wakeup this waiter may have been given
                raise
            finally:
                self._pinned_waiters -= bool(prefer)
            spare = partial(self._spare_fraction, gated=gated)
            server = self._pinned(prefer) or max(self._servers.values(), key=spare)
            assert server.session is not None
            server.in_flight += 1
            return server, server.session

    async def _keep_connected(self, server: _Server) -> None:
        """One Generate stream to `server` at a time: open it, wait until it ends, open another;
        once the server leaves, release it."""
        try:
            await self._connect_while_member(server)
        finally:
            if server.leaving and self._servers.get(server.address) is server:
                del self._servers[server.address]
                await self._release(server)
                log.info("inference server left the pool", server=server.address)

    async def _connect_while_member(self, server: _Server) -> None:
        while not server.leaving:
            session = server.client.session()
            try:
                await session.__aenter__()
            except PipelineError as exc:
                log.info("inference server not reachable yet", server=server.address, error=exc.message)
                await asyncio.sleep(RECONNECT_S)
                continue
            await self._read_version(server)  # its version decides whether it takes prompts
            async with self._changed:
                server.session = session
                server.limits = ServerLimits(session.max_new_tokens, session.max_context)
                self._changed.notify_all()
            log.info("inference server connected", server=server.address, window=session.window)
            why = await session.wait_closed()
            async with self._changed:
                server.session = None
                self._changed.notify_all()  # those waiting for this server only take another
            await session.__aexit__(None, None, None)
            if server.leaving:
                return
            log.warning("inference server stream ended; reconnecting", server=server.address, error=why)
            await asyncio.sleep(RECONNECT_S)

    async def _release(self, server: _Server) -> None:
        if server.session is not None:
            await server.session.__aexit__(None, None, None)
            server.session = None
        await server.client.close()

    def _move_gate(self, update: Callable[[], None]) -> None:
        """Apply `update` to the gate; wake the server poll if a connected server was admitted or
        fell behind by it. (Each ack moves the floor: most moves change neither.)"""
        before = self._gate_view()
        update()
        if self._gate_view() != before:
            self._gate_moved.set()

    def _gate_view(self) -> list[tuple[bool, bool]]:
        """(admitted, behind the floor) of each connected server."""
        floor = self._gate.floor
        connected = [s for s in self._servers.values() if s.session is not None]
        return [(self._gate.admits(s.version), s.version < floor) for s in connected]

    async def _poll_trainer(self, trainer: TrainerClient) -> None:
        while True:
            with contextlib.suppress(PipelineError):
                status = await trainer.status(timeout_s=2.0)
                self._move_gate(partial(self._gate.status, status.version.version, status.max_lag))
            await asyncio.sleep(STATUS_EVERY_S)

    async def _poll_servers(self) -> None:
        """Every STATUS_EVERY_S; every STALE_POLL_S while a connected server is behind the floor; at
        once when the gate admits or holds another server, after waking the requests waiting."""
        while True:
            await self._refresh_servers()
            self._log_admissions()
            floor = self._gate.floor
            behind = any(s.session is not None and s.version < floor for s in self._servers.values())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate_moved.wait(), STALE_POLL_S if behind else STATUS_EVERY_S)
            if self._gate_moved.is_set():
                self._gate_moved.clear()
                async with self._changed:
                    self._changed.notify_all()  # a member may be admitted now

    def _log_admissions(self) -> None:
        """A line each time the lag gate starts or stops letting a connected server take prompts."""
        for server in self._servers.values():
            admitted = server.session is not None and self._gate.admits(server.version)
            if server.session is not None and admitted != server.admitted:
                event = "inference server takes prompts" if admitted else "inference server held by lag gate"
                log.info(event, server=server.address, version=server.version, floor=self._gate.floor,
                         retraining=self._gate.retraining)  # fmt: skip
            server.admitted = admitted

    async def _refresh_servers(self) -> None:
        connected = [s for s in self._servers.values() if s.session is not None]
        before = [s.version for s in connected]
        await asyncio.gather(*(self._read_version(s) for s in connected))
        if before != [s.version for s in connected]:
            async with self._changed:
                self._changed.notify_all()  # a member may have come within the trainer's max_lag

    @staticmethod
    async def _read_version(server: _Server) -> None:
        with contextlib.suppress(PipelineError):
            server.version = (await server.client.status(timeout_s=2.0)).weight_version.version
