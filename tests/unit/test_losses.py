"""Policy losses: the gradients each one promises, its clipping, and the statistics it reports."""

from __future__ import annotations

import math

import pytest
import torch

from pipelinerl.trainer.config import LossConfig, PolicyLossKind, TokenWeighting
from pipelinerl.trainer.losses import (
    LossInputs,
    LossStats,
    StepTotals,
    entropy_from_logits,
    k3_kl,
    policy_loss,
    token_weights,
)

LENGTHS = (5, 3, 1)
ADVANTAGES = (1.0, -0.5, 2.0)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current logprobs (a leaf with gradient), a ragged completion mask and per-row advantages."""
    generator = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(len(LENGTHS), max(LENGTHS), generator=generator) * 3).requires_grad_()
    mask = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    advantages = torch.tensor(ADVANTAGES)[:, None].expand_as(mask).contiguous()
    return logprobs, mask, advantages


def _totals(mask: torch.Tensor) -> StepTotals:
    return StepTotals(samples=mask.shape[0], completion_tokens=int(mask.sum()))


def _grad(inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    loss = policy_loss(inputs, config, _totals(inputs.mask)).loss
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    return grad


def test_on_policy_reinforce_is_the_plain_policy_gradient() -> None:
    logits = torch.randn(3, 5, 11, requires_grad=True)
    tokens = torch.randint(11, (3, 5))
    _, mask, advantages = _batch()
    logprobs = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    inputs = LossInputs(logprobs, logprobs.detach(), advantages, mask)

    loss = policy_loss(inputs, LossConfig(kind=PolicyLossKind.REINFORCE), _totals(mask)).loss
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    plain = -(advantages * logprobs * mask).sum() / mask.shape[0]
    (expected,) = torch.autograd.grad(plain, logits)

    torch.testing.assert_close(grad, expected)


def test_reinforce_truncates_large_importance_weights_at_the_cap() -> None:
    logprobs, mask, advantages = _batch()
    # Alternate tokens much likelier now than when generated (ratio e^3) with slightly likelier ones.
    shift = torch.where(torch.arange(5) % 2 == 0, 3.0, 0.1).expand_as(mask)
    inputs = LossInputs(logprobs, logprobs.detach() - shift, advantages, mask)
    config = LossConfig(kind=PolicyLossKind.REINFORCE, ratio_cap=1.2)

    grad = _grad(inputs, config)
    output = policy_loss(inputs, config, _totals(mask))

    weight = shift.exp().clamp(max=1.2)
    torch.testing.assert_close(grad, -weight * advantages * mask / 3)
    capped = (mask & (shift == 3.0)).sum() / mask.sum()
    assert output.stats.clip_fraction == pytest.approx(float(capped))


def test_ppo_zeroes_the_gradient_only_where_the_clipped_surrogate_wins() -> None:
    ratios = torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3])
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    inputs = LossInputs(logprobs, logprobs.detach() - ratios.log(), advantages, mask)
    config = LossConfig(kind=PolicyLossKind.PPO, clip_eps=0.2)

    grad = _grad(inputs, config)
    output = policy_loss(inputs, config, _totals(mask))

    # A > 0 and ratio above 1 + eps, or A < 0 and ratio below 1 - eps: no incentive to move further.
    clipped = torch.tensor([[True, False, False], [False, True, False]])
    expected = torch.where(clipped, 0.0, -advantages * ratios / 2)
    torch.testing.assert_close(grad, expected)
    assert output.stats.clip_fraction == pytest.approx(2 / 6)


def test_gspo_gives_every_token_of_a_sequence_one_ratio() -> None:
    # Row 0: per-token log-ratios that average to 0, so the sequence ratio is exactly 1.
    # Row 1: every token 1% likelier, so the sequence ratio leaves [1 - 3e-4, 1 + 4e-4].
    log_ratios = torch.tensor([[0.3, -0.3, 0.0], [0.01, 0.01, 0.01]])
    advantages = torch.tensor([[2.0] * 3, [1.0] * 3])
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    inputs = LossInputs(logprobs, logprobs.detach() - log_ratios, advantages, mask)
    config = LossConfig(kind=PolicyLossKind.GSPO, weighting=TokenWeighting.SEQUENCE)

    grad = _grad(inputs, config)
    output = policy_loss(inputs, config, _totals(mask))

    # d/dcur_t of -(1/N) * s * A with s = exp(mean_t log-ratio): -(1/N) * A * s / len, the same for
    # every token although their own ratios differ; the clipped row gets none.
    expected = torch.tensor([[-2.0 / 2 / 3] * 3, [0.0] * 3])
    torch.testing.assert_close(grad, expected)
    assert output.stats.clip_fraction == pytest.approx(3 / 6)


@pytest.mark.parametrize("kind", list(PolicyLossKind))
@pytest.mark.parametrize("weighting", list(TokenWeighting))
def test_micro_batch_losses_add_up_to_the_step_loss(kind: PolicyLossKind, weighting: TokenWeighting) -> None:
    logprobs, mask, advantages = _batch()
    behaviour = logprobs.detach() + 0.2 * torch.randn_like(logprobs)
    reference = logprobs.detach() - 0.1
    config = LossConfig(kind=kind, weighting=weighting, kl_coef=0.1)
    totals = _totals(mask)

    def loss_of(rows: slice) -> tuple[torch.Tensor, LossStats]:
        inputs = LossInputs(logprobs[rows], behaviour[rows], advantages[rows], mask[rows], reference[rows])
        output = policy_loss(inputs, config, totals)
        return output.loss, output.stats

    whole, whole_stats = loss_of(slice(0, 3))
    first, first_stats = loss_of(slice(0, 1))
    rest, rest_stats = loss_of(slice(1, 3))
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    (split_grad,) = torch.autograd.grad(first + rest, logprobs)

    torch.testing.assert_close(split_grad, whole_grad)
    summed = first_stats + rest_stats
    assert summed.loss == pytest.approx(whole_stats.loss)
    assert summed.ess == pytest.approx(whole_stats.ess)
    assert summed.kl == pytest.approx(whole_stats.kl)
    assert summed.clip_fraction == pytest.approx(whole_stats.clip_fraction)


def test_token_weightings_balance_tokens_or_sequences() -> None:
    _, mask, _ = _batch()
    totals = _totals(mask)
    per_row = {w: token_weights(mask, w, totals).sum(dim=1) for w in TokenWeighting}

    assert per_row[TokenWeighting.TOKEN].sum() == pytest.approx(1.0)
    torch.testing.assert_close(per_row[TokenWeighting.TOKEN], torch.tensor(LENGTHS) / sum(LENGTHS))
    torch.testing.assert_close(per_row[TokenWeighting.SEQUENCE], torch.full((3,), 1 / 3))
    torch.testing.assert_close(per_row[TokenWeighting.SAMPLE_COUNT], torch.tensor(LENGTHS) / 3.0)


def test_k3_kl_is_non_negative_and_zero_when_the_models_agree() -> None:
    current = torch.randn(1000)
    reference = torch.randn(1000)
    everywhere = torch.ones(1000, dtype=torch.bool)
    assert (k3_kl(current, reference, everywhere, 10.0) >= 0).all()
    assert torch.equal(k3_kl(current, current, everywhere, 10.0), torch.zeros(1000))


def test_k3_kl_of_a_small_difference_is_its_square_over_two_not_zero() -> None:
    current = torch.full((4,), -1.0)
    reference = current + torch.tensor([1e-4, -1e-4, 1e-3, 3e-5])
    kl = k3_kl(current, reference, torch.ones(4, dtype=torch.bool), 10.0)
    torch.testing.assert_close(kl, (reference - current) ** 2 / 2, rtol=2e-2, atol=0)


@pytest.mark.parametrize("kind", list(PolicyLossKind))
def test_log_ratios_of_hundreds_of_nats_leave_loss_and_gradient_finite(kind: PolicyLossKind) -> None:
    """float32 exp overflows past ~88: a token the policy, the behaviour and the reference models
    disagree on wildly, in the completion or at a prompt/padding position, must not turn the step NaN."""
    logprobs, mask, advantages = _batch()
    far = torch.zeros_like(logprobs)
    far[0, 0], far[0, 1], far[1, 4] = 200.0, -200.0, 300.0  # [1, 4] is padding
    inputs = LossInputs(logprobs, logprobs.detach() - far, advantages, mask, logprobs.detach() + far)
    config = LossConfig(kind=kind, kl_coef=0.1)

    output = policy_loss(inputs, config, _totals(mask))
    (grad,) = torch.autograd.grad(output.loss, logprobs)

    assert math.isfinite(output.stats.loss) and bool(torch.isfinite(grad).all())
    stats = output.stats
    assert all(math.isfinite(x) for x in (stats.kl or 0.0, stats.ess, stats.mean_ratio))
    assert stats.kl is not None and stats.kl > 1.0  # clamped, not ignored


def test_kl_penalty_reports_zero_and_changes_nothing_while_on_the_reference() -> None:
    logprobs, mask, advantages = _batch()
    with_reference = LossInputs(logprobs, logprobs.detach(), advantages, mask, logprobs.detach())
    plain = LossInputs(logprobs, logprobs.detach(), advantages, mask)
    config = LossConfig(kl_coef=0.5)

    output = policy_loss(with_reference, config, _totals(mask))

    assert output.stats.kl == 0.0
    torch.testing.assert_close(_grad(with_reference, config), _grad(plain, LossConfig()))


def test_ess_is_one_on_policy_and_shrinks_when_one_token_dominates() -> None:
    logprobs = torch.zeros(1, 3, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)

    def stats(behaviour: torch.Tensor) -> LossStats:
        inputs = LossInputs(logprobs, behaviour, torch.ones(1, 3), mask)
        return policy_loss(inputs, LossConfig(), _totals(mask)).stats

    on_policy = stats(logprobs.detach())
    # Importance weights 1, 1, 4: (1 + 1 + 4)^2 / (3 * (1 + 1 + 16)) = 2/3.
    stale = stats(-torch.tensor([[0.0, 0.0, math.log(4)]]))

    assert on_policy.ess == pytest.approx(1.0)
    assert on_policy.mean_ratio == pytest.approx(1.0)
    assert stale.ess == pytest.approx(2 / 3)
    assert stale.mean_ratio == pytest.approx(2.0)


def test_entropy_bonus_pushes_towards_a_flatter_distribution() -> None:
    logits = torch.tensor([[[3.0, 0.0, -1.0, 0.5]]], requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    logprobs = logits.log_softmax(-1)[..., 0]
    no_advantage = torch.zeros(1, 1)
    inputs = LossInputs(logprobs, logprobs.detach(), no_advantage, mask, entropy=entropy_from_logits(logits))

    policy_loss(inputs, LossConfig(entropy_coef=1.0), _totals(mask)).loss.backward()
    with torch.no_grad():
        after = entropy_from_logits(logits - 0.5 * logits.grad)

    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert after.item() > entropy_from_logits(logits).item()


@pytest.mark.parametrize("weighting", list(TokenWeighting))
def test_entropy_bonus_is_each_samples_mean_whatever_its_length(weighting: TokenWeighting) -> None:
    """The bonus is the mean over samples of each one's mean token entropy: a long completion gets
    no more of it than a short one (summed over tokens, it drove long completions to uniform)."""
    _, mask, _ = _batch()
    entropy = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    zeros = torch.zeros(mask.shape)
    inputs = LossInputs(zeros, zeros, zeros, mask, entropy=entropy)
    config = LossConfig(entropy_coef=0.5, weighting=weighting)

    loss = policy_loss(inputs, config, _totals(mask)).loss

    means = [entropy[row, :length].mean() for row, length in enumerate(LENGTHS)]
    assert loss.item() == pytest.approx(-0.5 * float(torch.stack(means).mean()))


def test_entropy_floor_leaves_the_samples_above_it_alone() -> None:
    """With a floor, only the samples whose mean token entropy is below it get the bonus's gradient;
    the others, still exploring, are pushed by the reward alone."""
    _, mask, _ = _batch()
    entropy = torch.tensor([[2.0] * 5, [0.2] * 3 + [0.0] * 2, [1.5] + [0.0] * 4], requires_grad=True)
    zeros = torch.zeros(mask.shape)
    config = LossConfig(entropy_coef=0.5, entropy_floor=1.0)

    policy_loss(LossInputs(zeros, zeros, zeros, mask, entropy=entropy), config, _totals(mask)).loss.backward()

    assert entropy.grad is not None
    pushed = entropy.grad.ne(0).any(dim=1).tolist()
    assert pushed == [False, True, False]
    assert entropy.grad[1, :3] == pytest.approx(torch.full((3,), -0.5 / (3 * len(LENGTHS))))


def test_a_floor_per_token_pushes_each_token_below_it_whatever_its_sample_s_mean() -> None:
    """A sample whose mean is above the floor, carried by one exploring token, still gets the push
    where it has collapsed; tokens above the floor and padding get none."""
    _, mask, _ = _batch()
    entropy = torch.tensor(
        [[3.0, 0.1, 0.1, 2.0, 2.0], [0.2] * 3 + [0.0] * 2, [1.5] + [0.0] * 4], requires_grad=True
    )
    zeros = torch.zeros(mask.shape)
    config = LossConfig(entropy_coef=0.5, entropy_floor=1.0, entropy_floor_per="token")

    policy_loss(LossInputs(zeros, zeros, zeros, mask, entropy=entropy), config, _totals(mask)).loss.backward()

    assert entropy.grad is not None
    pushed = entropy.grad.ne(0).tolist()
    assert pushed[0] == [False, True, True, False, False]
    assert pushed[1] == [True, True, True, False, False] and not any(pushed[2])
    assert entropy.grad[0, 1] == pytest.approx(-0.5 / (5 * len(LENGTHS)))
