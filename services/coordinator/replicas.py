"""Replicas of one stateless-to-the-caller service (reward, environment) as the coordinator sees
them: members that come and go, each up or down by its health and by the calls that failed there,
and a reservation that picks the least loaded member that is up.

    async with pool.reserve() as replica:      # waits while no member is up
        await replica.client.score(...)        # or a whole episode on one environment replica
        # a call the replica cannot answer (gone, draining, hanging): pool.failed(replica) puts it
        # down until its health says SERVING again, held down a while so a replica that answers
        # health but fails every call is tried less and less often

A removed member takes no new reservation and is closed once its reservations are done. While no
member is up, `reachable` is False (the coordinator's health then says NOT_SERVING) and each
member's health is asked again with a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pipelinerl.common.channel import ChannelConfig, ServiceClient
from pipelinerl.common.log import get_logger

log = get_logger(__name__)

PROBE_S = 1.0
"""How often the health of a replica that is up is asked."""
MAX_PROBE_S = 5.0
"""Longest wait between two health checks of a replica that is down (the delay doubles up to it)."""
PROBE_TIMEOUT_S = 2.0
RETRIED = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
"""Codes that say the replica cannot answer now, not that the request is bad: another may."""

C = TypeVar("C", bound=ServiceClient)


@dataclass(frozen=True)
class ReplicaState:
    address: str
    up: bool
    """It takes calls: a member whose health said SERVING at the last check, and where no call has
    failed since."""
    in_flight: int
    """Reservations it holds: calls (reward) or episodes (environment)."""


@dataclass
class Replica(Generic[C]):
    address: str
    client: C
    up: bool = False
    in_flight: int = 0
    sent: int = 0
    """Reservations made; among replicas equally loaded, the one given fewest goes first."""
    failures: int = 0
    """Times in a row it was taken down by a failed call (calls failing together count once)."""
    held_until: float = 0.0
    """After a failed call it stays down until then (monotonic clock), whatever its health says:
    PROBE_S after the first failure, doubling up to MAX_PROBE_S."""
    leaving: bool = False
    """Removed from the pool: takes nothing new, leaves once idle."""
    wake: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class ReplicaPool(Generic[C]):
    def __init__(
        self,
        kind: str,
        client: Callable[[ChannelConfig], C],
        channel: Callable[[str], ChannelConfig],
        addresses: Iterable[str] = (),
    ) -> None:
        """`kind` names the replicas in log lines ("reward replica"); `channel(address)` configures
        the `client` of a member. The channel's own retries are turned off: a failed call goes to
        another replica instead of waiting on the same one."""
        self._kind = kind
        self._client = client
        self._channel = channel
        self._replicas: dict[str, Replica[C]] = {}
        self._changed = asyncio.Condition()
        self._started = False
        for address in addresses:
            self.add(address)

    async def start(self) -> None:
        self._started = True
        for replica in self._replicas.values():
            replica.task = asyncio.create_task(self._watch(replica))

    async def close(self) -> None:
        tasks = [r.task for r in self._replicas.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica in list(self._replicas.values()):
            await replica.client.close()
        self._replicas.clear()

    @property
    def members(self) -> set[str]:
        """Addresses of the replicas in the pool (those leaving excluded)."""
        return {a for a, r in self._replicas.items() if not r.leaving}

    @property
    def reachable(self) -> bool:
        """Whether a member is up: a reservation would be given now."""
        return any(self._usable(r) for r in self._replicas.values())

    @property
    def usable(self) -> int:
        """Members up."""
        return sum(self._usable(r) for r in self._replicas.values())

    def snapshot(self) -> list[ReplicaState]:
        return [ReplicaState(r.address, self._usable(r), r.in_flight) for r in self._replicas.values()]

    def add(self, address: str) -> None:
        """Make `address` a member; a replica that is leaving stays, as the same member."""
        replica = self._replicas.get(address)
        if replica is not None:
            replica.leaving = False
            replica.wake.set()  # asked again at once
            return
        config = dataclasses.replace(self._channel(address), max_attempts=1)
        replica = self._replicas[address] = Replica(address, self._client(config))
        if self._started:
            replica.task = asyncio.create_task(self._watch(replica))
        log.info(f"{self._kind} joined the pool", replica=address)

    def remove(self, address: str) -> None:
        """`address` takes no new reservation; it leaves the pool once its reservations are done."""
        replica = self._replicas.get(address)
        if replica is None or replica.leaving:
            return
        replica.leaving = True
        replica.wake.set()
        log.info(f"{self._kind} leaves the pool", replica=address, in_flight=replica.in_flight)

    async def wait_reachable(self, reachable: bool) -> None:
        """Until `reachable` is what is given."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.reachable == reachable)

    @contextlib.asynccontextmanager
    async def reserve(self) -> AsyncIterator[Replica[C]]:
        """The least loaded member that is up (waiting while none is), held until the block ends."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.reachable)
            replica = min(
                (r for r in self._replicas.values() if self._usable(r)), key=lambda r: (r.in_flight, r.sent)
            )
            replica.in_flight += 1
            replica.sent += 1
        try:
            yield replica
        finally:
            async with self._changed:
                replica.in_flight -= 1
                self._changed.notify_all()
            if replica.leaving and replica.in_flight == 0:
                replica.wake.set()  # its watcher releases it

    def succeeded(self, replica: Replica[C]) -> None:
        replica.failures = 0

    async def failed(self, replica: Replica[C], code: str, why: str) -> None:
        """A call `replica` could not answer: it is down, held down for a while (longer each time
        in a row), until its health says SERVING again."""
        if replica.up:
            replica.failures += 1
            hold = min(PROBE_S * 2 ** (replica.failures - 1), MAX_PROBE_S)
            replica.held_until = time.monotonic() + hold
        await self._set_up(replica, False, f"{code}: {why}")

    @staticmethod
    def _usable(replica: Replica[C]) -> bool:
        return replica.up and not replica.leaving

    async def _set_up(self, replica: Replica[C], up: bool, why: str = "") -> None:
        if replica.up == up:
            return
        async with self._changed:
            replica.up = up
            self._changed.notify_all()
        if up:
            log.info(f"{self._kind} up", replica=replica.address)
        else:
            log.warning(f"{self._kind} down", replica=replica.address, in_flight=replica.in_flight, why=why)

    async def _watch(self, replica: Replica[C]) -> None:
        """Ask `replica`'s health every PROBE_S while it is up, backing off to MAX_PROBE_S while it
        is down (or held down after a failed call); once it has left and is idle, close it."""
        delay, downs = PROBE_S, 0
        try:
            while not (replica.leaving and replica.in_flight == 0):
                replica.wake.clear()
                if not replica.leaving:
                    serving = await replica.client.serving(PROBE_TIMEOUT_S)
                    up = serving and time.monotonic() >= replica.held_until
                    await self._set_up(replica, up, "" if serving else "health is not SERVING")
                    downs = 0 if up else downs + 1
                    delay = min(PROBE_S * 2 ** max(downs - 1, 0), MAX_PROBE_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(replica.wake.wait(), delay)
        finally:
            if replica.leaving and self._replicas.get(replica.address) is replica:
                async with self._changed:
                    del self._replicas[replica.address]
                    self._changed.notify_all()
                await replica.client.close()
                log.info(f"{self._kind} left the pool", replica=replica.address)
