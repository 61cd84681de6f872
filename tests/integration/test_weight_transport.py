"""Weights from a stand-in trainer process to a receiver: gloo broadcast per membership, FetchWeights
for late joiners and bad buckets, and old weights kept when a version cannot be verified."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pipelinerl.common.types import WeightVersion
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights.receiver import WeightReceiver
from pipelinerl.weights.types import WeightLayout
from tests.integration.processes import server_process
from tests.integration.standin_trainer import expected_weights

pytestmark = pytest.mark.slow


class Applied:
    """Records what the engine would have loaded."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.mismatches: list[int] = []

    async def __call__(
        self, version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]
    ) -> None:
        tensors = bucketing.unpack(layout, buckets)
        expected = expected_weights(version.version)
        if tensors.keys() != expected.keys() or not all(
            torch.equal(tensors[k], expected[k]) for k in expected
        ):
            self.mismatches.append(version.version)
        self.versions.append(version.version)


async def follow(
    port: int, applied: Applied, until_version: int, timeout_s: float, **kwargs
) -> WeightReceiver:
    async with TrainerClient(f"127.0.0.1:{port}") as client:
        receiver = WeightReceiver(client, "inference-0", applied, **kwargs)
        task = asyncio.create_task(receiver.run())
        try:
            for _ in range(int(timeout_s * 20)):
                if receiver.version is not None and receiver.version.version >= until_version:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return receiver


async def test_versions_arrive_by_broadcast_and_late_join_by_fetch(tmp_path: Path) -> None:
    async with server_process("standin_trainer.py", tmp_path, "--versions", "5", "--interval", "1.0") as (
        _,
        port,
    ):
        applied = Applied()
        receiver = await follow(port, applied, until_version=4, timeout_s=60)
    assert applied.mismatches == []
    assert applied.versions == sorted(applied.versions) and applied.versions[-1] == 4
    # The first version seen is fetched (no group yet); the later ones come by broadcast.
    assert receiver.stats.fetches >= 1 and receiver.stats.broadcasts >= 2
    assert receiver.stats.failed_updates == 0


async def test_fetch_only_receiver(tmp_path: Path) -> None:
    async with server_process("standin_trainer.py", tmp_path, "--versions", "3", "--interval", "0.5") as (
        _,
        port,
    ):
        applied = Applied()
        receiver = await follow(port, applied, until_version=2, timeout_s=60, accepts_broadcast=False)
    assert applied.mismatches == [] and applied.versions[-1] == 2
    assert receiver.stats.broadcasts == 0


async def test_unverifiable_version_keeps_the_old_weights(tmp_path: Path) -> None:
    async with server_process(
        "standin_trainer.py", tmp_path, "--versions", "3", "--interval", "1.5", "--corrupt"
    ) as (_, port):
        applied = Applied()
        receiver = await follow(port, applied, until_version=2, timeout_s=60, fetch_attempts=2)
    # Version 1 is announced with a wrong checksum: never applied, counted, and version 2 still lands.
    assert 1 not in applied.versions and applied.versions[-1] == 2
    assert applied.mismatches == []
    assert receiver.stats.failed_updates >= 1
    assert "checksum mismatch" in receiver.stats.last_error
