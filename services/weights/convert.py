"""Weight-transport types <-> their `pipelinerl.common.v1` messages (checksum, layout, chunk),
both directions, in one place; `*_from_proto` validates and raises InvalidArgument naming the field."""

from __future__ import annotations

from pipelinerl.common import convert
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.v1 import common_pb2 as pb
from pipelinerl.weights.types import (
    BucketSpec,
    Checksum,
    ChecksumAlgorithm,
    TensorSpec,
    WeightChunk,
    WeightLayout,
)

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
        version=convert.version_to_proto(chunk.version),
        bucket=chunk.bucket,
        offset=chunk.offset,
        data=chunk.data,
        checksum=checksum_to_proto(chunk.checksum),
    )


def chunk_from_proto(msg: pb.TensorChunk) -> WeightChunk:
    return WeightChunk(
        version=convert.version_from_proto(msg.version),
        bucket=msg.bucket,
        offset=msg.offset,
        data=msg.data,
        checksum=checksum_from_proto(msg.checksum, "chunk.checksum"),
    )
