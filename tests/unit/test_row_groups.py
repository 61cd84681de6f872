"""Decode attention by groups of rows: the groups, the moves that keep them tight, attention equal
to one group's, and an engine whose rows move between groups yielding the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pipelinerl.common.model import LoadedModel, build_preset
from pipelinerl.common.types import SamplingParams
from pipelinerl.inference import engine as engine_module
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.row_groups import grouped_sdpa, groups_of, read_cost, regrouping
from pipelinerl.inference.types import GenerationRequest


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return build_preset("tiny", seed=0)


def test_groups_are_contiguous_equal_and_attend_to_their_longest_row() -> None:
    positions = np.array([9, 3, 4, 30, 2, 2, 7])
    assert groups_of(positions, 3) == ((0, 2, 10), (2, 4, 31), (4, 7, 8))
    assert groups_of(positions[:2], 4) == ((0, 1, 10), (1, 2, 4))  # fewer rows than groups
    assert read_cost(positions, 1) == 7 * 31


def test_regrouping_moves_only_the_rows_out_of_their_group_and_makes_the_groups_tight() -> None:
    rng = np.random.default_rng(0)
    positions = rng.integers(1, 300, 64)
    sources, targets = regrouping(positions, 4) or ([], [])
    assert sources and sorted(sources) == sorted(targets)
    order = np.arange(64)
    order[targets] = sources
    regrouped = positions[order]
    assert read_cost(regrouped, 4) == read_cost(np.sort(positions)[::-1].copy(), 4)
    for (a, b, _), (c, d, _) in zip(groups_of(regrouped, 4), groups_of(regrouped, 4)[1:], strict=False):
        assert regrouped[a:b].min() >= regrouped[c:d].max()  # each group's rows outrank the next's
    rank_group = np.empty(64, int)
    rank_group[np.argsort(-positions, kind="stable")] = np.arange(64) // 16
    assert len(sources) == np.count_nonzero(rank_group != np.arange(64) // 16)  # only those move
    assert regrouping(regrouped, 4) is None  # nothing out of place


def test_regrouping_declines_when_the_copy_costs_more_than_the_reading_it_saves() -> None:
    positions = np.array([100, 99, 98, 1, 97, 2, 3, 4])  # one long row among the short ones
    assert regrouping(positions, 2, horizon=100) is not None
    assert regrouping(positions, 2, horizon=1) is None


def test_grouped_attention_equals_one_group_within_float_error() -> None:
    torch.manual_seed(0)

    class Module(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    rows, kv_len = 12, 40
    query = torch.randn(rows, 4, 1, 16)
    key, value = torch.randn(rows, 2, kv_len, 16), torch.randn(rows, 2, kv_len, 16)
    positions = np.sort(np.random.default_rng(1).integers(0, kv_len, rows))[::-1].copy()
    allowed = torch.arange(kv_len)[None, :] <= torch.as_tensor(positions)[:, None]
    mask = torch.zeros(rows, 1, 1, kv_len).masked_fill_(
        ~allowed[:, None, None, :], torch.finfo(torch.float32).min
    )
    groups = groups_of(positions, 4)
    assert len({length for *_, length in groups}) > 1  # the groups do cut the keys
    expected, _ = sdpa_attention_forward(Module(), query, key, value, mask, scaling=0.25)
    grouped, _ = grouped_sdpa(Module(), query, key, value, mask, row_groups=groups, scaling=0.25)
    torch.testing.assert_close(grouped, expected, rtol=0, atol=1e-5)


def test_an_engine_regrouping_its_rows_yields_the_tokens_of_one_group(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests of very different lengths joining a batch of 6 rows as others end: rows move between
    groups (counted), and every request's tokens and logprobs are those of a one-group engine."""
    regroupings: list[int] = []
    real = engine_module.regrouping

    def counted(positions: np.ndarray, count: int) -> tuple[list[int], list[int]] | None:
        moves = real(positions, count)
        regroupings.append(moves is not None)
        return moves

    monkeypatch.setattr(engine_module, "regrouping", counted)
    prompts = [tiny.tokenizer("7" * n)["input_ids"] for n in (1, 40, 3, 90, 12, 5, 60, 2, 25, 8, 70, 4)]
    lengths = [30, 3, 50, 6, 20, 40, 2, 35, 9, 28, 5, 44]

    def generate(groups: int) -> dict[str, tuple[list[int], list[float]]]:
        settings = EngineSettings(max_running=6, ignore_eos=True, decode_groups=groups)
        engine = InferenceEngine(tiny.model, tiny.tokenizer, settings)
        for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
            sampling = SamplingParams(temperature=1.0, max_new_tokens=n, seed=i)
            engine.add_request(GenerationRequest(f"r{i}", prompt, sampling))
        finals = {}
        while engine.has_work:
            for update in engine.step():
                if update.finish_reason is not None:
                    finals[update.request_id] = (update.tokens.token_ids, update.tokens.logprobs)
        return finals

    one = generate(1)
    assert not regroupings  # one group: never regrouped
    grouped = generate(3)
    assert any(regroupings)
    assert grouped.keys() == one.keys()
    for request_id, (tokens, logprobs) in one.items():
        assert grouped[request_id][0] == tokens, request_id
        np.testing.assert_allclose(grouped[request_id][1], logprobs, atol=1e-4)
