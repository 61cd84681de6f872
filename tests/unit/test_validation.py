"""Sample checks against the learner's limits: each names the field a sample gets wrong."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import Sample, Segment, SegmentKind, TokenSequence
from pipelinerl.trainer.validation import SampleLimits, check_sample, check_samples

LIMITS = SampleLimits(vocab_size=100, max_tokens=8)


def sample(**changes: object) -> Sample:
    base = Sample("s", "g", [1, 10, 11], TokenSequence([12, 13], [-1.0, -1.5], [0, 0]), 1.0, group_size=2)
    return replace(base, **changes)


def tokens(
    ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None
) -> TokenSequence:
    return TokenSequence(
        ids, logprobs if logprobs is not None else [-1.0] * len(ids), versions or [0] * len(ids)
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"prompt_token_ids": [1, 10, 11, 100]}, "samples[2].prompt_token_ids[3]"),
        ({"prompt_token_ids": [1, -3]}, "samples[2].prompt_token_ids[1]"),
        ({"prompt_token_ids": []}, "samples[2].prompt_token_ids"),
        ({"completion": tokens([12, 400])}, "samples[2].completion.token_ids[1]"),
        ({"completion": tokens([])}, "samples[2].completion.token_ids"),
        ({"completion": tokens([12, 13], [-1.0])}, "samples[2].completion.logprobs"),
        ({"completion": tokens([12, 13], versions=[0])}, "samples[2].completion.versions"),
        ({"completion": tokens([12, 13], [-1.0, math.nan])}, "samples[2].completion.logprobs[1]"),
        ({"completion": tokens([12, 13], [-math.inf, -1.0])}, "samples[2].completion.logprobs[0]"),
        ({"completion": tokens([12, 13], [0.5, -1.0])}, "samples[2].completion.logprobs[0]"),
        ({"completion": tokens([12, 13], versions=[0, -1])}, "samples[2].completion.versions[1]"),
        ({"completion": tokens([12] * 6)}, "samples[2].completion.token_ids"),  # 3 + 6 > 8 tokens
        ({"reward": math.inf}, "samples[2].reward"),
        ({"group_size": 0}, "samples[2].group_size"),
    ],
)
def test_a_sample_the_learner_cannot_take_is_refused_naming_the_field(changes: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_sample(sample(**changes), LIMITS, "samples[2]")
    assert [v.field for v in exc.value.violations] == [field]


def test_a_sample_within_the_limits_passes() -> None:
    check_sample(sample(completion=tokens([0, 99, 12, 13, 14])), LIMITS)  # 8 tokens, ids at both ends
    check_sample(sample(completion=tokens([12] * 100)), SampleLimits(vocab_size=100))  # no length limit


def test_a_step_names_the_sample_by_its_index_and_refuses_an_id_twice() -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_samples([sample(), sample(sample_id="t", reward=math.nan)], LIMITS)
    assert exc.value.violations[0].field == "samples[1].reward"
    with pytest.raises(InvalidArgument) as exc:
        check_samples([sample(), sample()], LIMITS)
    assert exc.value.violations[0].field == "samples[1].sample_id"


MODEL, CONTEXT = SegmentKind.MODEL, SegmentKind.CONTEXT


def episode(
    *runs: tuple[SegmentKind, int], logprobs: int | None = None, versions: int | None = None
) -> Sample:
    """A segmented sample over a completion of 4 tokens; logprobs and versions for its model tokens
    unless counts are given."""
    model_tokens = sum(n for kind, n in runs if kind is MODEL)
    completion = TokenSequence(
        [12, 13, 14, 15],
        [-1.0] * (model_tokens if logprobs is None else logprobs),
        [0] * (model_tokens if versions is None else versions),
    )
    return sample(completion=completion, segments=tuple(Segment(kind, n) for kind, n in runs))


SEGMENT_CASE_IDS = [
    "short",
    "past-end",
    "empty",
    "negative",
    "no-model",
    "model-logprobs",
    "context-versions",
    "context-logprobs",
]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (episode((MODEL, 1), (CONTEXT, 2)), "samples[2].segments"),  # 3 of 4 tokens: no tiling
        (episode((MODEL, 2), (CONTEXT, 3)), "samples[2].segments[1].num_tokens"),  # past the end
        (episode((MODEL, 2), (CONTEXT, 0), (MODEL, 2)), "samples[2].segments[1].num_tokens"),
        (episode((MODEL, 2), (CONTEXT, -1), (MODEL, 3)), "samples[2].segments[1].num_tokens"),
        (episode((CONTEXT, 4)), "samples[2].segments"),  # nothing to train
        (episode((MODEL, 1), (CONTEXT, 2), (MODEL, 1), logprobs=1), "samples[2].completion.logprobs"),
        (episode((MODEL, 1), (CONTEXT, 2), (MODEL, 1), versions=4), "samples[2].completion.versions"),
        (episode((MODEL, 1), (CONTEXT, 3), logprobs=4), "samples[2].completion.logprobs"),
    ],
    ids=SEGMENT_CASE_IDS,
)
def test_segments_that_do_not_tile_or_disagree_with_the_values_are_refused(bad: Sample, field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_sample(bad, LIMITS, "samples[2]")
    assert [v.field for v in exc.value.violations] == [field]


def test_segmented_samples_that_follow_the_rules_pass() -> None:
    check_sample(episode((MODEL, 1), (CONTEXT, 2), (MODEL, 1)), LIMITS)
    check_sample(episode((CONTEXT, 1), (MODEL, 2), (CONTEXT, 1)), LIMITS)  # context on both ends
    check_sample(episode((MODEL, 4)), LIMITS)
    too_long = episode((MODEL, 1), (CONTEXT, 2), (MODEL, 1))
    with pytest.raises(InvalidArgument):  # context tokens count against the context length too
        check_sample(too_long, SampleLimits(vocab_size=100, max_tokens=6))
