"""A trainer and an inference server on one GPU: each version is handed over by CUDA IPC, lands in
the middle of a generation with no request lost, and a bucket whose device checksum is wrong is
refused (the old weights stay until a good version comes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pipelinerl.common.model import build_preset
from pipelinerl.inference.__main__ import build
from pipelinerl.inference.client import InferenceClient
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.inference.types import GenerationRequest
from tests.gpu import needs_cuda
from tests.integration.processes import server_process
from tests.integration.test_inflight_update import GREEDY, PROMPT, generate_across_an_update, next_version

pytestmark = needs_cuda

STANDIN = "standin_trainer.py"


def greedy_reference(seed: int, n: int) -> list[int]:
    model = build_preset("tiny", seed=seed).model.to("cuda")
    out = model.generate(
        torch.tensor([PROMPT], device="cuda"), do_sample=False, max_new_tokens=n, eos_token_id=None
    )
    return out[0, len(PROMPT) :].tolist()


def ipc_updates(log: str) -> int:
    return sum(1 for line in log.splitlines() if "weights updated" in line and "cuda_ipc" in line)


async def test_a_cuda_ipc_update_lands_mid_generation(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    args = ("--versions", "3", "--weights", "tiny", "--device", "cuda")
    async with server_process(STANDIN, tmp_path, *args) as (_, port):
        settings = InferenceSettings(
            port=0, model="tiny", device="cuda", trainer_address=f"127.0.0.1:{port}",
            receiver_id="inference-gpu", ignore_eos=True,
        )  # fmt: skip
        server = await build(settings)
        await server.start()
        try:
            async with InferenceClient(server.address) as client, client.session() as session:
                others = [
                    asyncio.create_task(session.generate(GenerationRequest(f"other-{i}", PROMPT, GREEDY)))
                    for i in range(4)
                ]
                during_done = await generate_across_an_update(session, tmp_path)
                finished = await asyncio.gather(*others)
                after = await session.generate(GenerationRequest("after", PROMPT, GREEDY))
                status = await client.status()
        finally:
            await server.stop(grace=1)

    versions = during_done.tokens.versions
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1, versions
    switch = versions.index(1)
    assert 20 <= switch < len(versions)
    assert all(len(f.tokens.token_ids) == 160 for f in finished)  # no request lost to the swap
    assert after.tokens.token_ids[:32] == greedy_reference(101, 32) and set(after.tokens.versions) == {1}
    assert (status.weight_version.version, status.failed_weight_updates) == (1, 0)
    assert ipc_updates(capfd.readouterr().out) == 1  # version 0 was fetched (no watcher yet), 1 by IPC


async def test_a_corrupt_device_bucket_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    args = ("--versions", "3", "--weights", "tiny", "--device", "cuda", "--corrupt")
    async with server_process(STANDIN, tmp_path, *args) as (_, port):
        settings = InferenceSettings(
            port=0, model="tiny", device="cuda", trainer_address=f"127.0.0.1:{port}",
            receiver_id="inference-gpu",
        )  # fmt: skip
        server = await build(settings)
        await server.start()
        try:
            async with InferenceClient(server.address) as client:
                next_version(tmp_path)  # version 1: corrupt on the device and in the layout
                for _ in range(100):
                    if (status := await client.status()).failed_weight_updates:
                        break
                    await asyncio.sleep(0.1)
                assert (status.weight_version.version, status.failed_weight_updates) == (0, 1)
                next_version(tmp_path)  # version 2: good
                for _ in range(100):
                    if (status := await client.status()).weight_version.version == 2:
                        break
                    await asyncio.sleep(0.1)
        finally:
            await server.stop(grace=1)
    assert status.weight_version.version == 2
    log = capfd.readouterr().out
    assert "checksum mismatch on the device" in log and ipc_updates(log) == 1
