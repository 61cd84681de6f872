"""Decode attention by groups of rows, each group to its own longest row's keys, and the moves
that keep rows of like length together.

The slot cache gives a decode's attention every row's keys up to the longest running sequence, the
rest masked. Lengths that vary (RL rollouts have a long tail) make much of what it reads masked: on
`builtin:repeat` the tiny preset's decodes read 2.1 times the keys their rows have, and attention
is the largest part of a small model's decode on CPU. Here a decode's rows are cut into contiguous
groups of equal size, each attending as far as its own longest row (`grouped_sdpa`: views of the
same buffers, nothing copied), and the engine moves a row into the group its length ranks it in,
longest first (`regrouping`), so that a group holds rows of like length. Only the rows out of their
group move, and only when what the next decodes save outweighs copying their caches; the grouping
lasts, as every row advances one position per decode, until rows join or leave.

Masked keys add nothing to a row's attention, so a shorter read changes no token's distribution;
its sums run in another order, so logits may differ in the last bits of float32.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "pipelinerl_grouped_sdpa"
"""The name `grouped_sdpa` is registered under with transformers' attention functions."""
CPU_DECODE_GROUPS = 4
"""Groups of a decode on CPU when `decode_groups` is unset (see `benchmarks/engine.py`)."""
SORT_HORIZON_STEPS = 8
"""Decodes over which the keys that sorting saves are weighed against the copy it costs."""

Groups = tuple[tuple[int, int, int], ...]
"""(first row, row after the last, keys to attend) of each group of a decode's rows."""


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    row_groups: Groups | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, run group by group over the batch's rows when the forward is
    given `row_groups` (a decode with a 4D mask), each group's keys, values and mask cut to its own
    length."""
    if row_groups is None or len(row_groups) < 2 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # pyright: ignore[reportArgumentType]  # kwargs are transformers' own, passed through
    parts = [
        sdpa_attention_forward(
            module,
            query[start:stop],
            key[start:stop, :, :length],
            value[start:stop, :, :length],
            attention_mask[start:stop, ..., :length],
            **kwargs,  # pyright: ignore[reportArgumentType]
        )[0]
        for start, stop, length in row_groups
    ]
    return torch.cat(parts), None


def install(model: PreTrainedModel) -> bool:
    """Give `model` the grouped attention if it runs transformers' SDPA (the one it wraps); False
    for any other attention, which then gets no `row_groups`."""
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(ATTENTION, grouped_sdpa)
    model.set_attn_implementation(ATTENTION)
    return True


def bounds_of(rows: int, count: int) -> list[int]:
    """Where the `count` contiguous groups of about equal size over `rows` rows start, and the end."""
    return sorted({rows * i // count for i in range(count + 1)})


def groups_of(positions: np.ndarray, count: int) -> Groups:
    """Rows with these positions (their next token's) cut into `count` contiguous groups of about
    equal size, each to attend to its longest row's keys: those up to and including its position."""
    bounds = bounds_of(len(positions), count)
    return tuple((a, b, int(positions[a:b].max()) + 1) for a, b in itertools.pairwise(bounds))


def read_cost(positions: np.ndarray, count: int) -> int:
    """Keys a decode of these rows in `count` groups reads, per head and layer."""
    return sum((b - a) * length for a, b, length in groups_of(positions, count))


def regrouping(
    positions: np.ndarray, count: int, horizon: int = SORT_HORIZON_STEPS
) -> tuple[list[int], list[int]] | None:
    """Moves (sources, targets: row targets[i] takes row sources[i]) that put each row in the group
    its length ranks it in, longest first, moving only the rows out of their group (the order within
    a group does not matter); None when nothing is out of place, or when the keys it saves over
    `horizon` decodes do not exceed the keys and values that the moves copy (read and written)."""
    n = len(positions)
    ranked = np.argsort(-positions, kind="stable")
    group = np.empty(n, np.int64)
    current = np.empty(n, np.int64)
    for g, (a, b) in enumerate(itertools.pairwise(bounds_of(n, count))):
        group[ranked[a:b]] = g
        current[a:b] = g
    misplaced = np.flatnonzero(group != current)
    if not len(misplaced):
        return None
    targets: list[int] = []
    sources: list[int] = []
    for g in np.unique(group[misplaced]).tolist():
        sources += misplaced[group[misplaced] == g].tolist()  # rows that belong in g ...
        targets += misplaced[current[misplaced] == g].tolist()  # ... take the places of those that do not
    order = np.arange(n)
    order[targets] = sources
    saved = read_cost(positions, count) - read_cost(positions[order], count)
    return (sources, targets) if saved * horizon > 2 * len(sources) * int(positions.max()) else None
