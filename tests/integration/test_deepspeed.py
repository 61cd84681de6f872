"""The DeepSpeed backend over two gloo ranks (torchrun): ZeRO 1–3 take the same steps as the torch
learner, publish and checkpoint full weights, resume exactly, and run the trainer service."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from pipelinerl.common.channel import free_port
from pipelinerl.common.model import build_preset
from pipelinerl.common.types import Sample, Segment, SegmentKind
from pipelinerl.trainer.checkpoint import read_trainer_state
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.trainer.learner import TorchLearner
from pipelinerl.trainer.types import Disposition
from tests.integration.processes import ROOT, start_trainer
from tests.integration.test_trainer_loop import batches, final, group
from tests.integration.zero_ranks import LEARNER
from tests.unit.test_learner import ToySampler, _alternate_rewards

pytestmark = pytest.mark.slow

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), *args]  # fmt: skip


@pytest.fixture(scope="module")
def batches_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of three 4-sample groups, with rewards that leave no group flat."""
    sampler = ToySampler(build_preset("tiny", seed=0).model, seed=1)
    steps = [_alternate_rewards(sampler.groups(version=0, groups=3, size=4, length=5)) for _ in range(2)]
    path = tmp_path_factory.mktemp("zero") / "batches.pt"
    torch.save(steps, path)
    return path


def with_tool_replies(samples: list[Sample]) -> list[Sample]:
    """Each sample as an episode: its completion split after the second token by a tool's reply of
    three context tokens (which carry no logprob or version), the rest a second model turn."""
    episodes = []
    for i, sample in enumerate(samples):
        ids, head = sample.completion.token_ids, 2
        reply = [30 + i % 5, 31, 32]
        completion = replace(sample.completion, token_ids=[*ids[:head], *reply, *ids[head:]])
        segments = (
            Segment(SegmentKind.MODEL, head),
            Segment(SegmentKind.CONTEXT, len(reply)),
            Segment(SegmentKind.MODEL, len(ids) - head),
        )
        episodes.append(replace(sample, completion=completion, segments=segments))
    return episodes


def run_ranks(stage: int, samples: Path, out: Path, *flags: str) -> dict[str, torch.Tensor]:
    """Both ranks of tests/integration/zero_ranks.py; the weights rank 0 published."""
    script = str(ROOT / "tests" / "integration" / "zero_ranks.py")
    command = torchrun(script, str(stage), str(samples), str(out), *flags)
    done = subprocess.run(command, env=ENV, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    return torch.load(out / "weights.pt")


def torch_weights(steps: list, *, packing: bool = True) -> dict[str, torch.Tensor]:
    model = build_preset("tiny", seed=0).model
    learner = TorchLearner(model, LEARNER.model_copy(update={"packing": packing}))
    for version, samples in enumerate(steps):
        assert learner.step(samples, version).stepped
    return {name: p.detach() for name, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_steps_like_torch_and_checkpoints_full_weights(
    stage: int, batches_file: Path, tmp_path: Path
) -> None:
    published = run_ranks(stage, batches_file, tmp_path)
    expected = torch_weights(torch.load(batches_file, weights_only=False))
    initial = {n: p.detach() for n, p in build_preset("tiny", seed=0).model.named_parameters()}
    # Two Adam steps move weights by ~2e-3; the backends agree to float32 reduction-order rounding.
    assert max_difference(expected, initial) > 1e-3
    assert max_difference(published, expected) < 1e-4
    checkpoint = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert max_difference({n: p.detach() for n, p in checkpoint.named_parameters()}, published) == 0
    assert read_trainer_state(tmp_path / "checkpoint").version == 2


def test_zero3_steps_on_multi_turn_samples_like_torch(batches_file: Path, tmp_path: Path) -> None:
    steps = [with_tool_replies(samples) for samples in torch.load(batches_file, weights_only=False)]
    torch.save(steps, tmp_path / "episodes.pt")
    published = run_ranks(3, tmp_path / "episodes.pt", tmp_path)
    expected = torch_weights(steps)
    initial = {n: p.detach() for n, p in build_preset("tiny", seed=0).model.named_parameters()}
    assert max_difference(expected, initial) > 1e-3
    assert max_difference(published, expected) < 1e-4


def test_zero3_packed_steps_like_the_padded_torch_learner(batches_file: Path, tmp_path: Path) -> None:
    # Single-turn samples beside episodes, of different lengths: the ranks pack their micro-batches,
    # the torch learner pads them.
    steps = [
        [
            episode if i % 2 else sample
            for i, (sample, episode) in enumerate(zip(samples, with_tool_replies(samples), strict=True))
        ]
        for samples in torch.load(batches_file, weights_only=False)
    ]
    torch.save(steps, tmp_path / "mixed.pt")
    published = run_ranks(3, tmp_path / "mixed.pt", tmp_path)
    packed, padded = torch_weights(steps), torch_weights(steps, packing=False)
    initial = {n: p.detach() for n, p in build_preset("tiny", seed=0).model.named_parameters()}
    assert LEARNER.packing
    assert max_difference(padded, initial) > 1e-3
    assert max_difference(published, packed) < 1e-4
    # Adam's first steps move a weight by about lr whatever its gradient's size, so float32 rounding
    # of a near-zero gradient (packed against padded, equal within 1e-5: test_packing.py) shows up
    # to ~lr / 4 here; a wrong gradient would show ~lr.
    assert max_difference(published, padded) < 5e-4


def test_zero3_resume_restores_optimizer_state(batches_file: Path, tmp_path: Path) -> None:
    steps = torch.load(batches_file, weights_only=False)
    torch.save(steps[:1], tmp_path / "first.pt")
    torch.save(steps[1:], tmp_path / "second.pt")
    run_ranks(3, tmp_path / "first.pt", tmp_path)
    resumed = run_ranks(3, tmp_path / "second.pt", tmp_path, "--resume")
    # Without Adam's moments the second step would differ by ~1e-3.
    assert max_difference(resumed, torch_weights(steps)) < 1e-4
    assert read_trainer_state(tmp_path / "checkpoint").version == 2


async def test_trainer_service_on_two_zero3_ranks_checkpoints_at_stop_and_resumes(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump({
        "port": port, "run_id": "zero", "samples_per_step": 4, "backend": "deepspeed", "zero": {"stage": 3},
        "checkpoint_dir": str(tmp_path / "ckpt"), "learner": {"lr": 1e-3}, "broadcast_backend": "none",
    }))  # fmt: skip

    async def serve() -> subprocess.Popen[bytes]:
        command = torchrun("-m", "pipelinerl.trainer", "--config", str(config))
        return await start_trainer(command, f"127.0.0.1:{port}")

    async def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it; rank 0 drains and checkpoints
        await asyncio.to_thread(proc.wait, 60)

    proc = await serve()
    try:
        async with TrainerClient(f"127.0.0.1:{port}") as client:
            acks = [a async for a in client.submit(batches(group("a", 0, [0, 1]), group("b", 0, [0, 1])))]
            assert final(acks) == dict.fromkeys(["a-0", "a-1", "b-0", "b-1"], Disposition.TRAINED)
            status = await client.status()
            assert (status.version.version, status.trained_samples) == (1, 4)
        await stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert read_trainer_state(tmp_path / "ckpt" / "latest").version == 1

    proc = await serve()
    try:
        async with TrainerClient(f"127.0.0.1:{port}") as client:
            assert (await client.status()).version.version == 1
            acks = [a async for a in client.submit(batches(group("a", 1, [0, 1])))]
            assert final(acks) == {"a-0": Disposition.DUPLICATE, "a-1": Disposition.DUPLICATE}
        await stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_ranks_refuse_a_bad_sample_skip_a_non_finite_step_and_train_on(
    stage: int, tmp_path: Path
) -> None:
    """A sample outside the vocabulary is refused on every rank (the followers keep following); a
    step whose gradient overflows changes nothing and reports so; the next step trains."""
    script = str(ROOT / "tests" / "integration" / "zero_faults.py")
    done = subprocess.run(
        torchrun(script, str(stage), str(tmp_path / "report.json")), env=ENV, capture_output=True, timeout=240
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    assert json.loads((tmp_path / "report.json").read_text()) == {
        "refused": "samples[1].completion.token_ids[0]",
        "huge": {"stepped": False, "unchanged": True},
        "good": {"stepped": True, "changed": True},
    }
