"""Shared conversions validate as they convert, naming the field, and round-trip losslessly."""

from __future__ import annotations

import pytest

from pipelinerl.common import convert
from pipelinerl.common.errors import InvalidArgument, NotFound
from pipelinerl.common.status import error_from_status, item_status
from pipelinerl.common.types import FinishReason, Sample, SamplingParams, Segment, SegmentKind, TokenSequence
from pipelinerl.common.v1 import common_pb2 as pb


def test_sampling_defaults_and_round_trip() -> None:
    params = convert.sampling_from_proto(pb.SamplingParams(max_new_tokens=8))
    assert params == SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, top_k=5, stop=("\n",), seed=3)
    assert convert.sampling_from_proto(convert.sampling_to_proto(greedy)) == greedy


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (pb.SamplingParams(max_new_tokens=0), "sampling.max_new_tokens"),
        (pb.SamplingParams(max_new_tokens=1, temperature=-1), "sampling.temperature"),
        (pb.SamplingParams(max_new_tokens=1, top_p=0), "sampling.top_p"),
        (pb.SamplingParams(max_new_tokens=1, top_k=-2), "sampling.top_k"),
        (pb.SamplingParams(max_new_tokens=1, stop=[""]), "sampling.stop[0]"),
    ],
)
def test_bad_sampling_names_the_field(msg: pb.SamplingParams, field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        convert.sampling_from_proto(msg)
    assert [v.field for v in exc.value.violations] == [field]


def test_sample_round_trip_and_validation() -> None:
    sample = Sample("s", "g", [1], TokenSequence([2, 3], [-0.5, -1.0], [0, 1]), 0.5, FinishReason.LENGTH, 4)
    assert convert.sample_from_proto(convert.sample_to_proto(sample)) == sample
    for mutate, field in [
        (lambda m: m.completion.versions.pop(), "sample.completion.versions"),
        (lambda m: m.completion.logprobs.__setitem__(0, float("nan")), "sample.completion.logprobs"),
        (lambda m: setattr(m, "reward", float("inf")), "sample.reward"),
        (lambda m: m.ClearField("prompt_token_ids"), "sample.prompt_token_ids"),
    ]:
        msg = convert.sample_to_proto(sample)
        mutate(msg)
        with pytest.raises(InvalidArgument) as exc:
            convert.sample_from_proto(msg)
        assert exc.value.violations[0].field == field


def test_segmented_sample_round_trip_and_unknown_kind() -> None:
    segments = (Segment(SegmentKind.MODEL, 1), Segment(SegmentKind.CONTEXT, 2), Segment(SegmentKind.MODEL, 1))
    tokens = TokenSequence([2, 3, 4, 5], [-0.5, -1.0], [0, 1])  # logprobs and versions: model tokens only
    sample = Sample("s", "g", [1], tokens, 0.5, FinishReason.STOP, 4, segments)
    msg = convert.sample_to_proto(sample)
    assert [(s.kind, s.num_tokens) for s in msg.segments] == [
        (pb.SEGMENT_KIND_MODEL, 1), (pb.SEGMENT_KIND_CONTEXT, 2), (pb.SEGMENT_KIND_MODEL, 1)
    ]  # fmt: skip
    assert convert.sample_from_proto(msg) == sample
    assert sample.model_tokens == 2 and sample.model_mask() == [True, False, False, True]
    msg.segments[1].kind = pb.SEGMENT_KIND_UNSPECIFIED
    with pytest.raises(InvalidArgument) as exc:
        convert.sample_from_proto(msg, "samples[0]")
    assert exc.value.violations[0].field == "samples[0].segments[1].kind"


def test_errors_survive_a_status_round_trip() -> None:
    back = error_from_status(item_status(InvalidArgument.field("items[2].answer", "missing")))
    assert isinstance(back, InvalidArgument)
    assert (back.violations[0].field, back.violations[0].description) == ("items[2].answer", "missing")
    assert isinstance(error_from_status(item_status(NotFound("no run"))), NotFound)
