"""The built-in engine on CUDA generates what HF generates: the same greedy tokens in float32
with requests joining mid-flight, and in bfloat16 tokens and logprobs that a teacher-forced HF
forward agrees with."""

from __future__ import annotations

import pytest
import torch

from pipelinerl.common.model import LoadedModel, build_preset
from pipelinerl.common.types import FinishReason, SamplingParams
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate
from tests.gpu import needs_cuda

pytestmark = needs_cuda

PROMPTS = ["12+34=", "The quick brown fox jumps over", "a", "What is 7 * 6? Let me think.", "x = y"]
LENGTHS = [48, 9, 33, 5, 21]


def on_cuda(dtype: torch.dtype) -> LoadedModel:
    loaded = build_preset("small", seed=0, dtype=dtype)
    loaded.model.to("cuda")
    return loaded


def generate_all(loaded: LoadedModel) -> dict[str, GenerationUpdate]:
    """Every prompt, greedy, joining a batch of 3 rows one wave at a time."""
    settings = EngineSettings(device="cuda", max_running=3, ignore_eos=True)
    engine = InferenceEngine(loaded.model, loaded.tokenizer, settings)
    finals: dict[str, GenerationUpdate] = {}
    for wave in ([0, 1], [2], [3], [4]):
        for i in wave:
            prompt = loaded.tokenizer(PROMPTS[i])["input_ids"]
            sampling = SamplingParams(temperature=0, max_new_tokens=LENGTHS[i])
            engine.add_request(GenerationRequest(f"r{i}", prompt, sampling))
        finals.update((u.request_id, u) for u in engine.step() if u.finish_reason is not None)
    while engine.has_work:
        finals.update((u.request_id, u) for u in engine.step() if u.finish_reason is not None)
    return finals


def test_float32_greedy_tokens_equal_hf_generate() -> None:
    loaded = on_cuda(torch.float32)
    finals = generate_all(loaded)
    for i, prompt_text in enumerate(PROMPTS):
        prompt = loaded.tokenizer(prompt_text)["input_ids"]
        ids = torch.tensor([prompt], device="cuda")
        out = loaded.model.generate(ids, do_sample=False, max_new_tokens=LENGTHS[i], eos_token_id=None)
        assert finals[f"r{i}"].tokens.token_ids == out[0, len(prompt) :].tolist(), prompt_text
        assert finals[f"r{i}"].finish_reason == FinishReason.LENGTH


def test_bfloat16_tokens_and_logprobs_agree_with_a_teacher_forced_hf_forward() -> None:
    """bf16 kernels differ between a padded batch and one sequence, so free-running tokens may part
    at a near-tie; the stated tolerance: each greedy token is HF's argmax wherever HF's top two
    logits are more than 0.1 apart, and its logprobs are within 0.25 nats of HF's (0.05 on average:
    bf16 keeps 8 bits of mantissa, about 0.04 on a logit of 10)."""
    loaded = on_cuda(torch.bfloat16)
    finals = generate_all(loaded)
    for i, prompt_text in enumerate(PROMPTS):
        prompt = loaded.tokenizer(prompt_text)["input_ids"]
        tokens = finals[f"r{i}"].tokens
        with torch.no_grad():
            ids = torch.tensor([prompt + tokens.token_ids], device="cuda")
            logits = loaded.model(ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = torch.tensor(tokens.token_ids, device="cuda")
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1
        assert torch.equal(logits.argmax(-1)[clear], chosen[clear]), prompt_text
        expected = logits.log_softmax(-1).gather(-1, chosen[:, None])[:, 0].cpu()
        difference = (torch.tensor(tokens.logprobs) - expected).abs()
        assert difference.max() < 0.25 and difference.mean() < 0.05, prompt_text


@pytest.mark.parametrize("temperature", [1e-45, 1e-6, 100.0])
def test_sampling_is_finite_over_the_whole_range_on_cuda(temperature: float) -> None:
    loaded = on_cuda(torch.float32)
    engine = InferenceEngine(loaded.model, loaded.tokenizer, EngineSettings(device="cuda", ignore_eos=True))
    sampling = SamplingParams(temperature=temperature, max_new_tokens=16, seed=1)
    engine.add_request(GenerationRequest("r", [1, 14, 15], sampling))
    final = None
    while engine.has_work:
        final = next((u for u in engine.step() if u.finish_reason is not None), final)
    assert final is not None and len(final.tokens.token_ids) == 16
    assert all(lp == lp and lp <= 0 for lp in final.tokens.logprobs)  # no NaN
