"""Token choice: greedy, temperature, top-k, top-p, per-request seeds, and the logprob convention."""

from __future__ import annotations

import math

import pytest
import torch

from pipelinerl.common.types import SamplingParams
from pipelinerl.inference.sampling import RowSampling, SampledTokens, filter_logits, sample, uniform_stream

# Probabilities 0.5, 0.3, 0.15, 0.05 for tokens 0..3.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def choose(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int] | None = None
) -> SampledTokens:
    """`sample` over rows with these params, each drawing the first number of its seed's stream
    (seeds 0, 1, ... by default)."""
    seeds = list(range(len(params))) if seeds is None else seeds
    uniforms = torch.cat([uniform_stream(seed, 1) for seed in seeds])
    return sample(logits, RowSampling.of(params), uniforms)


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = 1, seed: int = 0) -> list[int]:
    """The first n tokens a request with this seed draws from `logits`."""
    return sample(
        logits.expand(n, -1), RowSampling.of([params] * n), uniform_stream(seed, n)
    ).token_ids.tolist()


def test_greedy_takes_the_argmax_with_the_raw_logprob() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    out = choose(logits, [SamplingParams(temperature=0)] * 2)
    assert out.token_ids.tolist() == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)[[0, 1], [1, 0]]
    torch.testing.assert_close(out.logprobs, expected)


def test_top_k_1_is_greedy_with_logprob_zero() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    out = choose(logits, [SamplingParams(top_k=1)] * 5)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs.tolist() == [0.0] * 5


def test_same_seed_same_samples_different_seed_different_samples() -> None:
    logits = torch.zeros(1000)
    params = SamplingParams(seed=7)
    assert draw(params, logits, n=20, seed=7) == draw(params, logits, n=20, seed=7)
    assert draw(params, logits, n=20, seed=7) != draw(params, logits, n=20, seed=8)


def test_samples_follow_the_distribution() -> None:
    tokens = torch.tensor(draw(SamplingParams(), n=4000))
    frequencies = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(frequencies, PROBS, atol=0.03, rtol=0)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: set[int]) -> None:
    assert set(draw(SamplingParams(top_p=top_p), n=400)) == kept


def test_top_k_keeps_the_k_most_likely() -> None:
    assert set(draw(SamplingParams(top_k=2), n=300)) == {0, 1}


def test_logprob_is_under_the_renormalised_filtered_distribution() -> None:
    params = SamplingParams(temperature=0.5, top_k=3)
    out = choose(LOGITS[None], [params], [3])
    top3 = (LOGITS[:3] / 0.5).softmax(dim=-1)
    token = out.token_ids.item()
    assert out.logprobs.item() == pytest.approx(math.log(top3[token].item()), abs=1e-6)


def test_filter_logits_applies_top_k_before_top_p() -> None:
    # After top-k=2 the renormalised probabilities are 0.625 and 0.375, so top-p=0.6 keeps one token.
    filtered = filter_logits(LOGITS[None], RowSampling.of([SamplingParams(top_k=2, top_p=0.6)]))
    assert torch.isfinite(filtered[0]).tolist() == [True, False, False, False]


def test_rows_of_one_batch_use_their_own_params() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, seed=1)]
    out = choose(logits, params)
    assert out.token_ids.tolist() == [0, 3]


def test_logprobs_are_float32_for_half_precision_logits() -> None:
    out = choose(LOGITS[None].bfloat16(), [SamplingParams()])
    assert out.logprobs.dtype == torch.float32


@pytest.mark.parametrize("flush_denormal", [False, True])
@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-30, 1e-6, 1.0, 100.0])
@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 0), (1e-45, 0), (1e-50, 0), (0.9, 3), (1.0, 2**31 - 1)])
def test_the_whole_documented_range_samples_with_finite_logprobs(
    flush_denormal: bool, temperature: float, top_p: float, top_k: int
) -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 1e3  # extreme logits
    logits[0, :10] = logits[0].max()  # ties at the top
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)] * 4
    torch.set_flush_denormal(flush_denormal)  # denormal temperatures may then read as 0
    try:
        out = choose(logits.bfloat16(), params)
    finally:
        torch.set_flush_denormal(False)  # torch's default
    assert out.valid.all()
    assert torch.isfinite(out.logprobs).all() and (out.logprobs <= 0).all()
    if temperature <= 1e-6 or top_p < 1e-40:
        assert out.token_ids[1:].tolist() == logits.bfloat16()[1:].argmax(dim=-1).tolist()


def test_rows_without_a_finite_maximum_are_invalid_and_the_others_sampled() -> None:
    bad = {0: float("nan"), 1: float("inf"), 2: float("-inf")}
    logits = LOGITS.repeat(8, 1)
    for row, value in bad.items():
        logits[row, 1 if row < 2 else slice(None)] = value
        logits[row + 4, 1 if row < 2 else slice(None)] = value
    params = [SamplingParams(temperature=0)] * 4 + [SamplingParams()] * 4
    out = choose(logits, params)
    assert out.valid.tolist() == [False, False, False, True] * 2
    assert out.token_ids[3].item() == 0 and torch.isfinite(out.logprobs[[3, 7]]).all()


def test_each_row_draws_with_its_own_number_and_params_whatever_else_is_in_the_batch() -> None:
    """Row by row, a batch draws what each row draws alone: its token depends on its own logits,
    parameters and number only."""
    peaked = torch.full((4,), -30.0)
    peaked[2] = 0.0  # token 2 always
    logits = torch.stack([LOGITS, peaked, LOGITS, LOGITS.flip(0)])
    params = [SamplingParams(), SamplingParams(), SamplingParams(top_k=3), SamplingParams(temperature=0.5)]
    for seed in range(200):
        uniforms = uniform_stream(seed, 4)
        batched = sample(logits, RowSampling.of(params), uniforms).token_ids.tolist()
        alone = [
            sample(logits[i : i + 1], RowSampling.of(params[i : i + 1]), uniforms[i : i + 1]).token_ids.item()
            for i in range(4)
        ]
        assert batched == alone
        assert batched[1] == 2 and batched[2] != 3  # top-k 3 never draws the least likely token


def test_a_seed_gives_the_same_stream_and_another_seed_another() -> None:
    assert torch.equal(uniform_stream(7, 50), uniform_stream(7, 50))
    assert not torch.equal(uniform_stream(7, 50), uniform_stream(8, 50))
    assert torch.equal(uniform_stream(2**64 - 1, 5), uniform_stream(-1, 5))  # 64 bits of any int
