"""A trainer core that serves weights and trains nothing: behind the trainer's real servicer it
answers WatchWeights, FetchWeights and GetStatus from a real WeightPublisher, while its owner
publishes versions by hand. The weight-update benchmark and the weight-transport tests
(tests/integration/standin_trainer.py) both run it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.common.types import Sample, WeightVersion
from pipelinerl.trainer.types import Malformed, SampleAck, TrainerStatus
from pipelinerl.weights.publisher import WeightPublisher
from pipelinerl.weights.types import Checksum, WatchRequest, WeightChunk, WeightNotice


class PublisherOnlyTrainer:
    """Implements `TrainerCore` for serving weights only; `version` is the last one published."""

    def __init__(self, publisher: WeightPublisher, run_id: str, corrupt_odd_versions: bool = False) -> None:
        self.publisher = publisher
        self.run_id = run_id
        self.corrupt_odd_versions = corrupt_odd_versions
        """Announce odd versions with a wrong checksum on their first bucket (receivers must refuse them)."""
        self.version = -1

    async def admit(self, samples: Sequence[Sample | Malformed], on_ack: Callable[[SampleAck], None]) -> None:
        raise FailedPrecondition("this trainer serves weights only; it does not train")

    async def flush(self, checkpoint: bool) -> None:
        raise FailedPrecondition("this trainer serves weights only; it does not train")

    @property
    def durable_version(self) -> int:
        return self.version  # nothing is trained, so nothing can be lost

    async def wait_durable(self, after: int) -> int:
        while self.version <= after:
            await asyncio.sleep(0.1)
        return self.version

    async def watch(self, receiver: WatchRequest) -> AsyncIterator[WeightNotice]:
        async for notice in self.publisher.watch(receiver):
            yield _corrupted(notice) if self.corrupt_odd_versions and notice.version.version % 2 else notice

    def fetch(self, version: WeightVersion, buckets: Sequence[int]) -> AsyncIterator[WeightChunk]:
        return self.publisher.fetch(version, buckets)

    def release(self, receiver_id: str, version: WeightVersion) -> None:
        self.publisher.release(receiver_id, version)

    def status(self) -> TrainerStatus:
        version = WeightVersion(self.version, self.run_id)
        return TrainerStatus(version, 0, 0, 0, 0, 0.0, self.publisher.watchers, self.version, 2**31 - 1)


def _corrupted(notice: WeightNotice) -> WeightNotice:
    first = notice.layout.buckets[0]
    bad = dataclasses.replace(first, checksum=Checksum(first.checksum.algorithm, b"bad!"))
    layout = dataclasses.replace(notice.layout, buckets=(bad, *notice.layout.buckets[1:]))
    ipc = notice.cuda_ipc
    if ipc is not None:  # the device copy is refused too, so the receiver falls back to fetching
        ipc = dataclasses.replace(
            ipc, buckets=(dataclasses.replace(ipc.buckets[0], checksum=b"bad!"), *ipc.buckets[1:])
        )
    return dataclasses.replace(notice, layout=layout, cuda_ipc=ipc)
