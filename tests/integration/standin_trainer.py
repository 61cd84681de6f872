"""A stand-in trainer process: serves WatchWeights/FetchWeights from a real WeightPublisher and
publishes version v = 0, 1, ... every `interval` seconds, where every tensor of version v is
`expected_weights(v)`. With `--corrupt`, odd versions are announced with a wrong bucket checksum.

    python standin_trainer.py PORT_FILE VERSIONS INTERVAL_S [--corrupt]
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import torch

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.common.log import configure_logging
from pipelinerl.common.publisher import PublisherConfig, WeightPublisher
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.common.types import WeightVersion
from pipelinerl.common.weights import Checksum, Receiver, WeightChunk, WeightNotice
from pipelinerl.trainer.server import registration
from pipelinerl.trainer.types import TrainerStatus

SHAPES = {"embed.weight": (64, 32), "layer.weight": (32, 32), "layer.bias": (32,), "head.weight": (100, 32)}


def expected_weights(version: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


class PublisherOnlyTrainer:
    """The weight-serving half of a trainer core."""

    def __init__(self, publisher: WeightPublisher, corrupt: bool) -> None:
        self.publisher = publisher
        self.corrupt = corrupt
        self.version = -1

    async def admit(self, samples, on_ack) -> None:  # type: ignore[no-untyped-def]
        raise FailedPrecondition("this stand-in does not train")

    async def watch(self, receiver: Receiver) -> AsyncIterator[WeightNotice]:
        async for notice in self.publisher.watch(receiver):
            if self.corrupt and notice.version.version % 2 == 1:
                bucket = dataclasses.replace(
                    notice.layout.buckets[0],
                    checksum=Checksum(notice.layout.buckets[0].checksum.algorithm, b"bad!"),
                )
                layout = dataclasses.replace(notice.layout, buckets=(bucket, *notice.layout.buckets[1:]))
                notice = dataclasses.replace(notice, layout=layout)
            yield notice

    def fetch(self, version: WeightVersion, buckets: Sequence[int]) -> AsyncIterator[WeightChunk]:
        return self.publisher.fetch(version, buckets)

    def status(self) -> TrainerStatus:
        return TrainerStatus(WeightVersion(self.version, "standin"), 0, 0, 0, 0, 0.0, self.publisher.watchers)


async def main(port_file: Path, versions: int, interval_s: float, corrupt: bool) -> None:
    # Small buckets so that a version spans several of them.
    publisher = WeightPublisher(PublisherConfig("standin", bucket_bytes=16 * 1024, broadcast_timeout_s=10))
    await publisher.start()
    core = PublisherOnlyTrainer(publisher, corrupt)
    server = GrpcServer(ServiceSettings(port=0, drain_seconds=1), [registration(core)])
    await server.start()
    port_file.write_text(str(server.port))
    for version in range(versions):
        await publisher.publish(version, expected_weights(version))
        core.version = version
        await asyncio.sleep(interval_s)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    configure_logging("standin-trainer")
    args = sys.argv[1:]
    asyncio.run(main(Path(args[0]), int(args[1]), float(args[2]), "--corrupt" in args))
