"""The one place where shared domain types meet `pipelinerl.common.v1` messages.

`*_from_proto` functions validate as they convert and raise `InvalidArgument` naming the field
(`field` is the dotted path of the message inside its request), so every service rejects malformed
input the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.sampling import check_sampling
from pipelinerl.common.types import (
    FinishReason,
    Sample,
    SamplingParams,
    Segment,
    SegmentKind,
    TokenSequence,
    WeightVersion,
)
from pipelinerl.common.v1 import common_pb2 as pb

_FINISH_TO_PROTO = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PROTO.items()}
_SEGMENT_TO_PROTO = {SegmentKind.MODEL: pb.SEGMENT_KIND_MODEL, SegmentKind.CONTEXT: pb.SEGMENT_KIND_CONTEXT}
_SEGMENT_FROM_PROTO: dict[int, SegmentKind] = {v: k for k, v in _SEGMENT_TO_PROTO.items()}


def sampling_from_proto(msg: pb.SamplingParams, field: str = "sampling") -> SamplingParams:
    params = SamplingParams(
        max_new_tokens=msg.max_new_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        seed=msg.seed if msg.HasField("seed") else None,
    )
    check_sampling(params, field)
    return params


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=params.stop_token_ids,
        stop=params.stop,
        seed=params.seed,
    )


def tokens_to_proto(seq: TokenSequence) -> pb.TokenSequence:
    return pb.TokenSequence(token_ids=seq.token_ids, logprobs=seq.logprobs, versions=seq.versions)


def tokens_from_proto(
    msg: pb.TokenSequence, field: str = "completion", *, aligned: bool = True
) -> TokenSequence:
    """`aligned`: logprobs and versions must have one value per token. A segmented sample's
    completion has them for its model tokens only, which the trainer checks against its segments."""
    n = len(msg.token_ids)
    if aligned and len(msg.logprobs) != n:
        raise InvalidArgument.field(f"{field}.logprobs", f"has {len(msg.logprobs)} values for {n} tokens")
    if aligned and len(msg.versions) != n:
        raise InvalidArgument.field(f"{field}.versions", f"has {len(msg.versions)} values for {n} tokens")
    if any(t < 0 for t in msg.token_ids):
        raise InvalidArgument.field(f"{field}.token_ids", "token ids must be >= 0")
    if not all(math.isfinite(x) and x <= 0.0 for x in msg.logprobs):
        raise InvalidArgument.field(f"{field}.logprobs", "logprobs must be finite and <= 0")
    if any(v < 0 for v in msg.versions):
        raise InvalidArgument.field(f"{field}.versions", "versions must be >= 0")
    return TokenSequence(list(msg.token_ids), list(msg.logprobs), list(msg.versions))


def finish_reason_to_proto(reason: FinishReason) -> pb.FinishReason:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason:
    return _FINISH_FROM_PROTO.get(value, FinishReason.STOP)


def sample_to_proto(sample: Sample) -> pb.Sample:
    return pb.Sample(
        sample_id=sample.sample_id,
        group_id=sample.group_id,
        prompt_token_ids=sample.prompt_token_ids,
        completion=tokens_to_proto(sample.completion),
        reward=sample.reward,
        finish_reason=finish_reason_to_proto(sample.finish_reason),
        group_size=sample.group_size,
        segments=[
            pb.Segment(kind=_SEGMENT_TO_PROTO[s.kind], num_tokens=s.num_tokens) for s in sample.segments
        ],
    )


def segments_from_proto(msgs: Sequence[pb.Segment], field: str = "segments") -> tuple[Segment, ...]:
    """The kinds must be known; the rest of the segments' rules are the trainer's to check."""
    segments = []
    for i, msg in enumerate(msgs):
        if msg.kind not in _SEGMENT_FROM_PROTO:
            raise InvalidArgument.field(
                f"{field}[{i}].kind", "must be SEGMENT_KIND_MODEL or SEGMENT_KIND_CONTEXT"
            )
        segments.append(Segment(_SEGMENT_FROM_PROTO[msg.kind], msg.num_tokens))
    return tuple(segments)


def sample_from_proto(msg: pb.Sample, field: str = "sample") -> Sample:
    if not msg.sample_id:
        raise InvalidArgument.field(f"{field}.sample_id", "must not be empty")
    if not msg.prompt_token_ids:
        raise InvalidArgument.field(f"{field}.prompt_token_ids", "must not be empty")
    if not msg.completion.token_ids:
        raise InvalidArgument.field(f"{field}.completion.token_ids", "must not be empty")
    if not math.isfinite(msg.reward):
        raise InvalidArgument.field(f"{field}.reward", "must be finite")
    return Sample(
        sample_id=msg.sample_id,
        group_id=msg.group_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        completion=tokens_from_proto(msg.completion, f"{field}.completion", aligned=not msg.segments),
        reward=msg.reward,
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        group_size=max(msg.group_size, 1),
        segments=segments_from_proto(msg.segments, f"{field}.segments"),
    )


def version_to_proto(version: WeightVersion) -> pb.WeightVersion:
    return pb.WeightVersion(version=version.version, run_id=version.run_id)


def version_from_proto(msg: pb.WeightVersion) -> WeightVersion:
    return WeightVersion(version=msg.version, run_id=msg.run_id)
