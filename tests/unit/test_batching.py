"""Micro-batching: rows line up with the samples, packing respects the token budget, and how a step
is split into micro-batches does not change its gradient."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

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
from pipelinerl.trainer.learner import TorchLearner, completion_logits

PAD = 0


def _sample(sample_id: str, prompt: int, completion: int, *, reward: float = 0.0, seed: int = 0) -> Sample:
    rng = random.Random(seed)
    tokens = [rng.randrange(4, 100) for _ in range(prompt + completion)]
    logprobs = [-rng.uniform(0.5, 4.0) for _ in range(completion)]
    versions = [rng.randrange(0, 3) for _ in range(completion)]
    return Sample(sample_id, "g", tokens[:prompt], TokenSequence(tokens[prompt:], logprobs, versions), reward)


def test_rows_align_every_per_token_value_with_its_token_and_each_prompt_comes_once() -> None:
    long = Sample("long", "g", [1, 7, 8], TokenSequence([20, 21, 22], [-0.1, -0.2, -0.3], [4, 5, 5]), 1.0)
    short = Sample("short", "h", [1, 9], TokenSequence([30], [-0.5], [3]), 0.0)
    again = Sample("again", "g", [1, 7, 8], TokenSequence([23, 24], [-0.6, -0.7], [5, 5]), 0.0)

    batch = collate([long, short, again], {"long": 0.5, "short": -0.5, "again": 0.25}, PAD)

    assert batch.prompt_ids.tolist() == [[1, 7, 8], [1, 9, PAD]]
    assert batch.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.row_prompt.tolist() == [0, 1, 0]
    assert batch.completion_ids.tolist() == [[20, 21, 22], [30, PAD, PAD], [23, 24, PAD]]
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    torch.testing.assert_close(
        batch.behaviour_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0, 0], [-0.6, -0.7, 0]])
    )
    assert batch.advantages.tolist() == [[0.5, 0.5, 0.5], [-0.5, 0, 0], [0.25, 0.25, 0]]
    assert batch.sample_ids == ("long", "short", "again")
    assert batch.tokens == 5 + 6  # each prompt once


@pytest.mark.parametrize("budget", [40, 64, 100, 333])
def test_packing_never_exceeds_the_token_budget_and_keeps_every_sample(budget: int) -> None:
    rng = random.Random(budget)
    samples = [_sample(f"s{i}", rng.randint(1, 20), rng.randint(0, 20), seed=i) for i in range(50)]

    plan = plan_step(samples, {s.sample_id: 0.0 for s in samples}, budget, PAD, overhead_tokens=16)

    assert all(batch.padded_tokens <= budget for batch in plan.micro_batches)
    assert all(batch.row_prompt.max() < len(batch.prompt_ids) for batch in plan.micro_batches)
    packed_ids = [sample_id for batch in plan.micro_batches for sample_id in batch.sample_ids]
    assert sorted(packed_ids) == sorted(s.sample_id for s in samples)
    assert plan.totals.samples == 50
    assert plan.totals.completion_tokens == sum(len(s.completion) for s in samples)
    assert (
        sum(int(batch.completion_mask.sum()) for batch in plan.micro_batches) == plan.totals.completion_tokens
    )


def test_packing_puts_similar_lengths_together() -> None:
    samples = [_sample("a", 2, 30), _sample("b", 2, 2), _sample("c", 2, 30), _sample("d", 2, 2)]
    groups = pack(samples, token_budget=64, overhead_tokens=0)
    assert [[s.sample_id for s in group] for group in groups] == [["a", "c"], ["b", "d"]]


def test_a_sample_longer_than_the_budget_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="token budget"):
        pack([_sample("huge", 10, 30)], token_budget=32, overhead_tokens=0)


def test_a_shared_prompt_counts_once_against_the_budget() -> None:
    # Eight attempts at one 10-token prompt, 2 completion tokens each: 10 + 8 × 2 = 26 padded tokens.
    completion = TokenSequence([5, 6], [-1.0] * 2, [0] * 2)
    group = [Sample(f"a{i}", "g", [1] * 10, completion, 0.0) for i in range(8)]
    assert [len(batch) for batch in pack(group, token_budget=26, overhead_tokens=100)] == [8]
    assert [len(batch) for batch in pack(group, token_budget=25, overhead_tokens=100)] == [7, 1]


def _group(group: str, completion_lengths: list[int]) -> list[Sample]:
    """A group's attempts at one 4-token prompt, with completions of these lengths."""
    return [
        Sample(f"{group}/{i}", group, [1, 2, 3, 4], TokenSequence([5] * n, [-1.0] * n, [0] * n), 0.0)
        for i, n in enumerate(completion_lengths)
    ]


def test_a_long_tail_gets_micro_batches_of_its_own_where_padding_costs_more_than_a_pass() -> None:
    # Four 100-token completions among sixty of 10 tokens: one micro-batch would pad 6,000 tokens.
    samples = _group("a", [100] * 4 + [10] * 4) + [s for g in range(7) for s in _group(f"b{g}", [10] * 8)]
    batches = pack(samples, token_budget=8192, overhead_tokens=128)
    assert [sorted({len(s.completion) for s in batch}) for batch in batches] == [[100], [10]]


def test_short_answers_of_nearly_one_length_stay_in_one_micro_batch() -> None:
    # Splitting 3s from 2s would save 64 padded tokens, less than one more pass costs.
    samples = [s for g in range(16) for s in _group(f"g{g}", [3, 2] * 4)]
    assert len(pack(samples, token_budget=8192, overhead_tokens=128)) == 1
    assert len(pack(samples, token_budget=8192, overhead_tokens=16)) == 2


def test_packing_is_the_cheapest_cut_of_the_sorted_lengths_where_the_length_drops() -> None:
    rng = random.Random(7)
    samples = [_sample(f"s{i}", rng.randint(1, 6), rng.choice([1, 2, 5, 9, 30]), seed=i) for i in range(12)]

    def cost(batches: list[list[Sample]]) -> int:
        return sum(collate(b, {s.sample_id: 0.0 for s in b}, PAD).padded_tokens + 20 for b in batches)

    packed = pack(samples, token_budget=10_000, overhead_tokens=20)
    ordered = [s for batch in packed for s in batch]
    drops = [i for i in range(1, len(ordered)) if len(ordered[i].completion) < len(ordered[i - 1].completion)]
    every_cut = (
        [ordered[a:b] for a, b in zip((0, *cuts), (*cuts, len(ordered)), strict=True)]
        for n in range(len(drops) + 1)
        for cuts in itertools.combinations(drops, n)
    )
    assert len(drops) == 4
    assert cost(packed) == min(cost(batches) for batches in every_cut)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_preset("tiny", seed=0).model


@pytest.mark.parametrize("shared_prompts", [True, False], ids=["shared", "one-pass"])
@pytest.mark.parametrize("longest", [5, 1], ids=["mixed-lengths", "one-token"])
def test_completion_logits_equal_each_sample_run_alone(
    model: PreTrainedModel, shared_prompts: bool, longest: int
) -> None:
    # Two groups of prompts of different lengths, completions of different lengths, so the rows hold
    # prompt padding before their completion and completion padding after it; or one-token
    # completions only, where the prompts' pass is all the learner runs.
    prompts = [[1, 5, 6, 7, 8], [1, 9]]
    samples = [_sample(f"s{i}", 0, 1 + (3 * i) % longest, seed=i) for i in range(6)]
    samples = [replace(s, prompt_token_ids=prompts[i % 2]) for i, s in enumerate(samples)]
    batch = collate(samples, {s.sample_id: 0.0 for s in samples}, PAD)

    with torch.no_grad():
        logits = completion_logits(model, batch, temperature=0.5, shared_prompts=shared_prompts)
        for row, sample in enumerate(samples):
            alone = model(torch.tensor([sample.prompt_token_ids + sample.completion.token_ids])).logits[0]
            start, n = len(sample.prompt_token_ids) - 1, len(sample.completion)
            torch.testing.assert_close(logits[row, :n], alone[start : start + n] / 0.5, rtol=1e-4, atol=1e-4)


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
    whole = collate(samples, advantages, PAD).padded_tokens
    learner = TorchLearner(model, LearnerConfig(loss=loss))

    gradients = []
    for budget in (whole, whole // 2):
        plan = plan_step(samples, advantages, budget, PAD, overhead_tokens=10_000)
        assert (len(plan.micro_batches) == 1) == (budget == whole)
        learner.optimizer.zero_grad(set_to_none=True)
        learner.accumulate_gradients(plan)
        gradients.append(torch.cat([p.grad.flatten() for p in learner.model.parameters()]))

    assert gradients[0].abs().max() > 0
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-4, atol=1e-6)
