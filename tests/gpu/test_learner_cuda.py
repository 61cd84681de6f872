"""The torch learner on CUDA: a step lowers the loss on a fixed batch, and takes the step the CPU
learner takes (float32, TF32 off)."""

from __future__ import annotations

import torch

from pipelinerl.common.model import build_preset
from pipelinerl.trainer.config import LearnerConfig
from pipelinerl.trainer.learner import TorchLearner
from tests.gpu import needs_cuda
from tests.unit.test_learner import ToySampler, _alternate_rewards

pytestmark = needs_cuda

LR = 1e-3


def batch() -> list:
    return _alternate_rewards(
        ToySampler(build_preset("tiny", seed=0).model, seed=1).groups(0, groups=4, size=4)
    )


def test_a_step_on_cuda_lowers_the_loss_on_a_fixed_batch() -> None:
    model = build_preset("tiny", seed=0).model.to("cuda")
    learner = TorchLearner(model, LearnerConfig(lr=1e-2))
    samples = batch()
    first = learner.step(samples, current_version=0)
    second = learner.step(samples, current_version=1)
    assert first.stepped and second.stepped
    assert second.loss < first.loss, (first.loss, second.loss)


def test_a_step_on_cuda_matches_the_cpu_step() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    samples = batch()
    results = {}
    for device in ("cpu", "cuda"):
        model = build_preset("tiny", seed=0).model.to(device)
        metrics = TorchLearner(model, LearnerConfig(lr=LR)).step(samples, current_version=0)
        results[device] = (metrics, torch.cat([p.detach().flatten().cpu() for p in model.parameters()]))
    (cpu, cpu_params), (cuda, cuda_params) = results["cpu"], results["cuda"]
    assert abs(cuda.loss - cpu.loss) <= 1e-4 * max(abs(cpu.loss), 1e-3)
    assert abs(cuda.grad_norm - cpu.grad_norm) <= 1e-3 * cpu.grad_norm
    difference = (cuda_params - cpu_params).abs()
    # Adam moves each weight by about LR whatever its gradient, so a gradient whose sign differs by
    # rounding can move a weight 2 * LR apart; on average the steps agree far more closely.
    assert difference.max() <= 2.5 * LR and difference.mean() < LR / 100
