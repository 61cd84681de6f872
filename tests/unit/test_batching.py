"""Micro-batching: rows line up with the samples, packing respects the token budget, and how a step
is split into micro-batches does not change its gradient."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PreTrainedModel

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.model import build_preset
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.trainer.advantages import compute_advantages
from pipelinerl.trainer.batching import collate, pack, plan_step
from pipelinerl.trainer.config import (
    AdvantageConfig,
    LearnerConfig,
    LossConfig,
    PolicyLossKind,
    TokenWeighting,
)
from pipelinerl.trainer.learner import TorchLearner

PAD = 0


def _sample(sample_id: str, prompt: int, completion: int, *, reward: float = 0.0, seed: int = 0) -> Sample:
    rng = random.Random(seed)
    tokens = [rng.randrange(4, 100) for _ in range(prompt + completion)]
    logprobs = [-rng.uniform(0.5, 4.0) for _ in range(completion)]
    versions = [rng.randrange(0, 3) for _ in range(completion)]
    return Sample(sample_id, "g", tokens[:prompt], TokenSequence(tokens[prompt:], logprobs, versions), reward)


def test_rows_align_every_per_token_value_with_its_token() -> None:
    long = Sample("long", "g", [1, 7, 8], TokenSequence([20, 21, 22], [-0.1, -0.2, -0.3], [4, 5, 5]), 1.0)
    short = Sample("short", "g", [1, 9], TokenSequence([30], [-0.5], [3]), 0.0)

    batch = collate([long, short], {"long": 0.5, "short": -0.5}, PAD)

    assert batch.input_ids.tolist() == [[1, 7, 8, 20, 21, 22], [1, 9, 30, PAD, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.position_ids[:, :3].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert batch.completion_mask.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0]]
    torch.testing.assert_close(
        batch.behaviour_logprobs, torch.tensor([[0, 0, 0, -0.1, -0.2, -0.3], [0, 0, -0.5, 0, 0, 0]])
    )
    assert batch.versions.tolist() == [[0, 0, 0, 4, 5, 5], [0, 0, 3, 0, 0, 0]]
    assert batch.advantages.tolist() == [[0, 0, 0, 0.5, 0.5, 0.5], [0, 0, -0.5, 0, 0, 0]]
    assert batch.sample_ids == ("long", "short")
    assert batch.tokens == 9


@pytest.mark.parametrize("budget", [40, 64, 100, 333])
def test_packing_never_exceeds_the_token_budget_and_keeps_every_sample(budget: int) -> None:
    rng = random.Random(budget)
    samples = [_sample(f"s{i}", rng.randint(1, 20), rng.randint(0, 20), seed=i) for i in range(50)]

    plan = plan_step(samples, {s.sample_id: 0.0 for s in samples}, budget, PAD)

    assert all(batch.padded_tokens <= budget for batch in plan.micro_batches)
    packed_ids = [sample_id for batch in plan.micro_batches for sample_id in batch.sample_ids]
    assert sorted(packed_ids) == sorted(s.sample_id for s in samples)
    assert plan.totals.samples == 50
    assert plan.totals.completion_tokens == sum(len(s.completion) for s in samples)
    assert (
        sum(int(batch.completion_mask.sum()) for batch in plan.micro_batches) == plan.totals.completion_tokens
    )


def test_packing_puts_similar_lengths_together() -> None:
    samples = [_sample("a", 2, 30), _sample("b", 2, 2), _sample("c", 2, 30), _sample("d", 2, 2)]
    groups = pack(samples, token_budget=64)
    assert [[s.sample_id for s in group] for group in groups] == [["a", "c"], ["b", "d"]]


def test_a_sample_longer_than_the_budget_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="token budget"):
        pack([_sample("huge", 10, 30)], token_budget=32)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_preset("tiny", seed=0).model


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(kind=PolicyLossKind.REINFORCE, weighting=TokenWeighting.SAMPLE_COUNT),
        LossConfig(kind=PolicyLossKind.PPO, weighting=TokenWeighting.TOKEN),
        LossConfig(kind=PolicyLossKind.GSPO, weighting=TokenWeighting.SEQUENCE, gspo_clip_high=1.0),
    ],
    ids=lambda loss: loss.kind.value,
)
def test_split_into_micro_batches_gives_the_same_gradient(model: PreTrainedModel, loss: LossConfig) -> None:
    # Different lengths, so the two splits pad differently; off-policy logprobs, so ratios are not 1.
    samples = [_sample(f"s{i}", 3 + i, 6 - i, reward=float(i % 2), seed=i) for i in range(4)]
    advantages = compute_advantages(samples, AdvantageConfig()).advantages
    longest = max(len(s.prompt_token_ids) + len(s.completion) for s in samples)
    learner = TorchLearner(model, LearnerConfig(loss=loss))

    gradients = []
    for budget, expected_batches in [(4 * longest, 1), (2 * longest, 2)]:
        plan = plan_step(samples, advantages, budget, PAD)
        assert len(plan.micro_batches) == expected_batches
        learner.optimizer.zero_grad(set_to_none=True)
        learner.accumulate_gradients(plan)
        gradients.append(torch.cat([p.grad.flatten() for p in learner.model.parameters()]))

    assert gradients[0].abs().max() > 0
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-4, atol=1e-6)
