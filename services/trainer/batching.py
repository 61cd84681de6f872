"""Pack one optimizer step's samples into right-padded micro-batches that fit a token budget.

    samples of one step ──sort by length, fill rows while rows × longest ≤ budget──► micro-batches
    each micro-batch, one row per sample (prompt + completion, then padding):
        input_ids        p p p c c c _ _
        attention_mask   1 1 1 1 1 1 0 0
        position_ids     0 1 2 3 4 5 0 0
        completion_mask  0 0 0 1 1 1 0 0
        behaviour_logprobs, versions, advantages: the completion token's value, 0 elsewhere

Every per-token tensor is aligned with `input_ids`: position t describes token t. The learner
predicts token t from the logits at t - 1, so it reads these tensors from position 1 on.

The step's gradient is accumulated over the micro-batches; `StepTotals` carries the counts of the
whole step so each micro-batch's loss is normalised as if the step were one batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

import torch

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import Sample
from pipelinerl.trainer.losses import StepTotals


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded rows, one per sample; all tensors [rows, longest sample]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_mask: torch.Tensor
    """Bool: True where the token is a completion token (the ones the loss trains)."""
    behaviour_logprobs: torch.Tensor
    versions: torch.Tensor
    """Weight version that generated each completion token."""
    advantages: torch.Tensor
    """The sample's advantage, repeated on each of its completion tokens."""
    sample_ids: tuple[str, ...]

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens."""
        return int(self.attention_mask.sum())

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: its micro-batches, and the totals each micro-batch's loss divides by."""

    micro_batches: list[MicroBatch]
    totals: StepTotals


def plan_step(
    samples: Sequence[Sample], advantages: Mapping[str, float], token_budget: int, pad_token_id: int
) -> StepPlan:
    """Micro-batches of at most `token_budget` padded tokens (rows × longest row) holding `samples`."""
    groups = pack(samples, token_budget)
    totals = StepTotals(
        samples=len(samples), completion_tokens=sum(len(sample.completion) for sample in samples)
    )
    return StepPlan([collate(group, advantages, pad_token_id) for group in groups], totals)


def pack(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Group samples so that rows × longest row ≤ `token_budget` in every group.

    Longest first: each group's first sample fixes its padded width, so similar lengths share a
    micro-batch and little is spent on padding.
    """
    ordered = sorted(samples, key=_length, reverse=True)
    if ordered and _length(ordered[0]) > token_budget:
        raise InvalidArgument.field(
            "samples",
            f"sample {ordered[0].sample_id!r} has {_length(ordered[0])} tokens, "
            f"more than the micro-batch token budget of {token_budget}",
        )
    groups: list[list[Sample]] = []
    for sample in ordered:
        if groups and (len(groups[-1]) + 1) * _length(groups[-1][0]) <= token_budget:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def collate(samples: Sequence[Sample], advantages: Mapping[str, float], pad_token_id: int) -> MicroBatch:
    """One right-padded micro-batch with a row per sample."""
    width = max(_length(sample) for sample in samples)
    shape = (len(samples), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    completion_mask = torch.zeros(shape, dtype=torch.bool)
    behaviour_logprobs = torch.zeros(shape, dtype=torch.float32)
    versions = torch.zeros(shape, dtype=torch.long)
    token_advantages = torch.zeros(shape, dtype=torch.float32)
    for row, sample in enumerate(samples):
        start, end = len(sample.prompt_token_ids), _length(sample)
        input_ids[row, :end] = torch.tensor(sample.prompt_token_ids + sample.completion.token_ids)
        attention_mask[row, :end] = 1
        position_ids[row, :end] = torch.arange(end)
        completion_mask[row, start:end] = True
        behaviour_logprobs[row, start:end] = torch.tensor(sample.completion.logprobs)
        versions[row, start:end] = torch.tensor(sample.completion.versions, dtype=torch.long)
        token_advantages[row, start:end] = advantages[sample.sample_id]
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        completion_mask=completion_mask,
        behaviour_logprobs=behaviour_logprobs,
        versions=versions,
        advantages=token_advantages,
        sample_ids=tuple(sample.sample_id for sample in samples),
    )


def _length(sample: Sample) -> int:
    return len(sample.prompt_token_ids) + len(sample.completion)
