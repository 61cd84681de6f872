"""The one place where shared domain types meet `pipelinerl.common.v1` messages.

`*_from_proto` functions validate as they convert and raise `InvalidArgument` naming the field
(`field` is the dotted path of the message inside its request), so every service rejects malformed
input the same way.
"""

from __future__ import annotations

import math

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import FinishReason, Sample, SamplingParams, TokenSequence, WeightVersion
from pipelinerl.common.v1 import common_pb2 as pb
from pipelinerl.inference.validation import check_sampling
from pipelinerl.weights.types import (
    BucketSpec,
    Checksum,
    ChecksumAlgorithm,
    TensorSpec,
    WeightChunk,
    WeightLayout,
)

_FINISH_TO_PROTO = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PROTO.items()}


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


def tokens_from_proto(msg: pb.TokenSequence, field: str = "completion") -> TokenSequence:
    n = len(msg.token_ids)
    if len(msg.logprobs) != n:
        raise InvalidArgument.field(f"{field}.logprobs", f"has {len(msg.logprobs)} values for {n} tokens")
    if len(msg.versions) != n:
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
    )


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
        completion=tokens_from_proto(msg.completion, f"{field}.completion"),
        reward=msg.reward,
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        group_size=max(msg.group_size, 1),
    )


def version_to_proto(version: WeightVersion) -> pb.WeightVersion:
    return pb.WeightVersion(version=version.version, run_id=version.run_id)


def version_from_proto(msg: pb.WeightVersion) -> WeightVersion:
    return WeightVersion(version=msg.version, run_id=msg.run_id)


_DTYPES = {"float32": pb.D_TYPE_FLOAT32, "float16": pb.D_TYPE_FLOAT16, "bfloat16": pb.D_TYPE_BFLOAT16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_CHECKSUMS = {
    ChecksumAlgorithm.CRC32: pb.CHECKSUM_ALGORITHM_CRC32,
    ChecksumAlgorithm.SHA256: pb.CHECKSUM_ALGORITHM_SHA256,
}
_CHECKSUM_NAMES = {v: k for k, v in _CHECKSUMS.items()}


def checksum_to_proto(checksum: Checksum) -> pb.Checksum:
    return pb.Checksum(algorithm=_CHECKSUMS[checksum.algorithm], value=checksum.value)


def checksum_from_proto(msg: pb.Checksum, field: str = "checksum") -> Checksum:
    if msg.algorithm not in _CHECKSUM_NAMES:
        raise InvalidArgument.field(f"{field}.algorithm", "unknown checksum algorithm")
    return Checksum(_CHECKSUM_NAMES[msg.algorithm], msg.value)


def layout_to_proto(layout: WeightLayout) -> pb.WeightLayout:
    return pb.WeightLayout(
        tensors=[
            pb.TensorSpec(
                name=t.name,
                shape=t.shape,
                dtype=_DTYPES[t.dtype],
                bucket=t.bucket,
                offset=t.offset,
                num_bytes=t.num_bytes,
            )
            for t in layout.tensors
        ],
        buckets=[
            pb.Bucket(index=b.index, num_bytes=b.num_bytes, checksum=checksum_to_proto(b.checksum))
            for b in layout.buckets
        ],
        total_bytes=layout.total_bytes,
    )


def layout_from_proto(msg: pb.WeightLayout, field: str = "layout") -> WeightLayout:
    tensors = []
    for i, t in enumerate(msg.tensors):
        if t.dtype not in _DTYPE_NAMES:
            raise InvalidArgument.field(f"{field}.tensors[{i}].dtype", "unknown dtype")
        tensors.append(
            TensorSpec(t.name, tuple(t.shape), _DTYPE_NAMES[t.dtype], t.bucket, t.offset, t.num_bytes)
        )
    buckets = tuple(
        BucketSpec(b.index, b.num_bytes, checksum_from_proto(b.checksum, f"{field}.buckets[{i}].checksum"))
        for i, b in enumerate(msg.buckets)
    )
    return WeightLayout(tuple(tensors), buckets)


def chunk_to_proto(chunk: WeightChunk) -> pb.TensorChunk:
    return pb.TensorChunk(
        version=version_to_proto(chunk.version),
        bucket=chunk.bucket,
        offset=chunk.offset,
        data=chunk.data,
        checksum=checksum_to_proto(chunk.checksum),
    )


def chunk_from_proto(msg: pb.TensorChunk) -> WeightChunk:
    return WeightChunk(
        version=version_from_proto(msg.version),
        bucket=msg.bucket,
        offset=msg.offset,
        data=msg.data,
        checksum=checksum_from_proto(msg.checksum, "chunk.checksum"),
    )
