"""Group advantages: baselines on hand-computed groups, std scaling, and groups that teach nothing."""

from __future__ import annotations

import pytest

from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.trainer.advantages import compute_advantages
from pipelinerl.trainer.config import AdvantageConfig, Baseline


def _group(group_id: str, rewards: list[float]) -> list[Sample]:
    return [
        Sample(
            f"{group_id}/{i}", group_id, [1], TokenSequence([5], [-1.0], [0]), reward, group_size=len(rewards)
        )
        for i, reward in enumerate(rewards)
    ]


def _values(samples: list[Sample], config: AdvantageConfig) -> list[float]:
    advantages = compute_advantages(samples, config).advantages
    return [advantages[sample.sample_id] for sample in samples]


def test_mean_baseline_subtracts_the_group_mean() -> None:
    assert _values(_group("g", [1.0, 0.0, 0.5]), AdvantageConfig()) == pytest.approx([0.5, -0.5, 0.0])


def test_leave_one_out_baseline_is_the_mean_of_the_other_samples() -> None:
    # Baselines: (0 + 0.5) / 2 = 0.25, (1 + 0.5) / 2 = 0.75, (1 + 0) / 2 = 0.5.
    config = AdvantageConfig(baseline=Baseline.LEAVE_ONE_OUT)
    assert _values(_group("g", [1.0, 0.0, 0.5]), config) == pytest.approx([0.75, -0.75, 0.0])


def test_std_scaling_divides_by_the_group_std() -> None:
    # Sample std of 1, 0, 0.5 is 0.5.
    config = AdvantageConfig(scale_by_std=True, std_eps=1e-6)
    assert _values(_group("g", [1.0, 0.0, 0.5]), config) == pytest.approx([1.0, -1.0, 0.0], rel=1e-5)


def test_negative_weight_scales_only_the_advantages_below_zero() -> None:
    # Centred: 0.5, -0.5, 0; the negative one halved, then (with std scaling, std 0.5) doubled.
    assert _values(_group("g", [1.0, 0.0, 0.5]), AdvantageConfig(negative_weight=0.5)) == pytest.approx(
        [0.5, -0.25, 0.0]
    )
    config = AdvantageConfig(scale_by_std=True, std_eps=1e-6, negative_weight=0.0)
    assert _values(_group("g", [1.0, 0.0, 0.5]), config) == pytest.approx([1.0, 0.0, 0.0], rel=1e-5)


def test_negative_weight_leaves_a_group_that_teaches_nothing_skipped() -> None:
    samples = _group("failed", [0.0] * 4)
    result = compute_advantages(samples, AdvantageConfig(negative_weight=0.0))
    assert result.zero_variance_groups == 1
    assert result.trained(samples) == []


def test_groups_are_separated_by_group_id_even_when_interleaved() -> None:
    first, second = _group("a", [1.0, 0.0]), _group("b", [10.0, 20.0])
    interleaved = [first[0], second[0], first[1], second[1]]
    assert _values(interleaved, AdvantageConfig()) == pytest.approx([0.5, -5.0, -0.5, 5.0])


def test_zero_variance_groups_are_counted_and_their_samples_skipped() -> None:
    solved, failed, mixed = (
        _group("solved", [1.0] * 4),
        _group("failed", [0.0] * 4),
        _group("mixed", [1.0, 0.0]),
    )
    samples = solved + mixed + failed

    result = compute_advantages(samples, AdvantageConfig())

    assert result.groups == 3
    assert result.zero_variance_groups == 2
    assert [s.sample_id for s in result.trained(samples)] == ["mixed/0", "mixed/1"]
    assert all(result.skipped[s.sample_id] for s in solved + failed)
    assert all(result.advantages[s.sample_id] == 0.0 for s in solved + failed)


def test_zero_variance_groups_can_be_kept_in_the_loss() -> None:
    samples = _group("solved", [1.0] * 3)
    result = compute_advantages(samples, AdvantageConfig(skip_zero_variance=False))
    assert result.zero_variance_groups == 1
    assert result.trained(samples) == samples


def test_a_group_of_one_has_no_baseline_to_learn_from() -> None:
    samples = _group("alone", [1.0])
    result = compute_advantages(samples, AdvantageConfig(baseline=Baseline.LEAVE_ONE_OUT))
    assert result.advantages["alone/0"] == 0.0
    assert result.zero_variance_groups == 1
