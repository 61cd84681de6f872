"""A stand-in trainer process: serves WatchWeights/FetchWeights from a real WeightPublisher and
publishes versions v = 0, 1, ..., where version v is `expected_weights(v)` (small toy tensors) or,
with `--weights tiny`, `preset_weights(v)` (the tiny preset drawn from seed 100 + v).

    python standin_trainer.py PORT_FILE --versions N --interval S [--weights toy|tiny] [--corrupt]
                              [--device cuda] [--big-mib M] [--bucket-kib K] [--broadcast-timeout S]

Without `--interval`, the next version is published each time the file `PORT_FILE.next` appears
(and is then removed), so a test decides exactly when an update lands. With `--corrupt`, odd
versions are announced with a wrong bucket checksum. With `--device cuda`, the weights are CUDA
tensors, so a receiver on the same GPU is handed each version by CUDA IPC. With `--big-mib M`, each
toy version also has one `big.weight` of M MiB, so that a broadcast outlasts the sockets' buffers.

Each publish and each end of a broadcast appends a JSON line to `PORT_FILE.events` (wall-clock
`time`, and the publisher's counters then), so a test can tell what the trainer did while.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from benchmarks.standin import PublisherOnlyTrainer
from pipelinerl.common.log import configure_logging
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.trainer.server import registration
from pipelinerl.weights.publisher import WeightPublisher
from pipelinerl.weights.settings import PublisherSettings

SHAPES = {"embed.weight": (64, 32), "layer.weight": (32, 32), "layer.bias": (32,), "head.weight": (100, 32)}


def expected_weights(version: int, big_mib: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    weights = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    if big_mib:
        weights["big.weight"] = torch.randn(big_mib * 2**18, generator=generator)
    return weights


def preset_weights(version: int) -> dict[str, torch.Tensor]:
    from pipelinerl.common.model import build_preset

    return dict(build_preset("tiny", seed=100 + version).model.named_parameters())


def record(events: Path, publisher: WeightPublisher, **fields: object) -> None:
    stats = publisher.stats
    line = {"time": time.time(), **fields, "broadcasts": stats.broadcasts,
            "failed_broadcasts": stats.failed_broadcasts, "rendezvous": stats.rendezvous,
            "last_broadcast_s": stats.last_broadcast_s}  # fmt: skip
    with events.open("a") as out:
        out.write(json.dumps(line) + "\n")


async def record_broadcasts(events: Path, publisher: WeightPublisher) -> None:
    seen = (0, 0)
    while True:
        ended = (publisher.stats.broadcasts, publisher.stats.failed_broadcasts)
        if ended != seen:
            seen = ended
            record(events, publisher, event="broadcast_ended")
        await asyncio.sleep(0.01)


async def main(args: argparse.Namespace) -> None:
    # Small buckets by default, so that a version spans several of them.
    settings = PublisherSettings(
        bucket_bytes=args.bucket_kib * 1024, broadcast_timeout_s=args.broadcast_timeout
    )
    publisher = WeightPublisher(settings, run_id="standin")
    await publisher.start()
    events = Path(f"{args.port_file}.events")
    watch_broadcasts = asyncio.create_task(record_broadcasts(events, publisher))
    core = PublisherOnlyTrainer(publisher, "standin", corrupt_odd_versions=args.corrupt)
    server = GrpcServer(ServiceSettings(port=0, drain_seconds=1), [registration(core)])
    await server.start()

    def weights(version: int) -> dict[str, torch.Tensor]:
        return preset_weights(version) if args.weights == "tiny" else expected_weights(version, args.big_mib)

    trigger = Path(f"{args.port_file}.next")
    for version in range(args.versions):
        tensors = {k: v.to(args.device) for k, v in weights(version).items()}
        started = time.time()
        await publisher.publish(version, tensors)
        record(events, publisher, event="published", version=version, started=started)
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
    watch_broadcasts.cancel()


if __name__ == "__main__":
    configure_logging("standin-trainer")
    parser = argparse.ArgumentParser()
    parser.add_argument("port_file", type=Path)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--interval", type=float)
    parser.add_argument("--weights", choices=["toy", "tiny"], default="toy")
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--big-mib", type=int, default=0)
    parser.add_argument("--bucket-kib", type=int, default=256)
    parser.add_argument("--broadcast-timeout", type=float, default=10.0)
    asyncio.run(main(parser.parse_args()))
