"""Token choice for a batch of rows, each with its own sampling parameters and seed, in tensor
operations only: no per-row Python and no read back to the host.

Order of operations per row (as in HF `generate` and vLLM): divide by temperature, keep the top-k
tokens, keep the smallest set whose probability reaches top-p, renormalise, draw.

Each request draws from a stream of uniform numbers made once, at its admission, by a generator
seeded with its seed (`uniform_stream`; a request without a seed gets a random one,
`random_seed`): its n-th token takes the stream's n-th number, so a seed reproduces its request's
tokens whatever it is batched with and whichever step it joins at, and every row draws in the same
few operations. The draw inverts the row's cumulative distribution: exact sampling, one uniform
number per row.

Logprob convention (what the trainer's importance ratios are computed against):
  - sampled rows (temperature > 0): log-probability of the drawn token under the distribution it was
    actually drawn from, i.e. after temperature, top-k and top-p, renormalised;
  - greedy rows (temperature == 0): log_softmax of the raw logits at the argmax, since a greedy
    "distribution" would put probability 1 (logprob 0) on every token and tell the trainer nothing.
All logprobs are float32 whatever the model's dtype.

Numerics: logits are taken relative to their row maximum before the temperature divides them, so
every temperature in (0, 100] keeps the top token at 0 and the others at worst at -inf (never inf
or NaN), and the most likely token survives any top_p > 0. A row whose logits have no finite
maximum (NaN, +inf, all -inf: broken weights or inputs) is marked invalid, so it cannot fail the
rows it is batched with; its token and logprob mean nothing.
"""

from __future__ import annotations

import secrets
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


@dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of a batch's rows, one tensor per parameter (row i in element i)."""

    temperature: torch.Tensor
    """float32 [rows]; 0 is greedy"""
    top_p: torch.Tensor
    """float32 [rows]"""
    top_k: torch.Tensor
    """int64 [rows]; 0 is no limit"""

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> RowSampling:
        """Row i samples with params[i]."""
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        )

    def __getitem__(self, rows: slice | torch.Tensor) -> RowSampling:
        """These rows (views for a slice)."""
        return RowSampling(self.temperature[rows], self.top_p[rows], self.top_k[rows])

    def write(self, rows: slice | torch.Tensor, source: RowSampling) -> None:
        """Set these rows (in place) to `source`'s."""
        self.temperature[rows] = source.temperature
        self.top_p[rows] = source.top_p
        self.top_k[rows] = source.top_k


def random_seed() -> int:
    """A seed for a request that gave none: from OS entropy, 64 bits."""
    return secrets.randbits(64)


def uniform_stream(seed: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [length] in [0, 1): the numbers a request with this seed draws its tokens from, the
    n-th for its n-th token."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return torch.rand(length, generator=generator, device=device)


def sample(
    logits: torch.Tensor,
    rows: RowSampling,
    uniforms: torch.Tensor,
    *,
    greedy: bool = True,
    sampled: bool = True,
    truncated: bool = True,
) -> SampledTokens:
    """Choose one token per row of `logits` [batch, vocab] with `rows`' parameters; row i draws
    with uniforms[i], a float32 in [0, 1) (the next number of its request's `uniform_stream`).

    What the caller knows on the host spares work: `greedy` / `sampled`, whether any row has
    temperature == 0 / > 0; `truncated`, whether any row has a top-k or a top-p below 1 (without,
    no sort over the vocabulary). A False that is wrong for some row gives that row a wrong token."""
    logits = logits.float()
    top = logits.amax(dim=-1, keepdim=True)  # amax propagates NaN
    valid = top.squeeze(-1).isfinite()
    if sampled:
        filtered = torch.log_softmax(filter_logits(logits - top, rows, truncated=truncated), dim=-1)
        cdf = filtered.exp().cumsum(dim=-1)
        total = cdf[:, -1:]
        # Strictly below the total, so the first cumulative sum above it is a token of
        # probability > 0 even where rounding would reach the total.
        target = torch.minimum(uniforms[:, None] * total, total.nextafter(-total))
        drawn = torch.searchsorted(cdf, target, right=True).clamp(0, logits.shape[-1] - 1)
        token_ids, logprobs = drawn.squeeze(-1), filtered.gather(-1, drawn).squeeze(-1)
    else:  # every row greedy
        token_ids = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        logprobs = torch.zeros(logits.shape[0], device=logits.device)
    if greedy:
        chosen = logits.argmax(dim=-1, keepdim=True)
        raw = torch.log_softmax(logits, dim=-1).gather(-1, chosen).squeeze(-1)
        is_greedy = rows.temperature == 0
        token_ids = torch.where(is_greedy, chosen.squeeze(-1), token_ids)
        logprobs = torch.where(is_greedy, raw, logprobs)
    return SampledTokens(token_ids, logprobs, valid)


def filter_logits(logits: torch.Tensor, rows: RowSampling, *, truncated: bool = True) -> torch.Tensor:
    """Apply temperature, top-k and top-p to float logits [batch, vocab] taken relative to their
    row maximum; dropped tokens become -inf. A greedy row (temperature 0) keeps only its maximum.

    `log_softmax` of the result is the distribution that `sample` draws from. `truncated=False`
    skips top-k and top-p: the common RL setting, without a sort over the vocabulary.
    """
    # A temperature below the smallest normal float (1e-45 is a denormal) could flush to 0, and
    # 0 / 0 is NaN; relative to the maximum, any smaller temperature is greedy anyway.
    temperature = rows.temperature.to(logits.dtype).clamp(min=torch.finfo(logits.dtype).tiny)
    scaled = logits / temperature[:, None]
    if not truncated:
        return scaled
    vocab = logits.shape[-1]
    ordered, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    top_k = torch.where(rows.top_k > 0, rows.top_k, vocab)
    ordered = ordered.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token is needed only while the more likely ones have not yet reached top_p; the first token
    # always survives (even a top_p that rounds to 0), and top_p >= 1 rows skip this so rounding
    # drops nothing.
    top_p = rows.top_p.to(logits.dtype)[:, None]
    nucleus_full = (mass_before >= top_p) & (top_p < 1) & (ranks[None, :] > 0)
    ordered = ordered.masked_fill(nucleus_full, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
