"""Can the learner train on this sample? Checked at admission and again at the start of a step.

Each check raises `InvalidArgument` naming the offending field (`samples[0].prompt_token_ids[3]`),
so a sample the model would choke on (a token id outside the vocabulary, more tokens than the
context, a non-finite logprob, segments that do not tile its completion) is rejected on arrival
instead of failing a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import Sample, SegmentKind


@dataclass(frozen=True)
class SampleLimits:
    """What the learner's model can take."""

    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_tokens: int | None = None
    """Most prompt plus completion tokens of one sample (context length, micro-batch budget)."""


def check_sample(sample: Sample, limits: SampleLimits, field: str = "sample") -> None:
    """InvalidArgument naming the first field of `sample` that the learner cannot train on."""
    completion = sample.completion
    n = len(completion.token_ids)
    if sample.group_size < 1:
        raise InvalidArgument.field(f"{field}.group_size", "must be at least 1")
    if not math.isfinite(sample.reward):
        raise InvalidArgument.field(f"{field}.reward", "must be finite")
    # The first completion token is predicted from the last prompt position.
    if not sample.prompt_token_ids:
        raise InvalidArgument.field(f"{field}.prompt_token_ids", "must not be empty")
    if n == 0:
        raise InvalidArgument.field(f"{field}.completion.token_ids", "must not be empty")
    if sample.segments:
        _check_segments(sample, f"{field}.segments")
    scored = sample.model_tokens
    for name, values in (("logprobs", completion.logprobs), ("versions", completion.versions)):
        if len(values) != scored:
            what = f"{scored} model tokens (context tokens carry none)" if sample.segments else f"{n} tokens"
            raise InvalidArgument.field(f"{field}.completion.{name}", f"has {len(values)} values for {what}")
    _check_token_ids(sample.prompt_token_ids, limits.vocab_size, f"{field}.prompt_token_ids")
    _check_token_ids(completion.token_ids, limits.vocab_size, f"{field}.completion.token_ids")
    bad = next((i for i, x in enumerate(completion.logprobs) if not (math.isfinite(x) and x <= 0)), None)
    if bad is not None:
        raise InvalidArgument.field(f"{field}.completion.logprobs[{bad}]", "must be finite and <= 0")
    bad = next((i for i, v in enumerate(completion.versions) if v < 0), None)
    if bad is not None:
        raise InvalidArgument.field(f"{field}.completion.versions[{bad}]", "must be >= 0")
    total = len(sample.prompt_token_ids) + n
    if limits.max_tokens is not None and total > limits.max_tokens:
        raise InvalidArgument.field(
            f"{field}.completion.token_ids",
            f"prompt and completion hold {total} tokens, over the learner's limit of {limits.max_tokens}",
        )


def check_samples(samples: Sequence[Sample], limits: SampleLimits) -> None:
    """`check_sample` on each of one step's samples (`samples[i]`), whose ids must be distinct."""
    seen: set[str] = set()
    for i, sample in enumerate(samples):
        if sample.sample_id in seen:
            raise InvalidArgument.field(f"samples[{i}].sample_id", f"{sample.sample_id!r} appears twice")
        seen.add(sample.sample_id)
        check_sample(sample, limits, f"samples[{i}]")


def _check_segments(sample: Sample, field: str) -> None:
    """The segments tile the completion, each a token at least, and one of them is the model's."""
    n = len(sample.completion.token_ids)
    covered = 0
    for i, segment in enumerate(sample.segments):
        if segment.num_tokens < 1:
            raise InvalidArgument.field(
                f"{field}[{i}].num_tokens", f"is {segment.num_tokens}, must be at least 1"
            )
        covered += segment.num_tokens
        if covered > n:
            raise InvalidArgument.field(
                f"{field}[{i}].num_tokens", f"reaches token {covered}, past the completion's {n} tokens"
            )
    if covered != n:
        raise InvalidArgument.field(field, f"cover {covered} of the completion's {n} tokens, must cover all")
    if not any(segment.kind is SegmentKind.MODEL for segment in sample.segments):
        raise InvalidArgument.field(field, "hold no model segment: nothing to train")


def _check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        i = next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise InvalidArgument.field(
            f"{field}[{i}]", f"token id {ids[i]} is outside the vocabulary [0, {vocab_size})"
        )
