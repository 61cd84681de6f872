"""Group-relative advantages: each sample's reward against the other attempts at the same prompt.

    samples ──group by group_id──► rewards r_1..r_n of one group
        mean baseline           A_i = r_i - mean(r)
        leave-one-out baseline  A_i = r_i - mean(r_j, j != i) = n / (n - 1) * (r_i - mean(r))
        optional std scaling    A_i / (std(r) + eps)
        negative advantages     A_i × negative_weight where A_i < 0 (1 by default)
    a group whose rewards are all equal teaches nothing (every A_i = 0): it is counted, and its
    samples are flagged so the learner leaves them out of the loss and its normalisation.

Only the samples passed in form a group: if the lag policy dropped some attempts of a prompt, the
baseline is computed from the ones that remain.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pipelinerl.common.types import Sample
from pipelinerl.trainer.config import AdvantageConfig, Baseline

# Rewards this close count as equal; exact float equality would miss 0.1 + 0.2 vs 0.3.
_EQUAL_REWARD_TOLERANCE = 1e-9


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: dict[str, float]
    """Advantage of every sample, by sample_id."""
    skipped: dict[str, bool]
    """Per sample_id: True when the sample is left out of the loss (its group had zero variance)."""
    groups: int
    zero_variance_groups: int

    def trained(self, samples: Sequence[Sample]) -> list[Sample]:
        """The samples that go into the loss, in their original order."""
        return [sample for sample in samples if not self.skipped[sample.sample_id]]


def compute_advantages(samples: Sequence[Sample], config: AdvantageConfig) -> GroupAdvantages:
    """Advantages of `samples`, grouped by `group_id`."""
    groups: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        groups[sample.group_id].append(sample)
    advantages: dict[str, float] = {}
    skipped: dict[str, bool] = {}
    zero_variance = 0
    for members in groups.values():
        rewards = [sample.reward for sample in members]
        flat = all_equal(rewards)
        zero_variance += flat
        for sample, advantage in zip(members, _group_advantages(rewards, config), strict=True):
            advantages[sample.sample_id] = 0.0 if flat else advantage
            skipped[sample.sample_id] = flat and config.skip_zero_variance
    return GroupAdvantages(advantages, skipped, len(groups), zero_variance)


def all_equal(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards are all equal, so that it teaches nothing."""
    return max(rewards) - min(rewards) <= _EQUAL_REWARD_TOLERANCE


def _group_advantages(rewards: list[float], config: AdvantageConfig) -> list[float]:
    n = len(rewards)
    mean = statistics.fmean(rewards)
    if config.baseline is Baseline.LEAVE_ONE_OUT and n > 1:
        total = sum(rewards)
        centred = [r - (total - r) / (n - 1) for r in rewards]
    else:
        # A group of one has no other samples to form a leave-one-out baseline; its own mean gives 0.
        centred = [r - mean for r in rewards]
    if config.scale_by_std and n > 1:
        scale = statistics.stdev(rewards) + config.std_eps
        centred = [a / scale for a in centred]
    return [a if a >= 0 else a * config.negative_weight for a in centred]
