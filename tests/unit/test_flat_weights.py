"""A weight swap from received buckets: one copy per bucket once the parameters live in flat
buffers laid out like them, and the model's weights exactly the version's whatever the path."""

from __future__ import annotations

import torch

from pipelinerl.common.model import build_preset
from pipelinerl.inference.flat_weights import FlatParameters, Swap
from pipelinerl.weights import buckets as bucketing

BUCKET_BYTES = 256 * 1024  # the tiny preset in several buckets


def weights(seed: int) -> dict[str, torch.Tensor]:
    return dict(build_preset("tiny", seed=seed).model.named_parameters())


def assert_holds(params: dict[str, torch.nn.Parameter], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        torch.testing.assert_close(params[name].data, tensor, rtol=0, atol=0, msg=name)


def test_after_the_first_version_a_swap_is_one_copy_per_bucket_into_the_parameters() -> None:
    model = build_preset("tiny", seed=0).model
    params = dict(model.named_parameters(remove_duplicate=False))
    flat = FlatParameters(params)
    layout = bucketing.plan_layout(weights(1).items(), BUCKET_BYTES)
    assert len(layout.buckets) >= 3
    buckets = None
    for version in (1, 2, 3):
        new = weights(version)
        packed, _ = bucketing.pack(new, layout)
        if buckets is None:
            buckets = packed
        else:  # the receiver reuses its buffers from version to version
            for bucket, data in zip(buckets, packed, strict=True):
                bucket.copy_(data)
        swap = flat.prepared(Swap.of(bucketing.unpack(layout, buckets), params))
        assert (len(swap.pieces), swap.loose) == (len(layout.buckets), {})
        # The first version is copied while staged, into the memory the parameters move to.
        assert [p.fresh is not None for p in swap.pieces] == [version == 1] * len(layout.buckets)
        assert flat.copy_in(swap) == len(layout.buckets)
        assert_holds(params, new)
    # Each parameter is a view of one of the flat buffers, and the model computes with them.
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    assert len(storages) == len(layout.buckets)
    reference = build_preset("tiny", seed=3).model
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_a_partial_version_another_layout_or_dtype_still_lands_exactly() -> None:
    params = dict(build_preset("tiny", seed=0).model.named_parameters(remove_duplicate=False))
    flat = FlatParameters(params)
    full = bucketing.plan_layout(weights(1).items(), BUCKET_BYTES)
    flat.copy_in(Swap.of(bucketing.unpack(full, bucketing.pack(weights(1), full)[0]), params))
    # Some tensors only, in a layout of their own: those parameters move to a buffer of their own.
    some = {name: t for i, (name, t) in enumerate(weights(2).items()) if i % 3 == 0}
    partial = bucketing.plan_layout(some.items())
    flat.copy_in(Swap.of(bucketing.unpack(partial, bucketing.pack(some, partial)[0]), params))
    assert_holds(params, {**weights(1), **some})
    # The first layout again: its old buffer no longer holds every parameter, so it is not reused.
    flat.copy_in(Swap.of(bucketing.unpack(full, bucketing.pack(weights(3), full)[0]), params))
    assert_holds(params, weights(3))
    # Another dtype than the parameters' is converted tensor by tensor.
    halves = {name: t.half() for name, t in weights(4).items()}
    swap = Swap.of(halves, params)
    assert (swap.pieces, set(swap.loose)) == ((), set(halves))
    flat.copy_in(swap)
    assert_holds(params, {name: t.float() for name, t in halves.items()})
