"""The built-in engine as a user sees it: same tokens as HF `generate`, correct logprobs, finish
reasons, aborts, capacity, request validation, and weight swaps in the middle of a generation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pipelinerl.common.model import LoadedModel, build_preset
from pipelinerl.common.types import FinishReason, SamplingParams
from pipelinerl.inference import batch as batch_module
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import FailedUpdate, InferenceEngine
from pipelinerl.inference.kv_cache import cache_argument
from pipelinerl.inference.sampling import RowSampling, SampledTokens
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate

PROMPTS = ["12+34=", "The quick brown fox jumps over", "a", "What is 7 * 6? Let me think.", "x = y"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
# Random weights emit EOS now and then; comparisons with fixed lengths switch it off.
NO_EOS = EngineSettings(ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return build_preset("tiny", seed=0)


def encode(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def request(request_id: str, prompt: list[int], sampling: SamplingParams = GREEDY) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, sampling)


def hf_greedy(loaded: LoadedModel, prompt: list[int], n: int, *, stop_at_eos: bool = False) -> list[int]:
    eos = {} if stop_at_eos else {"eos_token_id": None}
    out = loaded.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, **eos)
    return out[0, len(prompt) :].tolist()


def collect(updates: list[GenerationUpdate], into: dict[str, GenerationUpdate]) -> None:
    """Keep the final update of each request (for a request that does not stream, it has every token)."""
    into.update((u.request_id, u) for u in updates if u.finish_reason is not None)


def run(engine: InferenceEngine) -> dict[str, GenerationUpdate]:
    finals: dict[str, GenerationUpdate] = {}
    while engine.has_work:
        collect(engine.step(), finals)
    return finals


def test_greedy_equals_hf_generate_with_requests_joining_mid_flight(tiny: LoadedModel) -> None:
    # 3 rows for 5 requests: some wait in the queue, rows are reused and compacted as requests end.
    engine = InferenceEngine(tiny.model, tiny.tokenizer, EngineSettings(max_running=3, ignore_eos=True))
    lengths = [24, 9, 17, 5, 13]
    finals: dict[str, GenerationUpdate] = {}
    # Two prompts of different lengths share a padded prefill; the others join one per step.
    for wave in ([0, 1], [2], [3], [4]):
        for i in wave:
            sampling = SamplingParams(temperature=0, max_new_tokens=lengths[i])
            engine.add_request(request(f"r{i}", encode(tiny, PROMPTS[i]), sampling))
        collect(engine.step(), finals)
    finals |= run(engine)
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
        assert finals[f"r{i}"].tokens.token_ids == hf_greedy(tiny, encode(tiny, prompt), n), prompt
        assert finals[f"r{i}"].finish_reason == FinishReason.LENGTH


def test_a_prompt_shared_by_a_group_is_prefilled_once_and_each_row_decodes_as_if_alone(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four attempts of one prompt and one other prompt, admitted together: one prefill row per
    distinct prompt; greedy attempts match HF generate, seeded ones their run alone."""
    prefilled_rows: list[int] = []
    real_forward = InferenceEngine._forward

    def forward(engine: InferenceEngine, input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        if input_ids.shape[1] > 1:
            prefilled_rows.append(input_ids.shape[0])
        return real_forward(engine, input_ids, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(InferenceEngine, "_forward", forward)
    shared, other = encode(tiny, PROMPTS[1]), encode(tiny, PROMPTS[0])
    seeded = [SamplingParams(seed=i, max_new_tokens=12) for i in range(2)]
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    for i in range(2):
        engine.add_request(request(f"greedy{i}", shared))
        engine.add_request(request(f"seeded{i}", shared, seeded[i]))
    engine.add_request(request("other", other))
    finals = run(engine)
    assert prefilled_rows == [2]
    for i in range(2):
        assert finals[f"greedy{i}"].tokens.token_ids == hf_greedy(tiny, shared, GREEDY.max_new_tokens)
    assert finals["other"].tokens.token_ids == hf_greedy(tiny, other, GREEDY.max_new_tokens)
    for i in range(2):
        alone = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
        alone.add_request(request("alone", shared, seeded[i]))
        expected = run(alone)["alone"].tokens
        assert finals[f"seeded{i}"].tokens.token_ids == expected.token_ids
        torch.testing.assert_close(finals[f"seeded{i}"].tokens.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_eos_ends_a_sequence_like_hf_generate(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer)
    prompt = encode(tiny, "db")  # the tiny preset at seed 0 continues it greedily with 3 tokens and <eos>
    engine.add_request(request("r", prompt, SamplingParams(temperature=0, max_new_tokens=20)))
    final = run(engine)["r"]
    assert final.tokens.token_ids == hf_greedy(tiny, prompt, 20, stop_at_eos=True)
    assert final.tokens.token_ids[-1] == tiny.tokenizer.eos_token_id
    assert final.finish_reason == FinishReason.STOP


def test_logprobs_match_a_reference_forward(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    prompts = {"greedy": encode(tiny, PROMPTS[1]), "sampled": encode(tiny, PROMPTS[3])}
    engine.add_request(request("greedy", prompts["greedy"]))
    sampled = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=16, seed=3)
    engine.add_request(request("sampled", prompts["sampled"], sampled))
    finals = run(engine)
    for request_id, temperature, top_k in [("greedy", 1.0, 0), ("sampled", 0.7, 20)]:
        tokens = finals[request_id].tokens
        with torch.no_grad():
            logits = tiny.model(torch.tensor([prompts[request_id] + tokens.token_ids])).logits[0]
        logits = logits[len(prompts[request_id]) - 1 : -1] / temperature
        if top_k:
            logits = logits.masked_fill(logits < logits.topk(top_k).values[:, -1:], float("-inf"))
        expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(tokens.logprobs), expected[:, 0], atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_alone_or_in_a_batch(tiny: LoadedModel) -> None:
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20, seed=11)
    prompt = encode(tiny, PROMPTS[0])
    alone = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    alone.add_request(request("r", prompt, sampling))
    batched = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    batched.add_request(request("other", encode(tiny, PROMPTS[1]), SamplingParams(seed=1)))
    batched.add_request(request("r", prompt, sampling))
    tokens = run(alone)["r"].tokens.token_ids
    assert run(batched)["r"].tokens.token_ids == tokens
    reseeded = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    reseeded.add_request(request("r", prompt, SamplingParams(max_new_tokens=20, seed=12)))
    assert run(reseeded)["r"].tokens.token_ids != tokens


def test_top_k_1_equals_greedy(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    engine.add_request(request("greedy", encode(tiny, PROMPTS[3])))
    top1 = SamplingParams(temperature=1.3, top_k=1, max_new_tokens=24)
    engine.add_request(request("top1", encode(tiny, PROMPTS[3]), top1))
    finals = run(engine)
    assert finals["top1"].tokens.token_ids == finals["greedy"].tokens.token_ids


def test_stop_token_ends_with_stop_and_is_kept(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[1])
    reference = hf_greedy(tiny, prompt, 24)
    stop = reference[6]
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    engine.add_request(request("r", prompt, SamplingParams(temperature=0, stop_token_ids=(stop,))))
    final = run(engine)["r"]
    assert final.tokens.token_ids == reference[: reference.index(stop) + 1]
    assert final.finish_reason == FinishReason.STOP


def test_stop_string_ends_with_stop_and_is_cut_from_the_text(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[1])
    reference_text = tiny.tokenizer.decode(hf_greedy(tiny, prompt, 24), skip_special_tokens=True)
    stop = reference_text[8:10]
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    engine.add_request(request("r", prompt, SamplingParams(temperature=0, stop=("never", stop))))
    final = run(engine)["r"]
    assert final.finish_reason == FinishReason.STOP
    assert final.text == reference_text[: reference_text.index(stop)]
    # Tokens are not trimmed: they run up to and including the one that completed the stop string.
    assert tiny.tokenizer.decode(final.tokens.token_ids, skip_special_tokens=True).endswith(stop)


def test_max_new_tokens_ends_with_length(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    engine.add_request(request("one", encode(tiny, "a"), SamplingParams(max_new_tokens=1)))
    engine.add_request(request("seven", encode(tiny, "b"), SamplingParams(max_new_tokens=7)))
    finals = run(engine)
    assert [len(finals[r].tokens) for r in ("one", "seven")] == [1, 7]
    assert {finals[r].finish_reason for r in ("one", "seven")} == {FinishReason.LENGTH}


def test_abort_frees_the_row_for_the_next_request(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, EngineSettings(max_running=1, ignore_eos=True))
    long = SamplingParams(temperature=0, max_new_tokens=200)
    for request_id in ("first", "second", "third"):
        engine.add_request(request(request_id, encode(tiny, PROMPTS[0]), long))
    engine.step()
    engine.step()
    assert (engine.stats().running, engine.stats().queued) == (1, 2)
    assert engine.abort("first")
    assert engine.abort("third")
    assert not engine.abort("first")  # already being aborted
    assert not engine.abort("unknown")
    finals: dict[str, GenerationUpdate] = {}
    collect(engine.step(), finals)
    assert finals["first"].finish_reason == FinishReason.ABORT
    assert len(finals["first"].tokens) == 2  # what it had generated before the abort
    assert finals["third"].tokens.token_ids == []
    assert (engine.stats().running, engine.stats().queued) == (1, 0)  # "second" took the row
    engine.abort("second")
    engine.step()
    assert not engine.has_work


def test_full_queue_raises_resource_exhausted(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, EngineSettings(max_running=1, max_queued=2))
    for i in range(2):
        engine.add_request(request(f"r{i}", encode(tiny, "a")))
    with pytest.raises(ResourceExhausted):
        engine.add_request(request("r2", encode(tiny, "a")))
    assert (engine.limits.max_running, engine.stats().max_queued) == (1, 2)


def test_streamed_updates_add_up_to_the_completion(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    engine.add_request(GenerationRequest("r", encode(tiny, PROMPTS[2]), GREEDY, stream_tokens=True))
    updates = []
    while engine.has_work:
        updates += engine.step()
    assert [len(u.tokens) for u in updates] == [1] * GREEDY.max_new_tokens
    assert [u.finish_reason for u in updates[:-1]] == [None] * (len(updates) - 1)
    streamed = [token for u in updates for token in u.tokens.token_ids]
    assert streamed == hf_greedy(tiny, encode(tiny, PROMPTS[2]), GREEDY.max_new_tokens)
    assert updates[-1].text == tiny.tokenizer.decode(streamed, skip_special_tokens=True)


def test_weight_swap_mid_generation_keeps_the_sequence_and_tags_versions() -> None:
    old, new = build_preset("tiny", seed=0), build_preset("tiny", seed=1)
    new_weights = new.model.state_dict()
    prompt = encode(old, PROMPTS[3])
    expected_before = hf_greedy(old, prompt, 5)
    engine = InferenceEngine(old.model, old.tokenizer, NO_EOS, weight_version=4)
    engine.add_request(request("r", prompt))
    for _ in range(5):
        engine.step()
    engine.stage_weights(new_weights, version=5)
    tokens = run(engine)["r"].tokens

    assert tokens.versions == [4] * 5 + [5] * (GREEDY.max_new_tokens - 5)
    assert tokens.token_ids[:5] == expected_before
    # Not restarted: the new weights continue on top of the KV cache the old weights built.
    reference = build_preset("tiny", seed=0).model
    assert tokens.token_ids == greedy_with_swap(reference, prompt, 5, new_weights, GREEDY.max_new_tokens)
    assert engine.weight_version == 5


def greedy_with_swap(
    model: PreTrainedModel, prompt: list[int], swap_after: int, weights: dict[str, torch.Tensor], n: int
) -> list[int]:
    """HF forward passes sharing one DynamicCache, with the weights replaced after `swap_after` tokens."""
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            if len(tokens) == swap_after:
                model.load_state_dict(weights)
            logits = model(input_ids=inputs, use_cache=True, **{cache_argument(model): cache}).logits
            tokens.append(int(logits[0, -1].argmax()))
            inputs = torch.tensor([[tokens[-1]]])
    return tokens


def test_stage_weights_rejects_unknown_names_wrong_shapes_and_stale_versions(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, weight_version=3)
    with pytest.raises(InvalidArgument) as unknown:
        engine.stage_weights({"no.such.weight": torch.zeros(1)}, version=4)
    assert unknown.value.violations[0].field == "named_tensors[no.such.weight]"
    with pytest.raises(InvalidArgument, match="shape"):
        engine.stage_weights([("lm_head.weight", torch.zeros(2, 2))], version=4)
    with pytest.raises(FailedPrecondition):
        engine.stage_weights({}, version=3)
    assert engine.weight_version == 3


OK_PROMPT = [1, 5]


@pytest.mark.parametrize(
    ("request_id", "prompt", "sampling", "field"),
    [
        ("", OK_PROMPT, {}, "request_id"),
        ("r", [], {}, "prompt_token_ids"),
        ("r", [1, 5000], {}, "prompt_token_ids[1]"),
        ("r", [5] * 1024, {}, "prompt_token_ids"),
        ("r", OK_PROMPT, {"max_new_tokens": 0}, "sampling.max_new_tokens"),
        ("r", OK_PROMPT, {"max_new_tokens": 65}, "sampling.max_new_tokens"),
        ("r", [5] * 1000, {"max_new_tokens": 30}, "sampling.max_new_tokens"),
        ("r", OK_PROMPT, {"temperature": -1.0}, "sampling.temperature"),
        ("r", OK_PROMPT, {"temperature": float("nan")}, "sampling.temperature"),
        ("r", OK_PROMPT, {"top_p": 0.0}, "sampling.top_p"),
        ("r", OK_PROMPT, {"top_k": -1}, "sampling.top_k"),
        ("r", OK_PROMPT, {"stop_token_ids": (2, -1)}, "sampling.stop_token_ids[1]"),
        ("r", OK_PROMPT, {"stop": ("ok", "€")}, "sampling.stop[1]"),
        ("r", OK_PROMPT, {"stop": ("",)}, "sampling.stop[0]"),
    ],
)
def test_bad_requests_raise_invalid_argument_naming_the_field(
    tiny: LoadedModel, request_id: str, prompt: list[int], sampling: dict[str, object], field: str
) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, EngineSettings(max_new_tokens=64))
    with pytest.raises(InvalidArgument) as raised:
        engine.add_request(request(request_id, prompt, SamplingParams(**{"max_new_tokens": 8} | sampling)))
    assert raised.value.violations[0].field == field
    assert not engine.has_work


def test_duplicate_request_id_is_rejected(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer)
    engine.add_request(request("r", [1, 5]))
    with pytest.raises(InvalidArgument) as raised:
        engine.add_request(request("r", [1, 6]))
    assert raised.value.violations[0].field == "request_id"


def test_stats_report_load_and_throughput(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, EngineSettings(max_running=2, ignore_eos=True))
    for i in range(3):
        engine.add_request(request(f"r{i}", encode(tiny, PROMPTS[i])))
    engine.step()
    stats = engine.stats()
    assert (stats.running, stats.queued, stats.max_running) == (2, 1, 2)
    run(engine)
    stats = engine.stats()
    assert stats.generated_tokens == 3 * GREEDY.max_new_tokens
    assert stats.tokens_per_s > 0


def test_temperatures_near_zero_decode_like_greedy_with_finite_logprobs(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    prompt = encode(tiny, PROMPTS[1])
    for temperature in (1e-45, 1e-38, 1e-7):
        engine.add_request(
            request(f"t{temperature}", prompt, SamplingParams(temperature=temperature, max_new_tokens=12))
        )
    engine.add_request(request("hot", prompt, SamplingParams(temperature=100.0, max_new_tokens=12)))
    finals = run(engine)
    for request_id in ("t1e-45", "t1e-38", "t1e-07", "hot"):
        assert finals[request_id].finish_reason == FinishReason.LENGTH
        assert all(math.isfinite(lp) and lp <= 0 for lp in finals[request_id].tokens.logprobs)
    assert finals["t1e-45"].tokens.token_ids == hf_greedy(tiny, prompt, 12)


POISON_TEMPERATURE = 0.5  # the only sampled request: the others are greedy


@pytest.mark.parametrize("fault", ["raises", "nan"])
def test_a_request_that_breaks_a_batched_step_fails_alone(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The poisoned request breaks sampling (raising, or NaN logits) from its third token on."""
    real_sample = batch_module.sample
    poisoned_calls = 0

    def sample(logits: torch.Tensor, rows: RowSampling, *args: Any, **kwargs: Any) -> SampledTokens:
        nonlocal poisoned_calls
        poisoned = rows.temperature == POISON_TEMPERATURE
        poisoned_calls += bool(poisoned.any())
        if poisoned.any() and poisoned_calls >= 3:
            if fault == "raises":
                raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
            logits = logits.masked_fill(poisoned[:, None], float("nan"))
        return real_sample(logits, rows, *args, **kwargs)

    monkeypatch.setattr(batch_module, "sample", sample)
    engine = InferenceEngine(tiny.model, tiny.tokenizer, NO_EOS)
    prompts = [encode(tiny, p) for p in PROMPTS[:3]]
    engine.add_request(request("r0", prompts[0]))
    engine.add_request(
        request("bad", encode(tiny, PROMPTS[3]), SamplingParams(temperature=POISON_TEMPERATURE))
    )
    engine.add_request(request("r1", prompts[1]))
    engine.step()
    engine.add_request(request("r2", prompts[2]))  # prefilled alone, while the batch decodes
    finals = run(engine)
    assert isinstance(finals["bad"], FailedUpdate) and finals["bad"].finish_reason == FinishReason.ABORT
    assert "nan" in finals["bad"].error.lower()
    assert len(finals["bad"].tokens) == 2
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].tokens.token_ids == hf_greedy(tiny, prompt, GREEDY.max_new_tokens)
    engine.add_request(request("later", prompts[0]))
    assert run(engine)["later"].tokens.token_ids == finals["r0"].tokens.token_ids
