"""Token choice for a batch of rows, each with its own sampling parameters and random generator.

Order of operations per row (as in HF `generate` and vLLM): divide by temperature, keep the top-k
tokens, keep the smallest set whose probability reaches top-p, renormalise, draw.

Logprob convention (what the trainer's importance ratios are computed against):
  - sampled rows (temperature > 0): log-probability of the drawn token under the distribution it was
    actually drawn from, i.e. after temperature, top-k and top-p, renormalised;
  - greedy rows (temperature == 0): log_softmax of the raw logits at the argmax, since a greedy
    "distribution" would put probability 1 (logprob 0) on every token and tell the trainer nothing.
All logprobs are float32 whatever the model's dtype.

Numerics: logits are taken relative to their row maximum before the temperature divides them, so
every temperature in (0, 100] keeps the top token at 0 and the others at worst at -inf (never inf
or NaN), and the most likely token survives any top_p > 0. A row whose logits have no finite
maximum (NaN, +inf, all -inf: broken weights or inputs) is not sampled but marked invalid, so it
cannot fail the rows it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipelinerl.common.types import SamplingParams


@dataclass(frozen=True)
class SampledTokens:
    token_ids: torch.Tensor
    """int64 [batch]"""
    logprobs: torch.Tensor
    """float32 [batch], see the module docstring for the convention."""
    valid: torch.Tensor
    """bool [batch]: False where the row's logits were unusable; its token and logprob mean nothing."""


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own for one request: seeded when `seed` is given, from OS entropy otherwise."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None = None,
) -> SampledTokens:
    """Choose one token per row of `logits` [batch, vocab]; row i uses params[i] and generators[i].

    A row whose generator is None (a request without a seed) draws from `shared`, in one call with
    every other such row; a seeded row draws alone from its own generator."""
    logits = logits.float()
    valid = logits.amax(dim=-1).isfinite()  # amax propagates NaN
    is_greedy = torch.tensor([p.temperature == 0 for p in params], device=logits.device)
    greedy = is_greedy & valid
    token_ids = torch.zeros(len(params), dtype=torch.long, device=logits.device)
    logprobs = torch.full((len(params),), float("nan"), device=logits.device)
    if greedy.any():
        raw = torch.log_softmax(logits[greedy], dim=-1)
        chosen = raw.argmax(dim=-1)
        token_ids[greedy] = chosen
        logprobs[greedy] = raw.gather(-1, chosen[:, None]).squeeze(-1)
    rows = (~is_greedy & valid).nonzero().squeeze(-1).tolist()
    if rows:
        filtered = torch.log_softmax(filter_logits(logits[rows], [params[i] for i in rows]), dim=-1)
        probs = filtered.exp()
        device = logits.device
        chosen = torch.empty(len(rows), dtype=torch.long, device=device)
        common = [j for j, row in enumerate(rows) if generators[row] is None]
        if common:
            drawn = torch.multinomial(probs[common], 1, generator=shared).squeeze(-1)
            chosen[torch.tensor(common, device=device)] = drawn
        # A seeded row draws alone from its own generator, so its seed reproduces its request's
        # tokens whatever else is in the batch.
        own = [(j, generator) for j, row in enumerate(rows) if (generator := generators[row]) is not None]
        if own:
            drawn = torch.cat([torch.multinomial(probs[j], 1, generator=generator) for j, generator in own])
            chosen[torch.tensor([j for j, _ in own], device=device)] = drawn
        index = torch.tensor(rows, device=device)
        token_ids[index] = chosen
        logprobs[index] = filtered.gather(-1, chosen[:, None]).squeeze(-1)
    return SampledTokens(token_ids, logprobs, valid)


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k and top-p to float logits [batch, vocab]; dropped tokens become -inf.

    Every row needs temperature > 0 and a finite maximum. `log_softmax` of the result is the
    distribution that `sample` draws from.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    # A temperature below the smallest normal float (1e-45 is a denormal) could flush to 0, and
    # 0 / 0 is NaN; relative to the maximum, any smaller temperature is greedy anyway.
    temperature = temperature.clamp(min=torch.finfo(logits.dtype).tiny)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]
    if all(p.top_k == 0 and p.top_p >= 1 for p in params):
        return scaled  # the common RL setting; skip the sort over the vocabulary
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
    ordered, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    ordered = ordered.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token is needed only while the more likely ones have not yet reached top_p; the first token
    # always survives (even a top_p that rounds to 0), and top_p >= 1 rows skip this so rounding
    # drops nothing.
    nucleus_full = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1) & (ranks[None, :] > 0)
    ordered = ordered.masked_fill(nucleus_full, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
