"""A stand-in trainer process: serves WatchWeights/FetchWeights from a real WeightPublisher and
publishes versions v = 0, 1, ..., where version v is `expected_weights(v)` (small toy tensors) or,
with `--weights tiny`, `preset_weights(v)` (the tiny preset drawn from seed 100 + v).

    python standin_trainer.py PORT_FILE --versions N --interval S [--weights toy|tiny] [--corrupt]
                              [--device cuda]

Without `--interval`, the next version is published each time the file `PORT_FILE.next` appears
(and is then removed), so a test decides exactly when an update lands. With `--corrupt`, odd
versions are announced with a wrong bucket checksum. With `--device cuda`, the weights are CUDA
tensors, so a receiver on the same GPU is handed each version by CUDA IPC.
"""

from __future__ import annotations

import argparse
import asyncio
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


def expected_weights(version: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def preset_weights(version: int) -> dict[str, torch.Tensor]:
    from pipelinerl.common.model import build_preset

    return dict(build_preset("tiny", seed=100 + version).model.named_parameters())


async def main(args: argparse.Namespace) -> None:
    # Small buckets so that a version spans several of them.
    settings = PublisherSettings(bucket_bytes=256 * 1024, broadcast_timeout_s=10)
    publisher = WeightPublisher(settings, run_id="standin")
    await publisher.start()
    core = PublisherOnlyTrainer(publisher, "standin", corrupt_odd_versions=args.corrupt)
    server = GrpcServer(ServiceSettings(port=0, drain_seconds=1), [registration(core)])
    await server.start()
    weights = preset_weights if args.weights == "tiny" else expected_weights
    trigger = Path(f"{args.port_file}.next")
    for version in range(args.versions):
        await publisher.publish(version, {k: v.to(args.device) for k, v in weights(version).items()})
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
    parser.add_argument("--device", default="cpu")
    asyncio.run(main(parser.parse_args()))
