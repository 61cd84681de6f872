"""Pack one optimizer step's samples into micro-batches that fit a token budget, each prompt once.

    samples of one step ──longest completion first, cut where padding costs more than a pass──► micro-batches
    each micro-batch: the distinct prompts of its samples, then one completion row per sample
        prompt_ids        p p p _        (one row per distinct prompt, right-padded)
        prompt_mask       1 1 1 0
        completion_ids    c c c _ _      (one row per sample, right-padded)
        completion_mask   1 1 1 0 0      (attended to)
        loss_mask         1 1 1 0 0      (trained: the model's tokens)
        row_prompt        the prompt row of each completion row
        behaviour_logprobs, advantages: per completion token, 0 on padding and context tokens
        token_lag         versions between each model token's weights and the step's (when the
                          plan is given the step's version: `learner.loss.max_token_lag` reads it)

A segmented (multi-turn) sample is one row too: its completion holds the model's turns and the
context between them (tool results, observations), attended to as one causal sequence; only its
model tokens are in `loss_mask` and carry behaviour logprobs.

        completion_ids    m m c c c m m _      (m: sampled by the model, c: context)
        completion_mask   1 1 1 1 1 1 1 0
        loss_mask         1 1 0 0 0 1 1 0

A group's attempts share their prompt, so the learner runs the prompt once and its completions
on the prompt's key/value cache (see `completion_logits` in learner.py): on short answers to
prompts of their own length that is nearly half of a step's tokens.

Every per-token tensor is aligned with `completion_ids`: position t describes completion token t,
which the learner predicts from the prompt's last position (t = 0) or from completion token t - 1.

With packing (the learner's default, `LearnerConfig.packing`), a micro-batch also carries a
`PackedLayout` (packing.py): the same rows run as one unpadded row of tokens, each prompt once, and
the micro-batches are cut by real tokens instead of padded ones (`pack_by_tokens`). The per-token
tensors above keep their padded [rows, completion positions] shape, so the losses read both alike.

The step's gradient is accumulated over the micro-batches; `StepTotals` carries the counts of the
whole step so each micro-batch's loss is normalised as if the step were one batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TypeVar

import torch

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import Sample
from pipelinerl.trainer.lineage import Lost, lineage_lag
from pipelinerl.trainer.losses import StepTotals
from pipelinerl.trainer.packing import PackedLayout, pack_by_tokens, packed_layout

T = TypeVar("T", int, float)


@dataclass(frozen=True)
class MicroBatch:
    """The distinct prompts [prompts, longest prompt] and one completion row per sample
    [rows, longest completion]."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    """1 on prompt tokens, 0 on padding (long, as HF attention masks are)."""
    row_prompt: torch.Tensor
    """[rows]: the index of each row's prompt in `prompt_ids`."""
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    """Bool: True on completion tokens (attended to), False on padding."""
    loss_mask: torch.Tensor
    """Bool: True on the tokens the loss trains, the model's: every completion token of a
    single-turn sample, the model segments' of a segmented one."""
    behaviour_logprobs: torch.Tensor
    """At model tokens; 0 elsewhere."""
    advantages: torch.Tensor
    """The sample's advantage, repeated on each of its model tokens."""
    sample_ids: tuple[str, ...]
    token_lag: torch.Tensor | None = None
    """At model tokens: versions between the weights that sampled the token and the ones the step
    trains (0 elsewhere); None when the plan was made without the step's version."""
    packed: PackedLayout | None = None
    """The rows as one unpadded row of tokens, when the step is packed; None runs them padded."""

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """[prompts]: the real tokens of each prompt."""
        return self.prompt_mask.sum(dim=1)

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens the forward pass runs: each prompt once, every completion."""
        return int(self.prompt_mask.sum()) + int(self.completion_mask.sum())

    @property
    def padded_tokens(self) -> int:
        """What the forward pass runs, padding included (packed: its real tokens)."""
        if self.packed is not None:
            return self.tokens
        return self.prompt_ids.numel() + self.completion_ids.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        moved: dict[str, object] = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        if self.packed is not None:
            moved["packed"] = self.packed.to(device)
        return replace(self, **moved)


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: its micro-batches, and the totals each micro-batch's loss divides by."""

    micro_batches: list[MicroBatch]
    totals: StepTotals


def plan_step(
    samples: Sequence[Sample],
    advantages: Mapping[str, float],
    token_budget: int,
    pad_token_id: int,
    *,
    overhead_tokens: int,
    packed: bool = False,
    version: int | None = None,
    lost: Lost = (),
) -> StepPlan:
    """Micro-batches of at most `token_budget` padded tokens holding `samples` (see `pack`); with
    `packed`, of at most `token_budget` real tokens, each with its packed row (`pack_by_tokens`).
    `version`, the weights the step trains, gives each micro-batch its tokens' lag (counted along the
    lineage, given the versions restarts `lost`)."""
    if packed:
        _check_budget(samples, token_budget)
        groups = pack_by_tokens(samples, token_budget)
    else:
        groups = pack(samples, token_budget, overhead_tokens=overhead_tokens)
    totals = StepTotals(
        samples=len(samples), completion_tokens=sum(sample.model_tokens for sample in samples)
    )
    batches = [
        collate(group, advantages, pad_token_id, packed=packed, version=version, lost=lost)
        for group in groups
    ]
    return StepPlan(batches, totals)


def pack(samples: Sequence[Sample], token_budget: int, *, overhead_tokens: int) -> list[list[Sample]]:
    """Group samples into micro-batches whose padded tokens (distinct prompts × longest prompt plus
    rows × longest completion) stay within `token_budget`, at the least cost: padded tokens plus
    `overhead_tokens` per micro-batch (what one more forward and backward pass costs beyond its
    tokens).

    Completions longest first, so each micro-batch is a run of similar lengths, and within one
    length a group's attempts (one prompt) sit together. A long tail gets micro-batches of its own
    instead of padding every short row to its length; short answers of nearly one length stay in
    one micro-batch. Rows of one length that overflow the budget fill micro-batches in order.
    """
    _check_budget(samples, token_budget)
    ordered = sorted(
        samples, key=lambda s: (len(s.completion), len(s.prompt_token_ids), s.prompt_token_ids), reverse=True
    )
    batches: list[_Packing] = []
    for start, end in _cheapest_ranges(ordered, token_budget, overhead_tokens):
        first = len(batches)
        for sample in ordered[start:end]:
            if len(batches) == first or not batches[-1].add(sample, token_budget):
                batches.append(_Packing(sample))
    return [batch.samples for batch in batches]


def _check_budget(samples: Sequence[Sample], token_budget: int) -> None:
    longest = max(samples, key=_length, default=None)
    if longest is not None and _length(longest) > token_budget:
        raise InvalidArgument.field(
            "samples",
            f"sample {longest.sample_id!r} has {_length(longest)} tokens, "
            f"more than the micro-batch token budget of {token_budget}",
        )


def _cheapest_ranges(
    ordered: Sequence[Sample], token_budget: int, overhead_tokens: int
) -> list[tuple[int, int]]:
    """Cut `ordered` (longest completion first) into ranges, each a micro-batch, at the points where
    the completion length drops, choosing the cuts by dynamic programming to minimise padded tokens
    plus `overhead_tokens` per micro-batch. A range holds one length's rows at least and stays
    within the budget otherwise, which bounds the work by the rows one budget holds."""
    prompt_index: dict[tuple[int, ...], int] = {}
    prompts = [prompt_index.setdefault(tuple(s.prompt_token_ids), len(prompt_index)) for s in ordered]
    cuts = [i for i, s in enumerate(ordered) if i == 0 or len(s.completion) < len(ordered[i - 1].completion)]
    cuts.append(len(ordered))
    # cost[k]: the least cost of the rows from cuts[k] on; upto[k]: where its first range ends.
    cost, upto = [0.0] * len(cuts), list(range(len(cuts)))
    for k in range(len(cuts) - 2, -1, -1):
        width = len(ordered[cuts[k]].completion)
        seen: set[int] = set()
        longest_prompt = 0
        cost[k] = math.inf
        for end in range(k + 1, len(cuts)):
            for i in range(cuts[end - 1], cuts[end]):
                seen.add(prompts[i])
                longest_prompt = max(longest_prompt, len(ordered[i].prompt_token_ids))
            tokens = _padded_tokens(len(seen), longest_prompt, cuts[end] - cuts[k], width)
            if tokens > token_budget and end > k + 1:
                break
            total = tokens + math.ceil(tokens / token_budget) * overhead_tokens + cost[end]
            if total < cost[k]:
                cost[k], upto[k] = total, end
    ranges, k = [], 0
    while k < len(cuts) - 1:
        ranges.append((cuts[k], cuts[upto[k]]))
        k = upto[k]
    return ranges


class _Packing:
    """One micro-batch being filled: its samples and the sizes that fix its padded tokens."""

    def __init__(self, first: Sample) -> None:
        self.samples = [first]
        self.prompts = {tuple(first.prompt_token_ids)}
        self.longest_prompt = len(first.prompt_token_ids)
        self.longest_completion = len(first.completion)

    def add(self, sample: Sample, token_budget: int) -> bool:
        """Take `sample` if the micro-batch stays within `token_budget`; False leaves it unchanged."""
        prompts = self.prompts | {tuple(sample.prompt_token_ids)}
        longest_prompt = max(self.longest_prompt, len(sample.prompt_token_ids))
        longest_completion = max(self.longest_completion, len(sample.completion))
        if (
            _padded_tokens(len(prompts), longest_prompt, len(self.samples) + 1, longest_completion)
            > token_budget
        ):
            return False
        self.samples.append(sample)
        self.prompts = prompts
        self.longest_prompt, self.longest_completion = longest_prompt, longest_completion
        return True


def _padded_tokens(prompts: int, longest_prompt: int, rows: int, longest_completion: int) -> int:
    """What a micro-batch runs, padding included: its distinct prompts, then its completion rows."""
    return prompts * longest_prompt + rows * longest_completion


def collate(
    samples: Sequence[Sample],
    advantages: Mapping[str, float],
    pad_token_id: int,
    *,
    packed: bool = False,
    version: int | None = None,
    lost: Lost = (),
) -> MicroBatch:
    """One micro-batch: each distinct prompt once, a completion row per sample, right-padded; with
    `packed`, their packed row too; with `version`, each model token's lag behind it."""
    prompt_rows: dict[tuple[int, ...], int] = {}
    row_prompt = [prompt_rows.setdefault(tuple(s.prompt_token_ids), len(prompt_rows)) for s in samples]
    prompt_ids, prompt_mask = _right_padded(list(prompt_rows), pad_token_id)
    completion_ids, completion_mask = _right_padded([s.completion.token_ids for s in samples], pad_token_id)
    width = completion_ids.shape[1]
    logprobs = [_at_model_tokens(s, s.completion.logprobs, 0.0) for s in samples]
    behaviour_logprobs = torch.tensor(_padded(logprobs, 0.0, width), dtype=torch.float32)
    per_token = [_at_model_tokens(s, [advantages[s.sample_id]] * s.model_tokens, 0.0) for s in samples]
    token_advantages = torch.tensor(_padded(per_token, 0.0, width), dtype=torch.float32)
    attended = completion_mask.bool()
    loss_mask = attended  # every completion token is the model's, unless a sample has segments
    if any(s.segments for s in samples):
        loss_mask = torch.tensor(_padded([s.model_mask() for s in samples], False, width), dtype=torch.bool)
    token_lag = None
    if version is not None:
        lags = [
            _at_model_tokens(s, [lineage_lag(v, version, lost) for v in s.completion.versions], 0)
            for s in samples
        ]
        token_lag = torch.tensor(_padded(lags, 0, width), dtype=torch.long)
    return MicroBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        row_prompt=torch.tensor(row_prompt, dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=attended,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour_logprobs,
        advantages=token_advantages,
        sample_ids=tuple(sample.sample_id for sample in samples),
        token_lag=token_lag,
        packed=packed_layout(samples) if packed else None,
    )


def _right_padded(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, longest] token ids padded with `pad_token_id`, and the mask of real tokens (long)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor(_padded(rows, pad_token_id, width), dtype=torch.long)
    mask = torch.tensor(_padded([[1] * len(row) for row in rows], 0, width), dtype=torch.long)
    return ids, mask


def _padded(rows: Sequence[Sequence[T]], value: T, width: int) -> list[list[T]]:
    """Each row filled up to `width` with `value`, as lists that become one tensor in one call (a
    tensor per row cost 2 ms of a copy step's 128 rows)."""
    return [[*row, *[value] * (width - len(row))] for row in rows]


def _at_model_tokens(sample: Sample, values: list[T], fill: T) -> list[T]:
    """`values`, one per model token, spread over the sample's completion positions with `fill` at
    its context tokens."""
    if not sample.segments:
        return values
    spread = iter(values)
    return [next(spread) if model else fill for model in sample.model_mask()]


def _length(sample: Sample) -> int:
    return len(sample.prompt_token_ids) + len(sample.completion)
