"""The vLLM worker extension that loads a weight version into every vLLM worker.

    VllmBackend.apply_weights ──collective_rpc("pipelinerl_apply_weights", layout, buckets)──►
        each worker: layout_from_wire ─► verify EVERY bucket's CRC-32 and size ─► unpack (views)
                     ─► Worker.reload_weights(weights_iterator=...) ─► the model holds version v

vLLM mixes `worker_extension_cls` into its Worker class, so these methods run inside the worker
process with `self` being the Worker; they are reached only through `collective_rpc`. Arguments
cross a msgpack boundary on their way there, where tensors would arrive as nested lists: the
weights therefore travel as the project's flat byte buckets (`bytes`) plus the layout as plain
lists, and are viewed back as tensors here without a copy.

Every check happens before `reload_weights`: a reload that fails half-way leaves meta tensors in
the model, so a corrupt or mismatching version must be refused while the model is untouched.
`model.load_weights` cannot be called directly on CPU (vLLM repacks the weights after loading);
`reload_weights` runs that processing again.

This module is imported by vLLM workers by its dotted path, `pipelinerl.inference.vllm_worker`;
it imports torch and pipelinerl's light modules only, never grpc.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights.types import BucketSpec, Checksum, ChecksumAlgorithm, TensorSpec, WeightLayout

EXTENSION_CLASS = "pipelinerl.inference.vllm_worker.WeightUpdateExtension"

# The layout as collective_rpc carries it: only lists, ints, strs and bytes survive msgpack as such.
WireLayout = dict[str, list[list[Any]]]


def layout_to_wire(layout: WeightLayout) -> WireLayout:
    return {
        "tensors": [
            [t.name, list(t.shape), t.dtype, t.bucket, t.offset, t.num_bytes] for t in layout.tensors
        ],
        "buckets": [
            [b.index, b.num_bytes, b.checksum.algorithm.value, bytes(b.checksum.value)]
            for b in layout.buckets
        ],
    }


def layout_from_wire(wire: WireLayout) -> WeightLayout:
    tensors = tuple(
        TensorSpec(name, tuple(shape), dtype, bucket, offset, num_bytes)
        for name, shape, dtype, bucket, offset, num_bytes in wire["tensors"]
    )
    specs = tuple(
        BucketSpec(index, num_bytes, Checksum(ChecksumAlgorithm(algorithm), bytes(value)))
        for index, num_bytes, algorithm, value in wire["buckets"]
    )
    return WeightLayout(tensors, specs)


def verified_tensors(wire: WireLayout, buckets: list[bytes]) -> dict[str, torch.Tensor]:
    """Views of every tensor of a version, or FailedPrecondition if any bucket is not exactly the
    one the layout describes. Pure function, so it is testable without a vLLM worker."""
    layout = layout_from_wire(wire)
    if len(buckets) != len(layout.buckets):
        raise FailedPrecondition(f"{len(buckets)} buckets received, the layout has {len(layout.buckets)}")
    # bytearray: torch.frombuffer needs a writable buffer to build a tensor without a warning.
    tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in buckets]
    for index, bucket in enumerate(tensors):
        bucketing.verify(layout, index, bucket)
    return bucketing.unpack(layout, tensors)


class WeightUpdateExtension:
    """Mixed into vLLM's Worker (`worker_extension_cls`); `self` is the Worker at run time."""

    if TYPE_CHECKING:  # what the Worker provides (vLLM is not installed where the checker runs)
        vllm_config: Any
        model_runner: Any

        def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]]) -> None: ...

    def pipelinerl_apply_weights(self, version: int, wire: WireLayout, buckets: list[bytes]) -> int:
        """Verify, then load version `version`; returns the number of tensors loaded.

        Raises FailedPrecondition, with the model untouched, if any bucket does not match."""
        named = verified_tensors(wire, buckets)
        self._pipelinerl_check_names(named)
        self.reload_weights(weights_iterator=iter(named.items()))
        self._pipelinerl_refresh_tied_head()
        self._pipelinerl_version = version
        return len(named)

    def _pipelinerl_refresh_tied_head(self) -> None:
        # On CPU, vLLM packs the output layer's weight for its GEMM after loading. With tied
        # embeddings, reload_weights writes the shared matrix but leaves that packed copy stale,
        # so the logits would keep coming from the old weights: pack it again.
        # vLLM lives in its own virtualenv; the type checker runs in the main one.
        from vllm.config import set_current_vllm_config  # pyright: ignore[reportMissingImports]

        config = self.vllm_config
        if not getattr(config.model_config.hf_config, "tie_word_embeddings", False):
            return
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is not None:
            with set_current_vllm_config(config):
                method.process_weights_after_loading(head)

    def pipelinerl_weight_version(self) -> int | None:
        """The version this worker last loaded (None: still the checkpoint it started from)."""
        return getattr(self, "_pipelinerl_version", None)

    def _pipelinerl_check_names(self, named: dict[str, torch.Tensor]) -> None:
        # vLLM fuses checkpoint tensors (q/k/v -> qkv_proj), so names cannot be compared with the
        # model's parameters directly; an unknown name would only fail inside load_weights, after
        # other tensors were already written. The model's own checkpoint, read lazily once, is the
        # reference: the trainer publishes the same names and shapes.
        expected = getattr(self, "_pipelinerl_checkpoint_shapes", None)
        if expected is None:
            expected = _checkpoint_shapes(self.vllm_config.model_config.model)
            self._pipelinerl_checkpoint_shapes = expected
        if not expected:  # not a local safetensors directory: nothing to compare against
            return
        for name, tensor in named.items():
            if name not in expected:
                # Tied output embeddings are not stored in the checkpoint but may be published.
                if name == "lm_head.weight" and "model.embed_tokens.weight" in expected:
                    continue
                raise FailedPrecondition(f"{name}: the served model has no such tensor")
            if tuple(tensor.shape) != expected[name]:
                raise FailedPrecondition(
                    f"{name}: shape {tuple(tensor.shape)} != the served model's {expected[name]}"
                )


def _checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors in a local safetensors checkpoint (headers only)."""
    from pathlib import Path

    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
