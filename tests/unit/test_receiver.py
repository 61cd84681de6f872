"""The weight receiver across a trainer restart: the version the dead trainer announced is not held
by its successor (or cannot be fetched while no trainer is up), so the receiver asks once,
reconnects and takes the newest version: its old weights would soon be over the lag bound. And a
broadcast left waiting on a lost peer after the trainer has moved on to another group: given up for
the newer version at once, where it used to hold the new group (and every member) until its timeout."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence

import torch

from pipelinerl.common.errors import FailedPrecondition, Unavailable
from pipelinerl.common.types import WeightVersion
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights.receiver import WeightReceiver
from pipelinerl.weights.types import (
    MAX_CHUNK_BYTES,
    Checksum,
    ChecksumAlgorithm,
    Rendezvous,
    WatchRequest,
    WeightChunk,
    WeightLayout,
    WeightNotice,
    crc32,
)

WEIGHTS = {"a.weight": torch.arange(12.0).view(3, 4), "b.bias": torch.ones(5)}


class RestartedTrainer:
    """The first watch stream announces version 6 and then drops (the trainer died); the trainer
    that answers from then on holds version 7 only. With `down`, fetches of version 6 find no
    trainer and the first stream stays open (its end not yet seen)."""

    def __init__(self, down: bool = False) -> None:
        self.down = down
        buckets, self.layout = bucketing.pack(WEIGHTS, bucketing.plan_layout(WEIGHTS.items()))
        self.data = buckets[0].numpy().tobytes()
        self.streams = 0
        self.fetched: list[int] = []

    async def watch_weights(self, request: WatchRequest, /) -> AsyncIterator[WeightNotice]:
        self.streams += 1
        yield WeightNotice(WeightVersion(6 if self.streams == 1 else 7, "run"), self.layout)
        if self.streams == 1 and not self.down:
            raise ConnectionResetError("the trainer died")
        await asyncio.Event().wait()

    async def fetch_weights(
        self, version: WeightVersion, buckets: Sequence[int], /
    ) -> AsyncIterator[WeightChunk]:
        self.fetched.append(version.version)
        if version.version != 7 and self.down:
            raise Unavailable("failed to connect to all addresses")
        if version.version != 7:
            raise FailedPrecondition(f"version {version.version} is not held; held versions: [7]")
        for offset in range(0, len(self.data), MAX_CHUNK_BYTES):
            piece = self.data[offset : offset + MAX_CHUNK_BYTES]
            yield WeightChunk(version, 0, offset, piece, Checksum(ChecksumAlgorithm.CRC32, crc32(piece)))

    async def release_weights(self, receiver_id: str, version: WeightVersion, /) -> None:
        pass


async def follow(source: RestartedTrainer, reconnect_s: float) -> tuple[WeightReceiver, list[int]]:
    """Run a receiver on `source` until it holds a version (at most 5 s)."""
    applied: list[int] = []

    async def apply(version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]) -> None:
        applied.append(version.version)

    receiver = WeightReceiver(source, "inference-0", apply, reconnect_s=reconnect_s)
    task = asyncio.create_task(receiver.run())
    try:
        async with asyncio.timeout(5):
            while receiver.version is None:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
    return receiver, applied


async def test_a_version_gone_with_a_restarted_trainer_gives_way_to_its_newest_at_once() -> None:
    source = RestartedTrainer()
    receiver, applied = await follow(source, reconnect_s=30.0)  # far above the time allowed
    assert applied == [7] and receiver.version == WeightVersion(7, "run")
    assert source.fetched == [6, 7]  # the version gone asked for once, not retried
    assert receiver.stats.failed_updates == 0  # superseded, not failed


async def test_a_version_that_no_trainer_can_send_is_not_retried_and_the_stream_is_reopened() -> None:
    source = RestartedTrainer(down=True)
    receiver, applied = await follow(source, reconnect_s=30.0)
    assert applied == [7] and source.fetched == [6, 7] and source.streams == 2
    assert receiver.stats.failed_updates == 1


class TwoGroups:
    """Announces version 1 for broadcast in group `g1`, then, once its broadcast has begun, version 2
    in `second_group`. Fetches are recorded and answered with nothing."""

    def __init__(self, second_group: str) -> None:
        buckets, self.layout = bucketing.pack(WEIGHTS, bucketing.plan_layout(WEIGHTS.items()))
        self.data = buckets[0]
        self.second_group = second_group
        self.first_begun = asyncio.Event()
        self.fetched: list[int] = []

    @staticmethod
    def rendezvous(group: str) -> Rendezvous:
        return Rendezvous("gloo", "127.0.0.1", 1, group, 3, 2, 60_000)

    async def watch_weights(self, request: WatchRequest, /) -> AsyncIterator[WeightNotice]:
        yield WeightNotice(WeightVersion(1, "run"), self.layout, self.rendezvous("g1"))
        await self.first_begun.wait()
        yield WeightNotice(WeightVersion(2, "run"), self.layout, self.rendezvous(self.second_group))
        await asyncio.Event().wait()

    async def fetch_weights(
        self, version: WeightVersion, buckets: Sequence[int], /
    ) -> AsyncIterator[WeightChunk]:
        self.fetched.append(version.version)
        return
        yield

    async def release_weights(self, receiver_id: str, version: WeightVersion, /) -> None:
        pass


class RelayReceiver(WeightReceiver):
    """A receiver whose broadcasts in group `g1` wait, as a relay does on a peer that died, until
    `release` is set; the others deliver the source's bucket at once."""

    def __init__(self, source: TwoGroups, applied: list[int]) -> None:
        async def apply(version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]) -> None:
            applied.append(version.version)

        super().__init__(source, "evaluation-0", apply)
        self.source = source
        self.release = threading.Event()
        self.loop = asyncio.get_running_loop()

    def _broadcast(self, rendezvous: Rendezvous, buckets: list[torch.Tensor], call: int) -> None:
        if rendezvous.group_name == "g1":
            self.loop.call_soon_threadsafe(self.source.first_begun.set)
            self.release.wait(timeout=30)
        buckets[0].copy_(self.source.data)


async def follow_two(second_group: str, release_after_s: float | None) -> tuple[RelayReceiver, list[int]]:
    """Run a relay receiver until it holds version 2 (at most 5 s); `g1`'s broadcast is released
    after `release_after_s` (None: never, as with a peer gone)."""
    applied: list[int] = []
    receiver = RelayReceiver(TwoGroups(second_group), applied)
    if release_after_s is not None:
        asyncio.get_running_loop().call_later(release_after_s, receiver.release.set)
    task = asyncio.create_task(receiver.run())
    try:
        async with asyncio.timeout(5):
            while receiver.version is None or receiver.version.version < 2:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        receiver.release.set()
    return receiver, applied


async def test_a_broadcast_stuck_after_the_trainer_moved_to_another_group_gives_way_to_the_newer() -> None:
    receiver, applied = await follow_two("g2", release_after_s=None)
    assert applied == [2]  # version 1 skipped: nothing more could come of its group
    assert receiver.source.fetched == []  # nor fetched: version 2 was already announced
    assert receiver.stats.abandoned_broadcasts == 1 and receiver.stats.failed_updates == 0
    assert receiver.stats.broadcasts == 1


async def test_a_broadcast_in_a_group_the_trainer_still_uses_is_waited_for() -> None:
    receiver, applied = await follow_two("g1", release_after_s=0.3)
    assert applied == [1, 2]  # the next version in the same group is no reason to give up
    assert receiver.stats.abandoned_broadcasts == 0 and receiver.stats.broadcasts == 2
