"""Packed micro-batches: every token of a micro-batch in one row, no padding, each prompt once.

    one row   P1 c1 c1 c1 c2 c2 P2 P2 c3 c3 c3 c3 ...     (P: a distinct prompt, c: a completion's inputs)
    positions 0  1  2  3  1  2  0  1  2  3  4  5          (each completion counts on from its prompt)

A completion attends to its prompt and to itself, never to another completion or another prompt:
each attention sequence is a prompt (causal over itself) or a completion (its prompt's keys, then
its own, causally). The layers' matmuls run on the row's real tokens only; attention runs sequence
by sequence. torch offers no variable-length attention on CPU, and a dense block-diagonal mask over
the row costs the row's length squared (on a step of `repeat`, a group of 8 long answers is 1,200
tokens, seven times the pairs it needs), so `packed_attention` gathers each sequence's queries and
keys into `scaled_dot_product_attention` batches of similar lengths (`AttentionBucket`) and gathers
the outputs back into the row: the work of attention is what padding sequence by sequence would
cost, the rest of the model's is that of the real tokens.

The model reaches `packed_attention` through transformers' attention registry: `use_packed_attention`
registers it under `PACKED_ATTENTION` and selects it on a model. Called without a layout (any
forward that is not a packed micro-batch), it is transformers' own SDPA attention.

Logits are taken only at the positions that predict a completion token (the prompt's last, then
each completion input), in row-major order of the micro-batch's completion rows; `spread` places
them back on the padded [rows, completion positions] grid the losses read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from pipelinerl.common.types import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKED_ATTENTION = "pipelinerl_packed_sdpa"
"""The name `packed_attention` is registered under in transformers' attention registry."""

_BUCKET_OVERHEAD_PAIRS = 32768
"""What one more attention call costs, in query-key pairs' worth of time (a call of SDPA with its
gathers, forward and backward): sequences are split into more buckets only where that saves more
padded pairs than this. Measured on a `repeat` step of `tiny`, one CPU thread: 4,096 gave 19
buckets and 0.80 of the padded step's CPU time, 16,384-65,536 0.77-0.79, none (one bucket) 1.06."""


@dataclass(frozen=True)
class AttentionBucket:
    """Attention sequences of similar lengths, padded to one shape: [sequences, queries] and
    [sequences, keys] positions in the packed row (padding points at position 0), and the mask
    [sequences, 1, queries, keys] of what each query attends to."""

    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class PackedLayout:
    """One packed micro-batch: its row, and where the loss's values come from."""

    input_ids: torch.Tensor
    """[1, tokens]: each distinct prompt, then the inputs of its completions (a completion's last
    token is never an input: what it would predict lies past the completion)."""
    position_ids: torch.Tensor
    """[1, tokens]: 0 at each prompt's first token, counting on through each of its completions."""
    buckets: tuple[AttentionBucket, ...]
    output_index: torch.Tensor
    """[tokens]: where each token's attention output lies in the buckets' outputs, each flattened
    to [sequences × queries] and concatenated."""
    predicting: torch.Tensor
    """[completion tokens]: the row position whose logits predict each completion token."""
    spread: torch.Tensor
    """[rows, completion positions]: index of each completion token in `predicting`; padding
    points one past its end (a zero)."""

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> PackedLayout:
        buckets = tuple(
            AttentionBucket(b.queries.to(device), b.keys.to(device), b.mask.to(device)) for b in self.buckets
        )
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, buckets=buckets, **moved)

    def place(self, values: torch.Tensor) -> torch.Tensor:
        """Per-completion-token `values` [completion tokens] onto the [rows, completion positions]
        grid, 0 at padding."""
        return torch.cat([values, values.new_zeros(1)])[self.spread]


def packed_layout(samples: Sequence[Sample]) -> PackedLayout:
    """The packed row of `samples` (one completion row each, in order): each distinct prompt once,
    followed by the inputs of the completions that share it."""
    prompts: dict[tuple[int, ...], list[int]] = {}
    for row, sample in enumerate(samples):
        prompts.setdefault(tuple(sample.prompt_token_ids), []).append(row)
    ids: list[int] = []
    positions: list[int] = []
    # Attention sequences: (first query position, queries, prefix start, prefix length).
    sequences: list[tuple[int, int, int, int]] = []
    first_prediction = [0] * len(samples)
    completion_start = [0] * len(samples)
    for prompt, rows in prompts.items():
        start = len(ids)
        ids.extend(prompt)
        positions.extend(range(len(prompt)))
        sequences.append((start, len(prompt), start, 0))
        for row in rows:
            inputs = samples[row].completion.token_ids[:-1]
            first_prediction[row] = start + len(prompt) - 1
            completion_start[row] = len(ids)
            if inputs:
                sequences.append((len(ids), len(inputs), start, len(prompt)))
                ids.extend(inputs)
                positions.extend(range(len(prompt), len(prompt) + len(inputs)))
    predicting: list[int] = []
    for row, sample in enumerate(samples):
        predicting.append(first_prediction[row])
        predicting.extend(range(completion_start[row], completion_start[row] + len(sample.completion) - 1))
    lengths = [len(sample.completion) for sample in samples]
    width = max(lengths)
    offsets = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    columns = torch.arange(width)
    spread = torch.where(
        columns < torch.tensor(lengths)[:, None], offsets[:, None] + columns, len(predicting)
    )
    buckets, output_index = _attention_buckets(sequences, len(ids))
    return PackedLayout(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        buckets=buckets,
        output_index=output_index,
        predicting=torch.tensor(predicting, dtype=torch.long),
        spread=spread,
    )


def _attention_buckets(
    sequences: Sequence[tuple[int, int, int, int]], tokens: int
) -> tuple[tuple[AttentionBucket, ...], torch.Tensor]:
    """Group attention sequences (query start, queries, prefix start, prefix length) into buckets of
    similar shapes, cut where padded pairs plus `_BUCKET_OVERHEAD_PAIRS` per bucket cost least."""
    ordered = sorted(sequences, key=lambda s: (s[1] + s[3], s[1]), reverse=True)
    # best[i]: least cost of ordered[i:]; cut[i]: where the bucket starting at i ends.
    best, cut = [0.0] * (len(ordered) + 1), [len(ordered)] * (len(ordered) + 1)
    for i in range(len(ordered) - 1, -1, -1):
        best[i], widest = math.inf, 0
        keys = ordered[i][1] + ordered[i][3]
        for end in range(i + 1, len(ordered) + 1):
            widest = max(widest, ordered[end - 1][1])
            total = (end - i) * widest * keys + _BUCKET_OVERHEAD_PAIRS + best[end]
            if total < best[i]:
                best[i], cut[i] = total, end
    buckets: list[AttentionBucket] = []
    output_index = torch.zeros(tokens, dtype=torch.long)
    offset, i = 0, 0
    while i < len(ordered):
        bucket, valid = _bucket(torch.tensor(ordered[i : cut[i]], dtype=torch.long))
        output_index[bucket.queries[valid]] = offset + torch.nonzero(valid.flatten()).squeeze(1)
        offset += bucket.queries.numel()
        buckets.append(bucket)
        i = cut[i]
    return tuple(buckets), output_index


def _bucket(chunk: torch.Tensor) -> tuple[AttentionBucket, torch.Tensor]:
    """One bucket from rows of (query start, queries, prefix start, prefix length), and which of
    its [sequences, queries] slots hold a real query."""
    query_start, queries, prefix_start, prefix = (chunk[:, i, None] for i in range(4))
    width = int(queries.max())
    keys = int((queries + prefix).max())
    q = torch.arange(width)[None, :]
    k = torch.arange(keys)[None, :]
    queries_valid = q < queries
    key_valid = k < queries + prefix
    query_index = torch.where(queries_valid, query_start + q, 0)
    key_index = torch.where(k < prefix, prefix_start + k, query_start + k - prefix)
    key_index = torch.where(key_valid, key_index, 0)
    # Query t of a sequence sees its prefix and its own queries up to t; a padding query sees key 0
    # alone, so that no softmax row is empty (an empty one is NaN, and NaN poisons the backward).
    mask = (k[:, None, :] <= prefix[:, :, None] + q[:, :, None]) & key_valid[:, None, :]
    mask = torch.where(queries_valid[:, :, None], mask, k[:, None, :] == 0)
    return AttentionBucket(query_index, key_index, mask[:, None]), queries_valid


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packing: PackedLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: sequence by sequence over a packed row when `packing` is
    given ([1, heads, tokens, head dim] in, [1, tokens, heads, head dim] out); SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packing is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    query, key, value = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    outputs = []
    for bucket in packing.buckets:
        sequences, width = bucket.queries.shape
        q = query.index_select(0, bucket.queries.flatten()).view(sequences, width, heads, -1).transpose(1, 2)
        k, v = (
            t.index_select(0, bucket.keys.flatten())
            .view(sequences, bucket.keys.shape[1], kv_heads, -1)
            .transpose(1, 2)
            for t in (key, value)
        )
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=bucket.mask, dropout_p=dropout, scale=scaling, enable_gqa=heads != kv_heads
        )
        outputs.append(out.transpose(1, 2).reshape(sequences * width, heads, -1))
    return torch.cat(outputs).index_select(0, packing.output_index)[None], None


def use_packed_attention(model: PreTrainedModel) -> None:
    """Register `packed_attention` with transformers (once) and select it on `model`: its forward
    takes a `packing=` layout from then on, and runs as SDPA without one."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(PACKED_ATTENTION)


def packed_logits(model: torch.nn.Module, layout: PackedLayout, temperature: float) -> torch.Tensor:
    """Float32 logits [completion tokens, vocabulary] / `temperature` of each completion token's
    prediction, in the order of `layout.predicting`."""
    logits = model(
        input_ids=layout.input_ids,
        position_ids=layout.position_ids,
        # A mask of ones keeps transformers from rebuilding a dense [tokens, tokens] mask out of
        # the restarting positions; packed_attention reads the layout instead.
        attention_mask=torch.ones_like(layout.input_ids),
        logits_to_keep=layout.predicting,
        use_cache=False,
        packing=layout,
    ).logits
    return logits[0].float() / temperature


def pack_by_tokens(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Micro-batches of at most `token_budget` tokens (each distinct prompt once, every completion),
    no padding to weigh: a group's attempts stay together, so its prompt runs once, and the
    micro-batches are about equal (`ceil(total / budget)` of them, sometimes one more)."""
    by_prompt: dict[tuple[int, ...], list[Sample]] = {}
    for sample in samples:
        by_prompt.setdefault(tuple(sample.prompt_token_ids), []).append(sample)
    groups = sorted(by_prompt.values(), key=lambda g: max(len(s.completion) for s in g), reverse=True)
    total = sum(len(g[0].prompt_token_ids) + sum(len(s.completion) for s in g) for g in groups)
    target = math.ceil(total / max(math.ceil(total / token_budget), 1))
    batches: list[list[Sample]] = []
    used, prompts = 0, set[tuple[int, ...]]()
    for group in groups:
        for sample in sorted(group, key=lambda s: len(s.completion), reverse=True):
            prompt = tuple(sample.prompt_token_ids)
            cost = len(sample.completion) + (0 if prompt in prompts else len(prompt))
            if not batches or used >= target or used + cost > token_budget:
                batches.append([])
                used, prompts = 0, set()
                cost = len(sample.completion) + len(prompt)
            batches[-1].append(sample)
            used += cost
            prompts.add(prompt)
    return batches
