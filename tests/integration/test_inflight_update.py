"""The inference server on the built-in engine follows a stand-in trainer: a new version lands in
the middle of a generation without restarting it, and every token says which weights made it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pipelinerl.common.model import build_preset
from pipelinerl.common.types import SamplingParams, TokenSequence
from pipelinerl.inference.__main__ import build
from pipelinerl.inference.client import GenerateSession, InferenceClient
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.inference.types import Completion, GenerationRequest
from tests.integration.processes import port_file_of, server_process

pytestmark = pytest.mark.slow

PROMPT = [1, 10, 11, 12, 13]  # bos + a few characters of the tiny preset's vocabulary
GREEDY = SamplingParams(max_new_tokens=160, temperature=0.0)


def greedy_reference(seed: int, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = build_preset("tiny", seed=seed).model
    ids = torch.tensor([prompt])
    for _ in range(max_new_tokens):
        next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def next_version(tmp_path: Path) -> None:
    """Have the stand-in trainer (tests/integration/standin_trainer.py) publish its next version."""
    port_file_of("standin_trainer.py", tmp_path).with_suffix(".port.next").touch()


async def generate_across_an_update(session: GenerateSession, tmp_path: Path) -> Completion:
    """Generate `PROMPT` greedily, and have the next version published once 20 tokens streamed."""
    streamed = TokenSequence()
    first_tokens = asyncio.Event()

    def on_delta(delta: TokenSequence) -> None:
        streamed.extend(delta)
        if len(streamed) >= 20:
            first_tokens.set()

    request = GenerationRequest("during", PROMPT, GREEDY)
    generation = asyncio.create_task(session.generate(request, on_delta=on_delta))
    await first_tokens.wait()
    next_version(tmp_path)
    return await generation


async def test_update_lands_mid_generation(tmp_path: Path) -> None:
    async with server_process("standin_trainer.py", tmp_path, "--versions", "2", "--weights", "tiny") as (
        _,
        port,
    ):
        settings = InferenceSettings(
            port=0,
            model="tiny",
            trainer_address=f"127.0.0.1:{port}",
            receiver_id="inference-test",
            ignore_eos=True,
        )
        server = await build(settings)
        await server.start()
        try:
            async with InferenceClient(server.address) as client, client.session() as session:
                during = await generate_across_an_update(session, tmp_path)
                after = await session.generate(GenerationRequest("after", PROMPT, GREEDY))
                status = await client.status()
        finally:
            await server.stop(grace=1)

    versions = during.tokens.versions
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1, versions
    switch = versions.index(1)
    assert 20 <= switch < len(versions)
    old, new = greedy_reference(100, PROMPT, 160), greedy_reference(101, PROMPT, 160)
    assert during.tokens.token_ids[:switch] == old[:switch]
    assert after.tokens.token_ids == new and set(after.tokens.versions) == {1}
    assert (status.weight_version.version, status.weight_updates, status.failed_weight_updates) == (1, 2, 0)
