"""The torch learner on the tiny preset: it learns a toy task, reports what it did, publishes the
inference model's parameter names, and resumes exactly from a checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import PreTrainedModel

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.model import build_preset, load_model
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.trainer.checkpoint import read_trainer_state
from pipelinerl.trainer.config import LearnerConfig, LossConfig
from pipelinerl.trainer.deepspeed_learner import DeepSpeedLearner
from pipelinerl.trainer.learner import TorchLearner
from pipelinerl.trainer.validation import SampleLimits

PROMPT = [1, 14, 15]  # <bos> "ab"
TARGET = 11  # "7": about 2% likely after PROMPT under the seed-0 tiny model


class ToySampler:
    """A stand-in inference server: samples completions from a model and records behaviour
    logprobs and the version of the weights that produced them."""

    def __init__(self, model: PreTrainedModel, seed: int = 0) -> None:
        self.model = model
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def groups(self, version: int, groups: int = 4, size: int = 8, length: int = 4) -> list[Sample]:
        ids = torch.tensor([PROMPT] * (groups * size))
        logprobs = []
        for _ in range(length):
            step = self.model(ids).logits[:, -1].float().log_softmax(-1)
            token = torch.multinomial(step.exp(), 1, generator=self.generator)
            logprobs.append(step.gather(-1, token))
            ids = torch.cat([ids, token], dim=1)
        completions, behaviour = ids[:, len(PROMPT) :].tolist(), torch.cat(logprobs, dim=1).tolist()
        samples = []
        for row, (completion, row_logprobs) in enumerate(zip(completions, behaviour, strict=True)):
            group_id = f"v{version}/g{row // size}"
            tokens = TokenSequence(completion, row_logprobs, [version] * length)
            reward = completion.count(TARGET) / length
            samples.append(Sample(f"{group_id}/{row % size}", group_id, PROMPT, tokens, reward))
        return samples


def _alternate_rewards(samples: list[Sample]) -> list[Sample]:
    """Rewards 0, 1, 0, 1... so that no group is flat whatever was sampled."""
    for i, sample in enumerate(samples):
        sample.reward = float(i % 2)
    return samples


def _params(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_training_on_a_toy_reward_makes_the_rewarded_token_frequent() -> None:
    model = build_preset("tiny", seed=0).model
    learner = TorchLearner(model, LearnerConfig(lr=1e-3))
    sampler = ToySampler(model)

    rewards = []
    for version in range(12):
        # Sample with the weights of every other version, so half the steps train on lag-1 tokens.
        if version % 2 == 0:
            samples = sampler.groups(version)
        rewards.append(learner.step(samples, version).reward_mean)

    # About 2% of tokens at first. Most sampler seeds end near 1, but a policy can also settle on one
    # completion that holds the target once (reward 0.25), whose groups are then flat, hence the bar.
    assert rewards[0] < 0.1
    assert rewards[-1] > 0.2


def test_metrics_describe_the_step() -> None:
    model = build_preset("tiny", seed=0).model
    learner = TorchLearner(model, LearnerConfig(lr=1e-3, micro_batch_tokens=28))
    sampled = _alternate_rewards(ToySampler(model, seed=1).groups(version=3, groups=2, size=4))
    flat = [
        Sample(f"flat/{i}", "flat", PROMPT, TokenSequence([5, 6], [-1.0, -1.0], [1, 1]), 1.0)
        for i in range(2)
    ]

    metrics = learner.step(sampled + flat, current_version=5)

    assert metrics.stepped
    assert (metrics.samples, metrics.trained_samples) == (10, 8)
    assert (metrics.groups, metrics.zero_variance_groups) == (3, 1)
    assert metrics.reward_mean == pytest.approx(6 / 10)
    assert metrics.lag_histogram == {2: 32}  # 8 completions of 4 tokens from version 3; flat left out
    assert metrics.completion_tokens == 32
    # One prompt of 3 tokens and at most 6 completions of 4 in 28 tokens; each runs its prompt once.
    assert metrics.micro_batches == 2
    assert metrics.tokens == 2 * 3 + 8 * 4
    assert metrics.ess == pytest.approx(1.0, abs=1e-4)  # sampled by these very weights
    assert metrics.mean_ratio == pytest.approx(1.0, abs=1e-4)
    assert metrics.clip_fraction == 0.0
    assert metrics.kl is None
    assert metrics.entropy is not None and metrics.entropy > 0
    assert metrics.grad_norm > 0
    assert metrics.tokens_per_s > 0
    assert metrics.total_s >= metrics.forward_backward_s + metrics.optimizer_s


def test_a_batch_of_zero_variance_groups_leaves_the_weights_alone() -> None:
    model = build_preset("tiny", seed=0).model
    learner = TorchLearner(model, LearnerConfig(lr=1e-2))
    before = _params(model)
    solved = [Sample(f"s{i}", "g", PROMPT, TokenSequence([5], [-1.0], [0]), 1.0) for i in range(4)]

    metrics = learner.step(solved, current_version=0)

    assert not metrics.stepped
    assert metrics.zero_variance_groups == 1
    assert metrics.trained_samples == 0
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_kl_to_the_reference_starts_at_zero_and_grows_as_the_policy_moves() -> None:
    model = build_preset("tiny", seed=0).model
    learner = TorchLearner(model, LearnerConfig(lr=1e-2, loss=LossConfig(kl_coef=0.1)))
    sampler = ToySampler(model, seed=2)

    first = learner.step(_alternate_rewards(sampler.groups(0, groups=2)), current_version=0)
    second = learner.step(_alternate_rewards(sampler.groups(1, groups=2)), current_version=1)

    assert first.kl == pytest.approx(0.0, abs=1e-6)
    assert second.kl is not None and second.kl > 1e-4


def test_kl_to_a_reference_hundreds_of_nats_away_still_takes_a_finite_step() -> None:
    """exp(ref - cur) overflows float32 past ~88 nats: the step must neither turn NaN nor be lost."""
    reference = build_preset("tiny", seed=0).model
    model = build_preset("tiny", seed=0).model
    with torch.no_grad():
        model.model.norm.weight.mul_(100)  # sharp logits: unlikely tokens drop to hundreds of nats below
    learner = TorchLearner(model, LearnerConfig(lr=1e-3, loss=LossConfig(kl_coef=0.1)), reference=reference)
    samples = _alternate_rewards(ToySampler(reference, seed=2).groups(0, groups=2))

    metrics = learner.step(samples, current_version=0)

    assert metrics.stepped
    assert math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)
    assert metrics.kl is not None and math.isfinite(metrics.kl) and metrics.kl > 1.0


def test_a_sample_outside_the_models_limits_is_refused_before_the_forward_pass() -> None:
    model = build_preset("tiny", seed=0).model
    learner = TorchLearner(model, LearnerConfig(micro_batch_tokens=512))
    # 100 characters and specials, 2 tool-call tags; the context is 1024
    assert learner.limits == SampleLimits(vocab_size=102, max_tokens=512)
    good = _alternate_rewards(ToySampler(model).groups(0, groups=1, size=2))
    bad = Sample("bad", good[0].group_id, [1, 102], TokenSequence([5], [-1.0], [0]), 0.0)

    with pytest.raises(InvalidArgument) as exc:
        learner.step([*good, bad], current_version=0)
    assert exc.value.violations[0].field == "samples[2].prompt_token_ids[1]"


def test_deepspeed_micro_batches_never_get_a_budget_below_the_longest_sample() -> None:
    """Halving the budget to give every rank a micro-batch stops at the longest sample, which must
    still fit one."""
    lengths = [10, 3, 3, 3]
    samples = [
        Sample(f"s{i}", "g", [1] * (n - 1), TokenSequence([5], [-1.0], [0]), float(i))
        for i, n in enumerate(lengths)
    ]
    ranks = SimpleNamespace(world_size=4, config=LearnerConfig(micro_batch_tokens=64), _pad_token_id=0)

    plan = DeepSpeedLearner._plan(ranks, samples, {s.sample_id: 1.0 for s in samples}, 0)  # type: ignore[arg-type]

    assert sorted(len(batch.sample_ids) for batch in plan.micro_batches) == [1, 3]  # the 10 alone


def test_gradient_checkpointing_does_not_change_the_gradient() -> None:
    # Checkpointing runs each row's prompt with its completion; without, the prompt runs once.
    samples = _alternate_rewards(ToySampler(build_preset("tiny", seed=0).model, seed=3).groups(0, groups=2))
    gradients = []
    for checkpointing in (False, True):
        model = build_preset("tiny", seed=0).model
        learner = TorchLearner(model, LearnerConfig(gradient_checkpointing=checkpointing))
        advantages = {s.sample_id: s.reward - 0.5 for s in samples}
        learner.accumulate_gradients(learner._plan(samples, advantages, 0))
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointing
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert gradients[0].abs().max() > 0
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-4, atol=1e-6)


def test_published_weights_carry_the_inference_models_names_and_the_new_values() -> None:
    model = build_preset("tiny", seed=0).model
    learner = TorchLearner(model, LearnerConfig(lr=1e-2))
    initial = {name: t.clone() for name, t in learner.weights_for_publish().items()}

    learner.step(_alternate_rewards(ToySampler(model, seed=4).groups(0, groups=2)), current_version=0)
    published = learner.weights_for_publish()

    assert list(published) == [name for name, _ in build_preset("tiny").model.named_parameters()]
    assert not torch.equal(published["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])


def test_checkpoint_round_trip_restores_weights_optimizer_and_version(tmp_path: Path) -> None:
    loaded = build_preset("tiny", seed=0)
    learner = TorchLearner(loaded.model, LearnerConfig(lr=1e-3), tokenizer=loaded.tokenizer)
    sampler = ToySampler(loaded.model, seed=5)
    for version in range(2):
        learner.step(_alternate_rewards(sampler.groups(version, groups=2)), version)
    learner.save_checkpoint(tmp_path / "ckpt", version=2, extra_state={"trained_ids": ["a", "b"]})

    resumed = TorchLearner(build_preset("tiny", seed=7).model, LearnerConfig(lr=1e-3))
    version = resumed.load_checkpoint(tmp_path / "ckpt")

    assert version == 2
    assert read_trainer_state(tmp_path / "ckpt").extra_state == {"trained_ids": ["a", "b"]}
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, dict(learner.model.named_parameters())[name]), name
    original_state = learner.optimizer.state_dict()["state"]
    for index, state in resumed.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, original_state[index][key]), (index, key)
    # The same next step from both gives the same weights, which needs Adam's moments and step count.
    samples = _alternate_rewards(sampler.groups(2, groups=2))
    learner.step(samples, 2)
    resumed.step(samples, 2)
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, dict(learner.model.named_parameters())[name]), name
    # An HF directory that the inference service loads as it is.
    served = load_model(tmp_path / "ckpt").model
    assert torch.equal(served.lm_head.weight, served.model.embed_tokens.weight)


def test_saving_again_replaces_the_checkpoint(tmp_path: Path) -> None:
    learner = TorchLearner(build_preset("tiny", seed=0).model)
    learner.save_checkpoint(tmp_path / "ckpt", version=1)
    learner.save_checkpoint(tmp_path / "ckpt", version=2)
    assert read_trainer_state(tmp_path / "ckpt").version == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
