"""Per-token policy-gradient losses: truncated IS REINFORCE, PPO-clip, GSPO and AReaL's decoupled PPO,
M2PO's second-moment mask and a bound on each token's lag over any of them, plus KL and entropy
terms.

Every tensor is [sequences, positions], aligned on *predicted* tokens: position t holds the current
and behaviour logprob of the same token, its advantage, and `mask[t]` says whether it is a model
token (the learner passes completion positions only; padding, and the context tokens of a segmented
sample, are False and contribute nothing: no loss, no ratio, no KL, no entropy, no statistics).

    current logprobs ─┐
    behaviour logprobs┼─► ratio = exp(clamp(cur - behaviour)) ─► objective per kind ─┐
    advantages ───────┘                                                              ├─► × token weight ─► Σ
    reference logprobs ──► k3 KL of clamp(ref - cur) ────────────────────────────────┤
    entropy of current logits ────────────────────────────────────────────────┘

The token weights already divide by the *optimizer step's* totals (`StepTotals`), so a micro-batch's
loss is its exact share of the step loss: summing the gradients of the micro-batches gives the same
gradient however the step's samples were split. The one exception is M2PO's mask, which is chosen
within each micro-batch (as AReaL does): choosing it over the step would take a forward pass over
the whole step before the first backward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pipelinerl.trainer.config import LossConfig, PolicyLossKind, TokenWeighting


@dataclass(frozen=True)
class StepTotals:
    """Counts over a whole optimizer step, which every micro-batch's loss is normalised by."""

    samples: int
    """Sequences in the step."""
    completion_tokens: int
    """Model tokens in the step, the ones the loss trains: every completion token of a single-turn
    sample, the model segments' of a segmented one."""


@dataclass
class LossInputs:
    """One micro-batch, every tensor [sequences, positions] aligned on predicted tokens."""

    logprobs: torch.Tensor
    """Current policy's logprobs of the tokens, with gradient."""
    behaviour_logprobs: torch.Tensor
    """Logprobs under the weights that generated the tokens (from the inference server)."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """Bool: True on model tokens (the ones trained)."""
    reference_logprobs: torch.Tensor | None = None
    """Frozen reference model's logprobs; needed when `kl_coef > 0`, reported as KL when given."""
    entropy: torch.Tensor | None = None
    """Full-vocabulary entropy of the current distribution at each position (see `entropy_from_logits`);
    needs gradient when `entropy_coef > 0`."""
    token_lag: torch.Tensor | None = None
    """Versions between the weights that sampled each token and the ones the step trains; needed
    when `max_token_lag` is set."""


@dataclass
class LossStats:
    """Sums over model tokens; add the stats of micro-batches, then read the properties."""

    tokens: int = 0
    loss: float = 0.0
    """Sum of the micro-batch losses, i.e. the step loss."""
    clipped_tokens: int = 0
    """Tokens whose gradient was truncated (REINFORCE), zeroed by clipping (PPO, GSPO, decoupled) or
    left out of the loss (decoupled's behaviour cap, M2PO's second-moment mask, `max_token_lag`)."""
    ratio_sum: float = 0.0
    ratio_sq_sum: float = 0.0
    kl_tokens: int = 0
    kl_sum: float = 0.0
    entropy_tokens: int = 0
    entropy_sum: float = 0.0

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def clip_fraction(self) -> float:
        return self.clipped_tokens / max(self.tokens, 1)

    @property
    def mean_ratio(self) -> float:
        return self.ratio_sum / max(self.tokens, 1)

    @property
    def ess(self) -> float:
        """Effective sample size of the per-token importance weights as a fraction: (Σw)² / (n Σw²),
        1 when on-policy, towards 1/n when a few stale tokens dominate."""
        if self.ratio_sq_sum == 0:
            return 1.0
        return self.ratio_sum**2 / (self.tokens * self.ratio_sq_sum)

    @property
    def kl(self) -> float | None:
        return self.kl_sum / self.kl_tokens if self.kl_tokens else None

    @property
    def entropy(self) -> float | None:
        return self.entropy_sum / self.entropy_tokens if self.entropy_tokens else None


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar: this micro-batch's share of the step loss; call `backward` on it."""
    stats: LossStats


def policy_loss(inputs: LossInputs, config: LossConfig, totals: StepTotals) -> LossOutput:
    """The micro-batch's loss, normalised by the whole step's `totals`, and its statistics."""
    mask = inputs.mask
    if config.needs_reference and inputs.reference_logprobs is None:
        raise ValueError("kl_coef > 0 needs reference logprobs")
    log_ratio = masked_log_ratio(inputs.logprobs, inputs.behaviour_logprobs, mask, config.max_log_ratio)
    trained = mask
    if config.max_token_lag is not None:
        if inputs.token_lag is None:
            raise ValueError("max_token_lag needs the lag of each token")
        trained = mask & (inputs.token_lag <= config.max_token_lag)
    if config.m2_threshold is not None:
        trained = second_moment_mask(log_ratio.detach(), trained, config.m2_threshold)
    objective, clipped = _objective(config, inputs.logprobs, log_ratio, inputs.advantages, trained)
    clipped = clipped | (mask & ~trained)
    per_token = -torch.where(trained, objective, 0.0)
    kl = None
    if inputs.reference_logprobs is not None:
        kl = k3_kl(inputs.logprobs, inputs.reference_logprobs, mask, config.max_log_ratio)
        per_token = per_token + config.kl_coef * kl
    weights = token_weights(mask, config.weighting, totals)
    loss = torch.where(mask, per_token * weights, 0.0).sum()
    if config.entropy_coef > 0:
        if inputs.entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy of the current logits")
        # Each sample's mean token entropy, averaged over the step's samples, whatever the loss's
        # weighting: the bonus must not grow with a completion's length, or on long completions
        # it outweighs the reward and drives the policy to uniform.
        per_sample = token_weights(mask, TokenWeighting.SEQUENCE, totals)
        if config.entropy_floor is not None:
            # What is above the floor gets no push: min(entropy, floor) per token, or per sample of
            # its mean token entropy.
            entropy = inputs.entropy.detach()
            if config.entropy_floor_per == "token":
                below = entropy < config.entropy_floor
            else:
                below = (masked_sequence_mean(entropy, mask) < config.entropy_floor)[:, None]
            per_sample = per_sample * below
        loss = loss - config.entropy_coef * torch.where(mask, inputs.entropy * per_sample, 0.0).sum()
    return LossOutput(loss, _stats(loss, log_ratio, clipped, mask, kl, inputs.entropy))


def _objective(
    config: LossConfig,
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token objective to maximise, and which tokens it clipped."""
    if config.kind is PolicyLossKind.REINFORCE:
        ratio = log_ratio.detach().exp()
        return ratio.clamp(max=config.ratio_cap) * advantages * logprobs, mask & (ratio > config.ratio_cap)
    if config.kind is PolicyLossKind.PPO:
        return _clipped_surrogate(log_ratio.exp(), advantages, 1 - config.clip_eps, 1 + config.clip_eps, mask)
    if config.kind is PolicyLossKind.DECOUPLED:
        # One optimizer step per batch: the proximal policy is the current one at the step's start,
        # so its logprobs are these, detached, and the behaviour weight is the detached ratio.
        behaviour_weight = log_ratio.detach().exp()
        accepted = mask & (behaviour_weight <= config.behaviour_cap)
        proximal_ratio = (logprobs - logprobs.detach()).exp()
        low, high = 1 - config.clip_eps, 1 + config.clip_eps
        surrogate, clipped = _clipped_surrogate(proximal_ratio, advantages, low, high, mask)
        return torch.where(accepted, behaviour_weight * surrogate, 0.0), clipped | (mask & ~accepted)
    # GSPO: the length-normalised sequence log-ratio is shared by all tokens of the sequence.
    sequence_log_ratio = masked_sequence_mean(log_ratio, mask)[:, None].expand_as(log_ratio)
    low, high = 1 - config.gspo_clip_low, 1 + config.gspo_clip_high
    return _clipped_surrogate(sequence_log_ratio.exp(), advantages, low, high, mask)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic min of the plain and clipped surrogates; `clipped` marks where the clipped
    one wins with a different value, i.e. where the gradient is zero."""
    unclipped = ratio * advantages
    clipped_term = ratio.clamp(low, high) * advantages
    clipped = mask & (clipped_term < unclipped)
    return torch.minimum(unclipped, clipped_term), clipped


def second_moment_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's trust region (Zheng et al. 2025, as AReaL implements it): of `mask`'s tokens, leave
    out those with the largest squared log-ratio until the mean over the rest is below
    `threshold`; at least one token stays."""
    squared = log_ratio[mask].square()
    count = squared.numel()
    if count == 0:
        return mask
    ordered, order = squared.sort(descending=True)
    positions = torch.arange(count, device=ordered.device)
    suffix_mean = ordered.flip(0).cumsum(0).flip(0) / (count - positions).to(ordered.dtype)
    below = (suffix_mean < threshold).nonzero()
    dropped = int(below[0]) if len(below) else count - 1
    keep = torch.empty_like(positions, dtype=torch.bool)
    keep[order] = positions >= dropped
    kept = torch.zeros_like(mask)
    kept[mask] = keep
    return kept


def token_weights(mask: torch.Tensor, weighting: TokenWeighting, totals: StepTotals) -> torch.Tensor:
    """Weight of each token in the step loss; the weights over the whole step sum to 1 (sample count:
    to the mean number of tokens per sample)."""
    mask = mask.float()
    if weighting is TokenWeighting.TOKEN:
        return mask / max(totals.completion_tokens, 1)
    if weighting is TokenWeighting.SEQUENCE:
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
        return mask / (lengths * max(totals.samples, 1))
    return mask / max(totals.samples, 1)


def masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over each row's masked positions: [sequences]; 0 for a row with none."""
    total = torch.where(mask, values, 0.0).sum(dim=1)
    return total / mask.sum(dim=1).clamp(min=1)


def masked_log_ratio(
    numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor, limit: float
) -> torch.Tensor:
    """`numerator - denominator` clamped to ±`limit`, 0 outside `mask`. Masking before exp matters:
    a prompt or padding position can hold any logprob, and an inf there would still turn the
    gradient into NaN through torch.where (0 × inf)."""
    return torch.where(mask, numerator - denominator, 0.0).clamp(-limit, limit)


def k3_kl(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor, max_log_ratio: float
) -> torch.Tensor:
    """Schulman's k3 estimator of KL(current || reference) per token: exp(d) - 1 - d with
    d = ref - cur (clamped, 0 outside `mask`). Non-negative, zero where the two agree, unbiased on
    tokens sampled from current. expm1 keeps it accurate for small d, where exp(d) - 1 rounds to 0."""
    delta = masked_log_ratio(reference_logprobs, logprobs, mask, max_log_ratio)
    return torch.expm1(delta) - delta


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last (vocabulary) dimension, in float32."""
    logits = logits.float()
    log_probs = logits.log_softmax(dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


@torch.no_grad()
def _stats(
    loss: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> LossStats:
    ratio = log_ratio[mask].exp()
    tokens = int(mask.sum())
    return LossStats(
        tokens=tokens,
        loss=float(loss),
        clipped_tokens=int(clipped.sum()),
        ratio_sum=float(ratio.sum()),
        ratio_sq_sum=float(ratio.square().sum()),
        kl_tokens=tokens if kl is not None else 0,
        kl_sum=float(kl[mask].sum()) if kl is not None else 0.0,
        entropy_tokens=tokens if entropy is not None else 0,
        entropy_sum=float(entropy[mask].sum()) if entropy is not None else 0.0,
    )
