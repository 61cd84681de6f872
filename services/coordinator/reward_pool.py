"""The coordinator's view of the reward replicas: each Score call goes to the replica with the
fewest Score calls in flight among those whose health says SERVING, and a call that fails there is
sent again, whole, to another.

    score(items) ─► wait for a replica that is up ─► fewest calls in flight ─► Score ─► results
                                                       │ UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED
                                                       │ (the replica died, drains or hangs)
                                                       └─► it is down until its health says SERVING
                                                           again; the same items go to a replica up

Score requests made in the same turn of the event loop (the groups one completion message ended)
leave together, in one call per replica up (coalesce.py): a call costs the reward service about a
millisecond however few items it holds.

Results are read from one reply only, so no item is scored into training twice: a replica whose
call failed may still have scored the batch, but that reply is never read. Members change while
runs go on (`add`, `remove`, driven by membership.py as for the inference servers); a removed
replica takes no new call and is closed once its calls in flight are done. While no member is up,
calls wait, each replica's health is asked again with a backoff, and `reachable` is False (the
coordinator's health then says NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.coordinator.coalesce import Coalescer
from pipelinerl.reward.client import RewardClient
from pipelinerl.reward.types import MAX_BATCH_ITEMS, ScoreItem, ScoreResult

log = get_logger(__name__)

PROBE_S = 1.0
"""How often the health of a replica that is up is asked."""
MAX_PROBE_S = 5.0
"""Longest wait between two health checks of a replica that is down (the delay doubles up to it)."""
PROBE_TIMEOUT_S = 2.0
# Codes that say the replica cannot answer now, not that the batch is bad: another may.
_RETRIED = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")


@dataclass(frozen=True)
class ReplicaState:
    address: str
    up: bool
    """It takes Score calls: a member whose health said SERVING at the last check, and where no
    call has failed since."""
    in_flight: int
    """Score calls it is answering."""


@dataclass
class _Replica:
    address: str
    client: RewardClient
    up: bool = False
    in_flight: int = 0
    sent: int = 0
    """Score calls sent to it; among replicas equally loaded, the one sent fewest goes first."""
    failures: int = 0
    """Times in a row it was taken down by a failed call (calls failing together count once)."""
    held_until: float = 0.0
    """After a failed call it stays down until then (monotonic clock), whatever its health says:
    PROBE_S after the first failure, doubling up to MAX_PROBE_S, so that a replica whose health
    says SERVING but that fails every call is tried less and less often."""
    leaving: bool = False
    """Removed from the pool: takes nothing new, leaves once idle."""
    wake: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class RewardPool:
    def __init__(self, channel: Callable[[str], ChannelConfig], addresses: Iterable[str] = ()) -> None:
        """`channel(address)` configures the client of a member. The channel's own retries are
        turned off: a failed call goes to another replica instead of waiting on the same one."""
        self._channel = channel
        self._replicas: dict[str, _Replica] = {}
        self._changed = asyncio.Condition()
        self._started = False
        self.retries = 0
        """Score calls sent again after their replica failed them."""
        self._batches = Coalescer(
            self._score_batch,
            max_items=MAX_BATCH_ITEMS,
            parallel=lambda: sum(self._usable(r) for r in self._replicas.values()),
        )
        for address in addresses:
            self.add(address)

    async def start(self) -> None:
        self._started = True
        for replica in self._replicas.values():
            replica.task = asyncio.create_task(self._watch(replica))

    async def close(self) -> None:
        self._batches.close()
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
        """Whether a member is up: a Score call would be sent now."""
        return any(self._usable(r) for r in self._replicas.values())

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
        replica = self._replicas[address] = _Replica(address, RewardClient(config))
        if self._started:
            replica.task = asyncio.create_task(self._watch(replica))
        log.info("reward replica joined the pool", replica=address)

    def remove(self, address: str) -> None:
        """`address` takes no new call; it leaves the pool once its calls in flight are done (a
        call it then fails is sent to another replica)."""
        replica = self._replicas.get(address)
        if replica is None or replica.leaving:
            return
        replica.leaving = True
        replica.wake.set()
        log.info("reward replica leaves the pool", replica=address, in_flight=replica.in_flight)

    async def wait_reachable(self, reachable: bool) -> None:
        """Until `reachable` is what is given."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.reachable == reachable)

    @property
    def calls(self) -> int:
        """Score calls made, retries not counted; fewer than `score` requests when they merged."""
        return self._batches.calls

    async def score(self, items: list[ScoreItem], timeout_s: float) -> list[ScoreResult]:
        """Score `items` on the least-loaded replica that is up, each call within `timeout_s`; if
        the replica fails the call (gone, draining, too slow), the same items go to another, and
        so on until one answers. Another error (a batch no replica would take) is raised. Requests
        made in the same turn of the event loop share a call."""
        return await self._batches(items, timeout_s)

    async def _score_batch(self, items: list[ScoreItem], timeout_s: float) -> list[ScoreResult]:
        while True:
            replica = await self._reserve()
            try:
                results = await replica.client.score(items, timeout_s=timeout_s)
                replica.failures = 0
                return results
            except PipelineError as exc:
                if exc.code not in _RETRIED:
                    raise
                code, why = exc.code, exc.message
                if replica.up:
                    replica.failures += 1
                    hold = min(PROBE_S * 2 ** (replica.failures - 1), MAX_PROBE_S)
                    replica.held_until = time.monotonic() + hold
                await self._set_up(replica, False)
            finally:
                async with self._changed:
                    replica.in_flight -= 1
                    self._changed.notify_all()
                if replica.leaving and replica.in_flight == 0:
                    replica.wake.set()  # its watcher releases it
            self.retries += 1
            log.warning(
                "reward replica failed a Score call; sending the batch to another",
                replica=replica.address, code=code, error=why, items=len(items),
            )  # fmt: skip

    @staticmethod
    def _usable(replica: _Replica) -> bool:
        return replica.up and not replica.leaving

    async def _reserve(self) -> _Replica:
        async with self._changed:
            await self._changed.wait_for(lambda: self.reachable)
            replica = min(
                (r for r in self._replicas.values() if self._usable(r)), key=lambda r: (r.in_flight, r.sent)
            )
            replica.in_flight += 1
            replica.sent += 1
            return replica

    async def _set_up(self, replica: _Replica, up: bool) -> None:
        if replica.up == up:
            return
        async with self._changed:
            replica.up = up
            self._changed.notify_all()
        if up:
            log.info("reward replica up", replica=replica.address)
        else:
            log.warning("reward replica down", replica=replica.address, in_flight=replica.in_flight)

    async def _watch(self, replica: _Replica) -> None:
        """Ask `replica`'s health every PROBE_S while it is up, backing off to MAX_PROBE_S while it
        is down (or held down after a failed call); once it has left and is idle, close it."""
        delay, downs = PROBE_S, 0
        try:
            while not (replica.leaving and replica.in_flight == 0):
                replica.wake.clear()
                if not replica.leaving:
                    serving = await replica.client.serving(PROBE_TIMEOUT_S)
                    up = serving and time.monotonic() >= replica.held_until
                    await self._set_up(replica, up)
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
                log.info("reward replica left the pool", replica=replica.address)
