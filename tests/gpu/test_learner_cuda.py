"""The torch learner on CUDA: a step lowers the loss on a fixed batch (the advantage-weighted
log-likelihood the policy gradient climbs rises), and takes the step the CPU learner takes
(float32, TF32 off)."""

from __future__ import annotations

import torch

from pipelinerl.common.model import build_preset
from pipelinerl.common.types import Sample
from pipelinerl.trainer.config import LearnerConfig
from pipelinerl.trainer.learner import TorchLearner
from tests.gpu import needs_cuda
from tests.unit.test_learner import ToySampler, _alternate_rewards

pytestmark = needs_cuda

LR = 1e-3


def batch() -> list[Sample]:
    return _alternate_rewards(
        ToySampler(build_preset("tiny", seed=0).model, seed=1).groups(0, groups=4, size=4)
    )


@torch.no_grad()
def surrogate_loss(model: torch.nn.Module, samples: list[Sample]) -> float:
    """-Σ (reward - group mean) · log p(completion | prompt): what a policy-gradient step lowers."""
    groups: dict[str, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s.reward)
    total = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_token_ids + s.completion.token_ids], device="cuda")
        logprobs = model(ids).logits[0, len(s.prompt_token_ids) - 1 : -1].log_softmax(-1)
        completion = logprobs.gather(-1, ids[0, len(s.prompt_token_ids) :, None]).sum()
        baseline = sum(groups[s.group_id]) / len(groups[s.group_id])
        total -= (s.reward - baseline) * float(completion)
    return total


def test_a_step_on_cuda_lowers_the_loss_on_a_fixed_batch() -> None:
    model = build_preset("tiny", seed=0).model.to("cuda")
    samples = batch()
    before = surrogate_loss(model, samples)
    assert TorchLearner(model, LearnerConfig(lr=1e-3)).step(samples, current_version=0).stepped
    assert surrogate_loss(model, samples) < before


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
