"""The policy losses against an independent numpy reference: the loss value and its gradient with
respect to each current logprob, written out by hand from the papers' formulas, for every kind,
token weighting, the KL penalty, M2PO's mask and the bound on each token's lag, on random ragged
batches with stale tokens."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from pipelinerl.trainer.config import LossConfig, PolicyLossKind, TokenWeighting
from pipelinerl.trainer.losses import LossInputs, StepTotals, policy_loss


def reference_weights(mask: np.ndarray, weighting: TokenWeighting) -> np.ndarray:
    samples = mask.shape[0]
    if weighting is TokenWeighting.TOKEN:
        return mask / mask.sum()
    if weighting is TokenWeighting.SEQUENCE:
        return mask / (np.maximum(mask.sum(axis=1, keepdims=True), 1) * samples)
    return mask / samples


def reference_m2_mask(log_ratio: np.ndarray, mask: np.ndarray, threshold: float) -> np.ndarray:
    """Drop the token with the largest squared log-ratio, one at a time, while the mean over the
    remaining tokens is at or above the threshold (and more than one remains)."""
    kept = mask.copy()
    while kept.sum() > 1 and np.mean(log_ratio[kept] ** 2) >= threshold:
        squared = np.where(kept, log_ratio**2, -1.0)
        kept[np.unravel_index(np.argmax(squared), squared.shape)] = False
    return kept


def reference_loss(
    current: np.ndarray,
    behaviour: np.ndarray,
    reference: np.ndarray,
    advantages: np.ndarray,
    mask: np.ndarray,
    lag: np.ndarray,
    config: LossConfig,
) -> tuple[float, np.ndarray]:
    """(loss, d loss / d current logprob) of one micro-batch that is the whole step."""
    weights = reference_weights(mask, config.weighting)
    log_ratio = np.where(mask, current - behaviour, 0.0)
    ratio = np.exp(log_ratio)
    # Tokens over the lag bound leave the loss first; M2PO's mask then chooses among the rest.
    trained = mask if config.max_token_lag is None else mask & (lag <= config.max_token_lag)
    if config.m2_threshold is not None:
        trained = reference_m2_mask(log_ratio, trained, config.m2_threshold)
    if config.kind is PolicyLossKind.REINFORCE:
        # -min(r, cap) A logp with r held constant
        coefficient = np.minimum(ratio, config.ratio_cap) * advantages
        objective, slope = coefficient * current, coefficient
    elif config.kind is PolicyLossKind.PPO:
        low, high = 1 - config.clip_eps, 1 + config.clip_eps
        unclipped, clipped = ratio * advantages, np.clip(ratio, low, high) * advantages
        objective = np.minimum(unclipped, clipped)
        # d(r A)/d logp = r A where the unclipped term is the minimum; 0 where the clipped one is
        slope = np.where(unclipped <= clipped, ratio * advantages, 0.0)
    elif config.kind is PolicyLossKind.GSPO:
        low, high = 1 - config.gspo_clip_low, 1 + config.gspo_clip_high
        lengths = np.maximum(trained.sum(axis=1, keepdims=True), 1)
        sequence = np.exp(np.where(trained, log_ratio, 0.0).sum(axis=1, keepdims=True) / lengths)
        sequence = np.broadcast_to(sequence, current.shape)
        unclipped, clipped = sequence * advantages, np.clip(sequence, low, high) * advantages
        objective = np.minimum(unclipped, clipped)
        # every token's log-ratio enters its sequence's ratio with weight 1/length
        live = np.where(trained & (unclipped <= clipped), weights * sequence * advantages, 0.0)
        slope_of_sequence = live.sum(axis=1, keepdims=True) / lengths
        slope = np.where(weights > 0, slope_of_sequence / np.where(weights > 0, weights, 1), 0.0)
    else:  # decoupled: behaviour weight x PPO-clip against the proximal (= current) policy
        accepted = ratio <= config.behaviour_cap
        objective = np.where(accepted, ratio * advantages, 0.0)
        slope = objective.copy()
    objective = np.where(trained, objective, 0.0)
    slope = np.where(trained, slope, 0.0)
    loss = -(objective * weights).sum()
    gradient = -slope * weights
    if config.kl_coef > 0:
        delta = np.where(mask, reference - current, 0.0)
        loss += config.kl_coef * ((np.expm1(delta) - delta) * weights).sum()
        gradient += config.kl_coef * (1 - np.exp(delta)) * weights
    return float(loss), gradient


def random_batch(seed: int, staleness: float) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    sequences, width = 6, 9
    lengths = rng.integers(1, width + 1, sequences)
    mask = np.arange(width)[None, :] < lengths[:, None]
    current = -rng.uniform(0.05, 4.0, (sequences, width))
    behaviour = current + rng.normal(0.0, staleness, (sequences, width))
    reference = current + rng.normal(0.0, 0.3, (sequences, width))
    advantages = np.broadcast_to(rng.normal(0.0, 1.0, (sequences, 1)), (sequences, width)).copy()
    lag = rng.integers(0, 4, (sequences, width))
    return current, behaviour, reference, advantages, mask, lag


CONFIGS = [
    LossConfig(kind=kind, weighting=weighting, m2_threshold=m2, kl_coef=kl, max_token_lag=bound)
    for kind, weighting, m2, kl, bound in itertools.product(
        PolicyLossKind, TokenWeighting, (None, 0.04), (0.0, 0.1), (None, 1)
    )
]


@pytest.mark.parametrize(
    "config",
    CONFIGS,
    ids=lambda c: f"{c.kind}-{c.weighting}-m2={c.m2_threshold}-kl={c.kl_coef}-lag={c.max_token_lag}",
)
@pytest.mark.parametrize("staleness", [0.05, 0.6])
def test_loss_and_gradient_match_the_numpy_reference(config: LossConfig, staleness: float) -> None:
    for seed in range(4):
        current, behaviour, reference, advantages, mask, lag = random_batch(seed, staleness)
        expected_loss, expected_gradient = reference_loss(
            current, behaviour, reference, advantages, mask, lag, config
        )

        logprobs = torch.tensor(current, dtype=torch.float64, requires_grad=True)
        inputs = LossInputs(
            logprobs=logprobs,
            behaviour_logprobs=torch.tensor(behaviour),
            advantages=torch.tensor(advantages),
            mask=torch.tensor(mask),
            reference_logprobs=torch.tensor(reference),
            token_lag=torch.tensor(lag),
        )
        totals = StepTotals(samples=mask.shape[0], completion_tokens=int(mask.sum()))
        output = policy_loss(inputs, config, totals)
        (gradient,) = torch.autograd.grad(output.loss, logprobs)

        # float64 in, but the token weights are float32 (as in training): agreement to float32's precision.
        # With the lag bound most terms leave the loss and the rest, of ~0.1, nearly cancel: the absolute
        # error is theirs.
        atol = 1e-9 if config.max_token_lag is None else 1e-8
        assert float(output.loss.detach()) == pytest.approx(expected_loss, rel=1e-6, abs=atol)
        np.testing.assert_allclose(gradient.numpy(), expected_gradient, rtol=1e-6, atol=1e-9)


def test_the_m2_mask_leaves_out_only_the_largest_log_ratios_and_reaches_its_threshold() -> None:
    current, behaviour, _, advantages, mask, _ = random_batch(0, 0.6)
    config = LossConfig(kind=PolicyLossKind.DECOUPLED, m2_threshold=0.04)
    log_ratio = np.where(mask, current - behaviour, 0.0)
    kept = reference_m2_mask(log_ratio, mask, 0.04)
    assert 0 < kept.sum() < mask.sum()
    assert np.mean(log_ratio[kept] ** 2) < 0.04
    assert np.abs(log_ratio[kept]).max() <= np.abs(log_ratio[mask & ~kept]).min()

    inputs = LossInputs(
        torch.tensor(current, requires_grad=True),
        torch.tensor(behaviour),
        torch.tensor(advantages),
        torch.tensor(mask),
    )
    stats = policy_loss(inputs, config, StepTotals(mask.shape[0], int(mask.sum()))).stats
    # every left-out token counts as clipped (the behaviour cap of 5 leaves none out at this staleness)
    assert stats.clipped_tokens == int(mask.sum() - kept.sum())


def test_decoupled_leaves_out_tokens_over_the_behaviour_cap_where_reinforce_truncates_them() -> None:
    current, behaviour, _, advantages, mask, _ = random_batch(1, 0.05)
    behaviour[0, 0] = current[0, 0] - np.log(8.0)  # behaviour weight 8: over the cap of 5
    inputs = LossInputs(
        torch.tensor(current, requires_grad=True),
        torch.tensor(behaviour),
        torch.tensor(advantages),
        torch.tensor(mask),
    )
    totals = StepTotals(mask.shape[0], int(mask.sum()))
    decoupled = torch.autograd.grad(
        policy_loss(inputs, LossConfig(kind=PolicyLossKind.DECOUPLED), totals).loss, inputs.logprobs
    )[0]
    reinforce = torch.autograd.grad(
        policy_loss(inputs, LossConfig(kind=PolicyLossKind.REINFORCE), totals).loss, inputs.logprobs
    )[0]
    assert decoupled[0, 0] == 0
    assert reinforce[0, 0] == pytest.approx(-1.2 * advantages[0, 0] / mask.shape[0])


def test_tokens_over_the_lag_bound_leave_the_loss_and_count_as_clipped() -> None:
    current, behaviour, _, advantages, mask, lag = random_batch(2, 0.05)
    logprobs = torch.tensor(current, requires_grad=True)
    inputs = LossInputs(
        logprobs,
        torch.tensor(behaviour),
        torch.tensor(advantages),
        torch.tensor(mask),
        token_lag=torch.tensor(lag),
    )
    totals = StepTotals(mask.shape[0], int(mask.sum()))
    output = policy_loss(inputs, LossConfig(kind=PolicyLossKind.PPO, max_token_lag=1), totals)
    (gradient,) = torch.autograd.grad(output.loss, logprobs)

    stale = mask & (lag > 1)
    assert 0 < stale.sum() < mask.sum()
    assert (gradient.numpy()[stale] == 0).all()
    assert (gradient.numpy()[mask & ~stale] != 0).all()
    # at this staleness PPO's clip binds nowhere: every clipped token is a stale one
    assert output.stats.clipped_tokens == int(stale.sum())
    assert output.stats.tokens == int(mask.sum())  # still in the ratio, ESS and KL statistics

    with pytest.raises(ValueError, match="lag of each token"):
        policy_loss(replace(inputs, token_lag=None), LossConfig(max_token_lag=1), totals)
