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

from collections.abc import Callable, Iterable

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.coordinator.coalesce import Coalescer
from pipelinerl.coordinator.replicas import RETRIED, ReplicaPool, ReplicaState
from pipelinerl.reward.client import RewardClient
from pipelinerl.reward.types import MAX_BATCH_ITEMS, ScoreItem, ScoreResult

log = get_logger(__name__)

__all__ = ["ReplicaState", "RewardPool"]


class RewardPool(ReplicaPool[RewardClient]):
    def __init__(self, channel: Callable[[str], ChannelConfig], addresses: Iterable[str] = ()) -> None:
        """`channel(address)` configures the client of a member (replicas.py)."""
        super().__init__("reward replica", RewardClient, channel, addresses)
        self.retries = 0
        """Score calls sent again after their replica failed them."""
        self._batches = Coalescer(self._score_batch, max_items=MAX_BATCH_ITEMS, parallel=lambda: self.usable)

    async def close(self) -> None:
        self._batches.close()
        await super().close()

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
            async with self.reserve() as replica:
                try:
                    results = await replica.client.score(items, timeout_s=timeout_s)
                    self.succeeded(replica)
                    return results
                except PipelineError as exc:
                    if exc.code not in RETRIED:
                        raise
                    await self.failed(replica, exc.code, exc.message)
                    failure = exc
            self.retries += 1
            log.warning(
                "reward replica failed a Score call; sending the batch to another",
                replica=replica.address, code=failure.code, error=failure.message, items=len(items),
            )  # fmt: skip
