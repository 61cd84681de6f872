"""The weight receiver across a trainer restart: the version the dead trainer announced is not held
by its successor (or cannot be fetched while no trainer is up), so the receiver asks once,
reconnects and takes the newest version: its old weights would soon be over the lag bound."""

from __future__ import annotations

import asyncio
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
