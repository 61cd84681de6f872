"""Segmented (multi-turn) samples in the learner: one causal stream whose context tokens are
attended to and never trained, against a loss computed by hand; single-turn samples train exactly as
before."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import PreTrainedModel

from pipelinerl.common.model import build_preset
from pipelinerl.common.types import Sample, Segment, SegmentKind, TokenSequence
from pipelinerl.trainer.advantages import compute_advantages
from pipelinerl.trainer.batching import collate, plan_step
from pipelinerl.trainer.config import (
    AdvantageConfig,
    LearnerConfig,
    LossConfig,
    PolicyLossKind,
    TokenWeighting,
)
from pipelinerl.trainer.learner import TorchLearner, lag_histogram
from pipelinerl.trainer.losses import LossStats

PAD = 0
MODEL, CONTEXT = SegmentKind.MODEL, SegmentKind.CONTEXT
PROMPT = [1, 5, 6]
STEP_VERSION = 2
"""The version `learner_loss_and_gradient` trains at: the episodes' first tokens are 2 behind it."""


def episode(sample_id: str, reward: float, turns: list[tuple[SegmentKind, list[int]]]) -> Sample:
    """A segmented sample of group "g": its model tokens get distinct off-policy logprobs and a
    version each (the later the turn, the newer)."""
    ids = [t for _, tokens in turns for t in tokens]
    model_tokens = sum(len(tokens) for kind, tokens in turns if kind is MODEL)
    logprobs = [-0.4 - 0.3 * i for i in range(model_tokens)]
    versions = [i // 2 for i in range(model_tokens)]
    segments = tuple(Segment(kind, len(tokens)) for kind, tokens in turns)
    tokens = TokenSequence(ids, logprobs, versions)
    return Sample(sample_id, "g", PROMPT, tokens, reward, group_size=2, segments=segments)


TWO_TURNS = [(MODEL, [20, 21]), (CONTEXT, [30, 31, 32]), (MODEL, [22, 23, 24])]
OTHER_TWO_TURNS = [(MODEL, [25]), (CONTEXT, [33, 34]), (MODEL, [26, 27]), (CONTEXT, [35])]


@pytest.fixture
def model() -> PreTrainedModel:
    return build_preset("tiny", seed=0).model


def gradient(model: PreTrainedModel) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def learner_loss_and_gradient(
    learner: TorchLearner, samples: list[Sample], budget: int = 4096
) -> tuple[LossStats, torch.Tensor]:
    advantages = compute_advantages(samples, AdvantageConfig()).advantages
    plan = plan_step(samples, advantages, budget, PAD, overhead_tokens=0, version=STEP_VERSION)
    learner.optimizer.zero_grad(set_to_none=True)
    stats = learner.accumulate_gradients(plan)
    return stats, gradient(learner.model)


def test_a_segmented_row_attends_to_every_token_and_trains_the_models_only() -> None:
    single = Sample("single", "h", [1, 9], TokenSequence([40, 41], [-0.5, -0.6], [3, 3]), 0.0)
    batch = collate([episode("e", 1.0, TWO_TURNS), single], {"e": 0.5, "single": -0.5}, PAD)

    assert batch.completion_ids.tolist() == [[20, 21, 30, 31, 32, 22, 23, 24], [40, 41] + [PAD] * 6]
    assert batch.completion_mask.tolist() == [[True] * 8, [True] * 2 + [False] * 6]
    assert batch.loss_mask.tolist() == [
        [True, True, False, False, False, True, True, True],
        [True, True] + [False] * 6,
    ]
    torch.testing.assert_close(
        batch.behaviour_logprobs,
        torch.tensor([[-0.4, -0.7, 0, 0, 0, -1.0, -1.3, -1.6], [-0.5, -0.6, 0, 0, 0, 0, 0, 0]]),
    )
    assert batch.advantages.tolist() == [[0.5, 0.5, 0, 0, 0, 0.5, 0.5, 0.5], [-0.5, -0.5] + [0.0] * 6]
    assert batch.token_lag is None  # made without the step's version
    # Versions 0, 0, 1, 1, 2 at the episode's model tokens and 3, 3 at the single's, seen from 3.
    lags = collate(
        [episode("e", 1.0, TWO_TURNS), single], {"e": 0.5, "single": -0.5}, PAD, version=3
    ).token_lag
    assert lags is not None and lags.tolist() == [[3, 3, 0, 0, 0, 2, 2, 1], [0] * 8]
    plan = plan_step([episode("e", 1.0, TWO_TURNS), single], {"e": 0.5, "single": -0.5}, 64, PAD,
                     overhead_tokens=0)  # fmt: skip
    assert plan.totals.completion_tokens == 5 + 2  # model tokens: what the loss sees


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(kind=PolicyLossKind.REINFORCE, weighting=TokenWeighting.SAMPLE_COUNT),
        LossConfig(kind=PolicyLossKind.PPO, weighting=TokenWeighting.TOKEN),
        LossConfig(kind=PolicyLossKind.REINFORCE, max_token_lag=1),
    ],
    ids=lambda loss: f"{loss.kind.value}-lag={loss.max_token_lag}",
)
def test_loss_and_gradient_are_those_computed_by_hand_over_the_model_spans(
    model: PreTrainedModel, loss: LossConfig
) -> None:
    samples = [episode("e0", 0.0, TWO_TURNS), episode("e1", 1.0, OTHER_TWO_TURNS)]
    learner = TorchLearner(model, LearnerConfig(loss=loss))
    stats, got = learner_loss_and_gradient(learner, samples)

    # By hand: each sample run whole in one plain forward pass (context tokens in its attention),
    # the per-token objective summed over the tokens of its model spans only.
    model.zero_grad(set_to_none=True)
    model.train()
    model_tokens = sum(s.model_tokens for s in samples)
    expected = torch.zeros(())
    for sample, advantage in zip(samples, (-0.5, 0.5), strict=True):
        stream = torch.tensor([sample.prompt_token_ids + sample.completion.token_ids])
        logprobs = model(stream).logits[0].float().log_softmax(-1)
        start = len(sample.prompt_token_ids)
        positions = [start + t for t, trained in enumerate(sample.model_mask()) if trained]
        assert len(positions) == len(sample.completion.logprobs)
        tokens = zip(positions, sample.completion.logprobs, sample.completion.versions, strict=True)
        for position, behaviour, version in tokens:
            if loss.max_token_lag is not None and STEP_VERSION - version > loss.max_token_lag:
                continue  # sampled by weights too old: no term, though it counts in the step's tokens
            current = logprobs[position - 1, int(stream[0, position])]
            ratio = torch.exp(current - behaviour)
            if loss.kind is PolicyLossKind.REINFORCE:
                term = -ratio.detach().clamp(max=loss.ratio_cap) * advantage * current / len(samples)
            else:
                clipped = ratio.clamp(1 - loss.clip_eps, 1 + loss.clip_eps)
                term = -torch.minimum(ratio * advantage, clipped * advantage) / model_tokens
            expected = expected + term
    expected.backward()
    model.eval()

    assert stats.tokens == model_tokens == 5 + 3
    # The first two tokens of each episode are 2 versions old.
    assert stats.clipped_tokens >= (4 if loss.max_token_lag == 1 else 0)
    assert stats.loss == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-7)
    assert got.abs().max() > 0
    torch.testing.assert_close(got, gradient(model), rtol=1e-4, atol=1e-6)


def test_context_tokens_shape_the_gradient_through_attention_alone(model: PreTrainedModel) -> None:
    learner = TorchLearner(model, LearnerConfig())
    base = [episode("e0", 0.0, TWO_TURNS), episode("e1", 1.0, OTHER_TWO_TURNS)]
    _, before = learner_loss_and_gradient(learner, base)
    # Other context tokens: the model tokens are predicted from a different history.
    other = [(MODEL, [20, 21]), (CONTEXT, [50, 51, 52]), (MODEL, [22, 23, 24])]
    stats, after = learner_loss_and_gradient(learner, [episode("e0", 0.0, other), base[1]])
    assert stats.tokens == 8
    assert not torch.allclose(before, after)


def test_metrics_count_model_tokens_only(model: PreTrainedModel) -> None:
    learner = TorchLearner(model, LearnerConfig(lr=1e-3, loss=LossConfig(kl_coef=0.1)))
    samples = [episode("e0", 0.0, TWO_TURNS), episode("e1", 1.0, OTHER_TWO_TURNS)]
    metrics = learner.step(samples, current_version=2)

    assert metrics.stepped
    assert metrics.completion_tokens == 8
    assert metrics.tokens == len(PROMPT) + 8 + 6  # the shared prompt once, model and context tokens
    # Versions 0, 0, 1, 1, 2 and 0, 0, 1: one per model token.
    assert metrics.lag_histogram == {2: 4, 1: 3, 0: 1} == lag_histogram(samples, 2)
    assert metrics.kl == pytest.approx(0.0, abs=1e-6)
    assert metrics.entropy is not None and math.isfinite(metrics.entropy)
    assert 0 < metrics.ess <= 1


@pytest.mark.parametrize("kind", list(PolicyLossKind), ids=lambda kind: kind.value)
def test_single_turn_samples_train_bit_for_bit_as_one_model_segment(
    model: PreTrainedModel, kind: PolicyLossKind
) -> None:
    """The single-turn path (no segments: every completion token trained) and the segmented path
    (the loss mask built from segments), on the same batch, give identical losses and gradients."""
    learner = TorchLearner(model, LearnerConfig(loss=LossConfig(kind=kind, entropy_coef=0.01)))
    singles = [
        Sample(f"s{i}", "g", PROMPT, TokenSequence([20 + i, 21, 22 - i][: 1 + i], [-0.5, -1.0, -2.0][: 1 + i],
               [0] * (1 + i)), float(i % 2), group_size=3)
        for i in range(3)
    ]  # fmt: skip
    segmented = [replace(s, segments=(Segment(MODEL, len(s.completion)),)) for s in singles]
    old_stats, old = learner_loss_and_gradient(learner, singles)
    new_stats, new = learner_loss_and_gradient(learner, segmented)

    assert old.abs().max() > 0
    assert torch.equal(old, new)
    assert old_stats == new_stats


def test_a_step_mixing_single_turn_and_segmented_samples_splits_without_changing_its_gradient(
    model: PreTrainedModel,
) -> None:
    single = [
        Sample(f"s{i}", "s", [1, 7], TokenSequence([40 + i, 41, 42], [-0.3, -1.1, -0.8], [0, 0, 0]), float(i),
               group_size=2)
        for i in range(2)
    ]  # fmt: skip
    samples = [episode("e0", 0.0, TWO_TURNS), episode("e1", 1.0, OTHER_TWO_TURNS), *single]
    learner = TorchLearner(model, LearnerConfig())
    advantages = compute_advantages(samples, AdvantageConfig()).advantages
    whole = collate(samples, advantages, PAD).padded_tokens
    _, one = learner_loss_and_gradient(learner, samples, whole)
    assert len(plan_step(samples, advantages, 12, PAD, overhead_tokens=0).micro_batches) > 1
    _, split = learner_loss_and_gradient(learner, samples, 12)
    torch.testing.assert_close(split, one, rtol=1e-4, atol=1e-6)
