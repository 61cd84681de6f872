"""DeepSpeed ZeRO-2 on one GPU rank (NCCL, under torchrun) takes the torch learner's steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelinerl.common.channel import free_port
from pipelinerl.common.model import build_preset
from pipelinerl.trainer.learner import TorchLearner
from tests.gpu import needs_cuda
from tests.integration.processes import ROOT
from tests.integration.test_deepspeed import ENV, max_difference
from tests.integration.zero_ranks import LEARNER
from tests.unit.test_learner import ToySampler, _alternate_rewards

pytestmark = [*needs_cuda, pytest.mark.slow]


def test_zero2_on_one_gpu_rank_steps_like_the_torch_learner(tmp_path: Path) -> None:
    sampler = ToySampler(build_preset("tiny", seed=0).model, seed=1)
    steps = [_alternate_rewards(sampler.groups(version=0, groups=3, size=4, length=5)) for _ in range(2)]
    torch.save(steps, tmp_path / "batches.pt")
    script = ROOT / "tests" / "integration" / "zero_ranks.py"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-port", str(free_port()),
        str(script), "2", str(tmp_path / "batches.pt"), str(tmp_path), "--cuda",
    ]  # fmt: skip
    done = subprocess.run(command, env=ENV, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    published = torch.load(tmp_path / "weights.pt")

    model = build_preset("tiny", seed=0).model.to("cuda")
    learner = TorchLearner(model, LEARNER)
    for version, samples in enumerate(steps):
        assert learner.step(samples, version).stepped
    expected = {name: p.detach().cpu() for name, p in model.named_parameters()}
    assert max_difference(published, expected) < 1e-4
