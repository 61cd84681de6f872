"""Bucketing: tensors survive pack/unpack bit for bit, buckets respect their size, corruption is caught."""

from __future__ import annotations

import pytest
import torch

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.weights import buckets as bucketing


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(100, 30, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randn(3, 5, generator=g).to(torch.float16),
        "big": torch.randn(2000, generator=g),
    }


def test_round_trip_is_exact_across_buckets() -> None:
    named = tensors()
    layout = bucketing.plan_layout(named.items(), bucket_bytes=4096)
    assert len(layout.buckets) >= 3
    assert all(b.num_bytes <= 4096 or any(t.num_bytes > 4096 for t in layout.tensors if t.bucket == b.index)
               for b in layout.buckets)  # fmt: skip
    packed, layout = bucketing.pack(named, layout)
    restored = {}
    for index, bucket in enumerate(packed):
        bucketing.verify(layout, index, bucket)
        restored.update(bucketing.tensors_of(layout, index, bucket))
    assert restored.keys() == named.keys()
    for name, tensor in named.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor)


def test_corrupt_or_short_bucket_is_refused() -> None:
    named = tensors()
    packed, layout = bucketing.pack(named, bucketing.plan_layout(named.items()))
    packed[0][5] ^= 1
    with pytest.raises(FailedPrecondition, match="checksum mismatch"):
        bucketing.verify(layout, 0, packed[0])
    with pytest.raises(FailedPrecondition, match="bytes"):
        bucketing.verify(layout, 0, packed[0][:-1])


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="int64"):
        bucketing.plan_layout([("steps", torch.zeros(3, dtype=torch.int64))])
