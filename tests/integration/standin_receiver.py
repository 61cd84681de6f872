"""A stand-in inference server's weight side: a real WeightReceiver in a process of its own,
following a stand-in trainer (standin_trainer.py), so that a test can stop or kill one member of
a broadcast group by its pid.

    python standin_receiver.py PORT_FILE --trainer-port P --receiver-id ID [--big-mib M]

Each version applied appends a JSON line to `PORT_FILE.applied`: the version, whether its tensors
equal `expected_weights(version, M)`, and the receiver's broadcast and fetch counts then. PORT_FILE
gets "0" once the first version is applied (the receiver serves no port).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from pipelinerl.common.log import configure_logging
from pipelinerl.common.types import WeightVersion
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights.receiver import WeightReceiver
from pipelinerl.weights.types import WeightLayout
from tests.integration.standin_trainer import expected_weights


async def main(args: argparse.Namespace) -> None:
    applied_file = Path(f"{args.port_file}.applied")
    receiver: WeightReceiver | None = None

    async def apply(version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]) -> None:
        tensors = bucketing.unpack(layout, buckets)
        expected = expected_weights(version.version, args.big_mib)
        ok = tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected)
        assert receiver is not None
        line = {"time": time.time(), "version": version.version, "ok": ok,
                "broadcasts": receiver.stats.broadcasts, "fetches": receiver.stats.fetches}  # fmt: skip
        with applied_file.open("a") as out:
            out.write(json.dumps(line) + "\n")
        if not args.port_file.exists():
            args.port_file.write_text("0")

    async with TrainerClient(f"127.0.0.1:{args.trainer_port}") as client:
        receiver = WeightReceiver(client, args.receiver_id, apply)
        await receiver.run()


if __name__ == "__main__":
    configure_logging("standin-receiver")
    parser = argparse.ArgumentParser()
    parser.add_argument("port_file", type=Path)
    parser.add_argument("--trainer-port", type=int, required=True)
    parser.add_argument("--receiver-id", required=True)
    parser.add_argument("--big-mib", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
