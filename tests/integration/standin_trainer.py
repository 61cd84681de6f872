"""A stand-in trainer process: serves WatchWeights/FetchWeights from a real WeightPublisher and
publishes versions v = 0, 1, ..., where version v is `expected_weights(v)` (small toy tensors) or,
with `--weights tiny`, `preset_weights(v)` (the tiny preset drawn from seed 100 + v).

    python standin_trainer.py PORT_FILE --versions N --interval S [--weights toy|tiny] [--corrupt]

Without `--interval`, the next version is published each time the file `PORT_FILE.next` appears
(and is then removed), so a test decides exactly when an update lands. With `--corrupt`, odd
versions are announced with a wrong bucket checksum.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import torch

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.common.log import configure_logging
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.common.types import WeightVersion
from pipelinerl.trainer.server import registration
from pipelinerl.trainer.types import TrainerStatus
from pipelinerl.weights.publisher import PublisherConfig, WeightPublisher
from pipelinerl.weights.types import Checksum, Receiver, WeightChunk, WeightNotice

SHAPES = {"embed.weight": (64, 32), "layer.weight": (32, 32), "layer.bias": (32,), "head.weight": (100, 32)}


def expected_weights(version: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def preset_weights(version: int) -> dict[str, torch.Tensor]:
    from pipelinerl.common.model import build_preset

    return dict(build_preset("tiny", seed=100 + version).model.named_parameters())


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


async def main(args: argparse.Namespace) -> None:
    # Small buckets so that a version spans several of them.
    publisher = WeightPublisher(PublisherConfig("standin", bucket_bytes=256 * 1024, broadcast_timeout_s=10))
    await publisher.start()
    core = PublisherOnlyTrainer(publisher, args.corrupt)
    server = GrpcServer(ServiceSettings(port=0, drain_seconds=1), [registration(core)])
    await server.start()
    weights = preset_weights if args.weights == "tiny" else expected_weights
    trigger = Path(f"{args.port_file}.next")
    for version in range(args.versions):
        await publisher.publish(version, weights(version))
        core.version = version
        if version == 0:
            args.port_file.write_text(str(server.port))
        if args.interval is not None:
            await asyncio.sleep(args.interval)
            continue
        while not trigger.exists():
            await asyncio.sleep(0.02)
        trigger.unlink()
    await asyncio.sleep(3600)


if __name__ == "__main__":
    configure_logging("standin-trainer")
    parser = argparse.ArgumentParser()
    parser.add_argument("port_file", type=Path)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--interval", type=float)
    parser.add_argument("--weights", choices=["toy", "tiny"], default="toy")
    parser.add_argument("--corrupt", action="store_true")
    asyncio.run(main(parser.parse_args()))
