"""Flatten a model's tensors into a few large byte buckets, checksum them, and view them back.

    named tensors ──plan_layout──► WeightLayout (names, shapes, dtypes, bucket, offset)
                  ──pack────────► [uint8 bucket 0, bucket 1, ...] + CRC-32 per bucket
    bucket bytes  ──verify──► ──unpack──► {name: tensor view into its bucket}

Weights move as a handful of large buffers rather than one message per parameter: one broadcast
or one chunk stream per bucket, and one checksum per bucket checked before any tensor is used.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

import torch

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.weights.settings import DEFAULT_BUCKET_BYTES
from pipelinerl.weights.types import BucketSpec, Checksum, ChecksumAlgorithm, TensorSpec, WeightLayout, crc32

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ALIGN = 64  # keeps every tensor view aligned for vectorised copies


class TensorSource(Protocol):
    """Named tensors read once, in a fixed order: what `pack` takes besides a plain mapping. A sharded
    model (ZeRO-3) gathers each tensor as it is read, so no rank ever holds the model twice."""

    def specs(self) -> list[tuple[str, torch.Tensor]]:
        """Name and a tensor of the right shape and dtype (a meta tensor will do), in read order."""
        ...

    def read(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Name and data, in the order of `specs`; a tensor may be released once the next is read."""
        ...


def named_specs(tensors: Mapping[str, torch.Tensor] | TensorSource) -> list[tuple[str, torch.Tensor]]:
    return list(tensors.items()) if isinstance(tensors, Mapping) else tensors.specs()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported weight dtype {dtype}; use float32, float16 or bfloat16")
    return name


def plan_layout(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> WeightLayout:
    """Assign tensors to buckets in order, starting a new bucket when the current one is full.
    A tensor larger than `bucket_bytes` gets a bucket of its own. Checksums are left empty."""
    specs: list[TensorSpec] = []
    sizes: list[int] = [0]
    for name, tensor in tensors:
        num_bytes = tensor.numel() * tensor.element_size()
        offset = -(-sizes[-1] // _ALIGN) * _ALIGN
        if sizes[-1] > 0 and offset + num_bytes > bucket_bytes:
            sizes.append(0)
            offset = 0
        specs.append(
            TensorSpec(name, tuple(tensor.shape), dtype_name(tensor.dtype), len(sizes) - 1, offset, num_bytes)
        )
        sizes[-1] = offset + num_bytes
    empty = Checksum(ChecksumAlgorithm.CRC32, b"")
    return WeightLayout(tuple(specs), tuple(BucketSpec(i, n, empty) for i, n in enumerate(sizes)))


def pack(
    tensors: Mapping[str, torch.Tensor] | TensorSource, layout: WeightLayout
) -> tuple[list[torch.Tensor], WeightLayout]:
    """Copy tensors into CPU uint8 buckets; returns the buckets and the layout with their checksums.
    A `TensorSource` is read once, in layout order."""
    buckets = [torch.empty(b.num_bytes, dtype=torch.uint8) for b in layout.buckets]
    items = (
        ((s.name, tensors[s.name]) for s in layout.tensors)
        if isinstance(tensors, Mapping)
        else tensors.read()
    )
    for spec, (name, tensor) in zip(layout.tensors, items, strict=True):
        if name != spec.name:
            raise ValueError(f"tensor {name!r} read where the layout has {spec.name!r}")
        src = tensor.detach().to("cpu", _DTYPES[spec.dtype]).contiguous()
        buckets[spec.bucket][spec.offset : spec.offset + spec.num_bytes].copy_(src.view(-1).view(torch.uint8))
    specs = tuple(
        BucketSpec(b.index, b.num_bytes, Checksum(ChecksumAlgorithm.CRC32, checksum_of(buckets[b.index])))
        for b in layout.buckets
    )
    return buckets, WeightLayout(layout.tensors, specs)


def checksum_of(bucket: torch.Tensor) -> bytes:
    return crc32(bucket.numpy().data)


def verify(layout: WeightLayout, index: int, bucket: torch.Tensor) -> None:
    """Raise FailedPrecondition if a received bucket is not exactly the one the layout describes."""
    spec = layout.buckets[index]
    if bucket.numel() != spec.num_bytes:
        raise FailedPrecondition(f"bucket {index}: {bucket.numel()} bytes, expected {spec.num_bytes}")
    if spec.checksum.algorithm is not ChecksumAlgorithm.CRC32:
        raise FailedPrecondition(f"bucket {index}: unsupported checksum {spec.checksum.algorithm.value}")
    if checksum_of(bucket) != spec.checksum.value:
        raise FailedPrecondition(f"bucket {index}: checksum mismatch")


def unpack(layout: WeightLayout, buckets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views (no copies) of every tensor of a version, from all its buckets."""
    named: dict[str, torch.Tensor] = {}
    for index, bucket in enumerate(buckets):
        named.update(tensors_of(layout, index, bucket))
    return named


def tensors_of(layout: WeightLayout, index: int, bucket: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views (no copies) of the tensors stored in one bucket."""
    return {
        spec.name: bucket[spec.offset : spec.offset + spec.num_bytes]
        .view(_DTYPES[spec.dtype])
        .view(spec.shape)
        for spec in layout.tensors
        if spec.bucket == index
    }
