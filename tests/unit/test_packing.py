"""Packed micro-batches train exactly as padded ones: the same logprobs at every completion token,
and over randomized steps (lengths, group sizes, multi-turn samples, micro-batch splits, losses) the
same loss, gradient and step metrics within 1e-5."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pipelinerl.common.model import build_preset
from pipelinerl.common.types import Sample, Segment, SegmentKind, TokenSequence
from pipelinerl.trainer.batching import collate
from pipelinerl.trainer.config import LearnerConfig, LossConfig, PolicyLossKind, TokenWeighting
from pipelinerl.trainer.learner import StepMetrics, TorchLearner, completion_logits, gather_logprobs
from pipelinerl.trainer.packing import pack_by_tokens, packed_layout, packed_logits, use_packed_attention

PAD = 0
TOLERANCE = 1e-5

LAYOUT_METRICS = {"micro_batches", "tokens", "tokens_per_s", "prepare_s", "forward_backward_s", "optimizer_s",
                  "total_s"}  # fmt: skip
"""How a step was cut and how long it took: what packing changes on purpose. Every other field of
StepMetrics must match."""


def random_step(rng: random.Random, vocab: int = 100) -> list[Sample]:
    """Whole groups of 1-8 attempts (the first of 2 or more) with prompts of 1-24 tokens and
    completions from 1 to 60 tokens (mostly short, a long tail), about a third of them multi-turn:
    model turns with tool replies between them. Off-policy logprobs, mixed versions, rewards that
    vary within a group."""
    samples = []
    for g in range(rng.randint(1, 6)):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 24))]
        size = rng.randint(2 if g == 0 else 1, 8)  # one group at least that trains
        for a in range(size):
            length = max(1, min(60, int(rng.paretovariate(1.2) * 3)))
            ids = [rng.randrange(4, vocab) for _ in range(length)]
            segments: tuple[Segment, ...] = ()
            if length >= 3 and rng.random() < 0.35:
                segments = _turns(rng, length)
            model = [s.num_tokens for s in segments if s.kind is SegmentKind.MODEL]
            model_tokens = sum(model) if segments else length
            logprobs = [-rng.uniform(0.1, 5.0) for _ in range(model_tokens)]
            versions = [rng.randrange(0, 3) for _ in range(model_tokens)]
            samples.append(Sample(
                f"g{g}/{a}", f"g{g}", prompt, TokenSequence(ids, logprobs, versions), rng.random(),
                group_size=size, segments=segments,
            ))  # fmt: skip
    return samples


def _turns(rng: random.Random, length: int) -> tuple[Segment, ...]:
    """Segments tiling `length` tokens: a model turn first, then context and model runs."""
    segments, left, model = [], length, True
    while left:
        run = left if left <= 1 else rng.randint(1, left)
        segments.append(Segment(SegmentKind.MODEL if model else SegmentKind.CONTEXT, run))
        left -= run
        model = not model
    return tuple(segments)


@pytest.mark.parametrize("seed", range(6))
def test_packed_logprobs_equal_the_padded_ones_at_every_completion_token(seed: int) -> None:
    model = build_preset("tiny", seed=0).model
    samples = random_step(random.Random(seed))
    zero = {s.sample_id: 0.0 for s in samples}
    padded = collate(samples, zero, PAD)
    packed = collate(samples, zero, PAD, packed=True)
    layout = packed.packed
    assert layout is not None
    with torch.no_grad():
        padded_logits = completion_logits(model, padded, 0.7, shared_prompts=True)
        expected = gather_logprobs(padded_logits, padded.completion_ids)
        use_packed_attention(model)
        targets = packed.completion_ids[packed.completion_mask]
        got = layout.place(gather_logprobs(packed_logits(model, layout, 0.7), targets))
    mask = padded.completion_mask
    torch.testing.assert_close(got[mask], expected[mask], rtol=TOLERANCE, atol=TOLERANCE)
    # No padding: each distinct prompt once, every completion token but the last as an input.
    prompts = {tuple(s.prompt_token_ids) for s in samples}
    assert layout.tokens == sum(map(len, prompts)) + sum(len(s.completion) - 1 for s in samples)


def test_a_packed_row_restarts_positions_per_prompt_and_runs_each_prompt_once() -> None:
    long = Sample("long", "g", [1, 7, 8], TokenSequence([20, 21, 22], [-0.1, -0.2, -0.3], [4, 5, 5]), 1.0)
    short = Sample("short", "h", [1, 9], TokenSequence([30], [-0.5], [3]), 0.0)
    again = Sample("again", "g", [1, 7, 8], TokenSequence([23, 24], [-0.6, -0.7], [5, 5]), 0.0)

    layout = packed_layout([long, short, again])

    assert layout.input_ids.tolist() == [[1, 7, 8, 20, 21, 23, 1, 9]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    # long: from the prompt's last token, then its inputs; short: its prompt's last; again: likewise.
    assert layout.predicting.tolist() == [2, 3, 4, 7, 2, 5]
    assert layout.spread.tolist() == [[0, 1, 2], [3, 6, 6], [4, 5, 6]]


@pytest.mark.parametrize("seed", range(8))
def test_a_packed_step_equals_the_padded_step_within_1e_5(seed: int) -> None:
    rng = random.Random(100 + seed)
    samples = random_step(rng)
    losses = [
        LossConfig(kind=PolicyLossKind.REINFORCE, weighting=TokenWeighting.SAMPLE_COUNT),
        LossConfig(kind=PolicyLossKind.PPO, weighting=TokenWeighting.TOKEN, kl_coef=0.1),
        LossConfig(kind=PolicyLossKind.GSPO, weighting=TokenWeighting.SEQUENCE, gspo_clip_high=1.0),
        LossConfig(entropy_coef=0.03, entropy_floor=3.0, kl_coef=0.05),
        LossConfig(kind=PolicyLossKind.DECOUPLED, weighting=TokenWeighting.TOKEN, behaviour_cap=1.5),
        LossConfig(kind=PolicyLossKind.PPO, max_token_lag=2),  # versions 0-2 at step 3: lags 1-3
    ]  # not M2PO's mask: it is chosen within each micro-batch, and the two paths split differently
    loss = losses[seed % len(losses)]
    # Budgets from the longest sample up: one micro-batch, or splits that differ between the modes.
    longest = max(len(s.prompt_token_ids) + len(s.completion) for s in samples)
    total = sum(len(s.prompt_token_ids) + len(s.completion) for s in samples)
    budgets = [rng.randint(longest, max(longest, total)) for _ in range(2)]
    steps: list[tuple[StepMetrics, torch.Tensor]] = []
    for packing, budget in zip((False, True), budgets, strict=True):
        model = build_preset("tiny", seed=0).model
        config = LearnerConfig(lr=1e-3, packing=packing, micro_batch_tokens=budget, temperature=0.8,
                               loss=loss, gradient_checkpointing=seed % 3 == 2)  # fmt: skip
        metrics = TorchLearner(model, config).step(samples, current_version=3)
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        steps.append((metrics, torch.cat(grads)))
    (padded, padded_grad), (packed, packed_grad) = steps

    assert padded.stepped and packed.stepped
    assert padded_grad.abs().max() > 0
    torch.testing.assert_close(packed_grad, padded_grad, rtol=TOLERANCE, atol=TOLERANCE)
    for field in dataclasses.fields(StepMetrics):
        if field.name in LAYOUT_METRICS:
            continue
        got, expected = getattr(packed, field.name), getattr(padded, field.name)
        if isinstance(expected, float):
            assert got == pytest.approx(expected, rel=TOLERANCE, abs=TOLERANCE), field.name
        else:
            assert got == expected, field.name
    if padded.micro_batches == packed.micro_batches == 1:
        assert packed.tokens == padded.tokens


@pytest.mark.parametrize("budget", [30, 64, 200, 10_000])
def test_packing_by_tokens_keeps_every_sample_within_the_budget(budget: int) -> None:
    samples = random_step(random.Random(budget))
    longest = max(len(s.prompt_token_ids) + len(s.completion) for s in samples)
    budget = max(budget, longest)
    batches = pack_by_tokens(samples, budget)
    assert sorted(s.sample_id for b in batches for s in b) == sorted(s.sample_id for s in samples)
    for batch in batches:
        prompts = {tuple(s.prompt_token_ids) for s in batch}
        assert sum(map(len, prompts)) + sum(len(s.completion) for s in batch) <= budget
    prompts = {tuple(s.prompt_token_ids) for s in samples}
    total = sum(map(len, prompts)) + sum(len(s.completion) for s in samples)
    if total <= budget:
        assert len(batches) == 1
