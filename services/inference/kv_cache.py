"""The built-in engine's "slot" KV cache: one cache row per running sequence.

Per layer, one K and one V buffer [max_rows, kv_heads, capacity, head_dim]. Row r belongs to the
r-th running sequence and cache index == token position, so decode writes one column per row and
attends to rows [:n] up to the longest sequence, masked per row. `capacity` grows by doubling up to
the context length. The engine calls the model with explicit position ids and a 4D additive mask,
so the model's own mask construction and cache bookkeeping are bypassed; before each forward it
sets `plan`, which says where that forward's keys and values go.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True)
class CachePlan:
    """Where the coming forward writes its keys and values, and what its attention reads back."""

    rows: torch.Tensor
    """[tokens] cache row of each real (non-padding) input token"""
    positions: torch.Tensor
    """[tokens] its position, which is also its cache index"""
    real: tuple[torch.Tensor, torch.Tensor] | None
    """[tokens] batch index and column of each real input token; None: every input slot is one (a
    decode). Indices rather than a boolean mask: a mask's count would be read to the host"""
    capacity: int
    """cache length the buffers must have"""
    read: tuple[slice | torch.Tensor, int] | None
    """(rows, kv_len) to attend to; None for a prefill, which attends only to its own fresh keys"""


def capacity_for(length: int, max_len: int) -> int:
    """Cache length to allocate for `length` positions: doubling keeps regrowth rare."""
    return min(max(64, 1 << (length - 1).bit_length()), max_len)


def check_attention_window(model: PreTrainedModel, max_model_len: int) -> None:
    """Refuse a model with sliding-window layers whose window is shorter than the context."""
    # The engine gives every layer one full causal mask; a sliding-window layer would silently
    # attend beyond its window once a sequence outgrows it.
    window = getattr(model.config, "sliding_window", None)
    if window is not None and window < max_model_len:
        raise ValueError(
            f"the built-in engine has no sliding-window attention: set max_model_len <= {window}, "
            f"the model's window (it is {max_model_len})"
        )


def cache_argument(model: PreTrainedModel) -> str:
    """The keyword `model.forward` takes its KV cache by: transformers renamed `past_key_values` to
    `cache` during 5.x, and a model of an earlier release silently ignores the new name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class SlotKVCache(Cache):
    """One cache row per running sequence, cache index == position; see the module docstring."""

    def __init__(self, num_layers: int, max_rows: int) -> None:
        self.max_rows = max_rows
        self._plan: CachePlan | None = None
        self._slots = [_SlotLayer(self) for _ in range(num_layers)]
        super().__init__(layers=list(self._slots))

    @property
    def plan(self) -> CachePlan:
        if self._plan is None:
            raise RuntimeError("the slot cache needs a plan before a forward")
        return self._plan

    @plan.setter
    def plan(self, plan: CachePlan) -> None:
        self._plan = plan

    def add_rows(self, max_rows: int) -> None:
        """Room for `max_rows` rows from now on; the rows written so far keep their contents."""
        if max_rows <= self.max_rows:
            return
        self.max_rows = max_rows
        for layer in self._slots:
            layer.add_rows(max_rows)

    def copy_rows(self, sources: list[int], targets: list[int], length: int) -> None:
        """Each row of `targets` gets the first `length` positions of the row of `sources` at the
        same index (a shared prompt, or a row moving into a hole), in one copy per buffer. Positions
        a source row has not written yet come along too: the target's mask hides them until its
        own writes replace them."""
        if self._slots[0].keys is None:
            return  # nothing was ever written
        device = self._slots[0].keys.device
        source, target = torch.tensor(sources, device=device), torch.tensor(targets, device=device)
        for layer in self._slots:
            layer.copy_rows(source, target, length)


class _SlotLayer(CacheLayerMixin):
    def __init__(self, owner: SlotKVCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._initialize(key_states, value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._owner.plan
        keys, values = self.keys, self.values
        if keys is None or values is None:
            keys, values = self._initialize(key_states, value_states)
        elif keys.shape[2] < plan.capacity:
            keys = self.keys = _grown(keys, capacity=plan.capacity)
            values = self.values = _grown(values, capacity=plan.capacity)
        # [batch, heads, q, dim] -> [tokens, heads, dim], in the same order as plan.rows/positions
        keys[plan.rows, :, plan.positions] = _real_tokens(key_states, plan.real)
        values[plan.rows, :, plan.positions] = _real_tokens(value_states, plan.real)
        if plan.read is None:
            return key_states, value_states
        rows, kv_len = plan.read
        return keys[rows, :, :kv_len], values[rows, :, :kv_len]

    def copy_rows(self, source: torch.Tensor, target: torch.Tensor, length: int) -> None:
        if self.keys is None or self.values is None:
            return  # nothing was ever written
        self.keys[target, :, :length] = self.keys[source, :, :length]
        self.values[target, :, :length] = self.values[source, :, :length]

    def add_rows(self, max_rows: int) -> None:
        if self.keys is None or self.values is None:
            return  # allocated at the first write, with the owner's max_rows
        self.keys, self.values = _grown(self.keys, rows=max_rows), _grown(self.values, rows=max_rows)

    def _initialize(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = self._owner.plan.capacity
        self.keys = keys = self._allocate(key_states, capacity)
        self.values = values = self._allocate(value_states, capacity)
        self.is_initialized = True
        return keys, values

    def _allocate(self, states: torch.Tensor, capacity: int) -> torch.Tensor:
        _, heads, _, dim = states.shape
        return states.new_zeros(self._owner.max_rows, heads, capacity, dim)

    # The engine passes position ids and a ready 4D mask, so models never ask the cache for sizes;
    # failing loudly beats answering with a number that is wrong for some rows.
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("the slot cache needs explicit position ids and a 4D attention mask")

    def get_seq_length(self) -> int:
        raise NotImplementedError("the slot cache needs explicit position ids and a 4D attention mask")

    def get_max_length(self) -> int:
        return -1


def _real_tokens(states: torch.Tensor, real: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    tokens = states.transpose(1, 2)
    return tokens.flatten(0, 1) if real is None else tokens[real[0], real[1]]


def _grown(buffer: torch.Tensor, *, rows: int | None = None, capacity: int | None = None) -> torch.Tensor:
    """A [rows, heads, capacity, dim] buffer with more rows or more capacity, the old one in its start."""
    max_rows, heads, old_capacity, dim = buffer.shape
    grown = buffer.new_zeros(rows or max_rows, heads, capacity or old_capacity, dim)
    grown[: buffer.shape[0], :, : buffer.shape[2]] = buffer
    return grown
