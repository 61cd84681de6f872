"""Requests pinned to one weight version on the built-in engine: admitted only at the version held,
every token of theirs from that version while newer versions arrive and wait, the newest swapped
in once the last pinned request ends or is aborted, and a receiver never held up meanwhile."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument
from pipelinerl.common.model import LoadedModel, build_preset
from pipelinerl.common.types import FinishReason, SamplingParams, WeightVersion
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.pinning import VersionNotHeld
from pipelinerl.inference.runner import EngineRunner
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate
from pipelinerl.weights import buckets as bucketing
from tests.unit.test_engine import hf_greedy

PROMPT = [1, 10, 11, 12, 13]
NO_EOS = EngineSettings(ignore_eos=True)


def greedy(request_id: str, n: int, weight_version: int | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id, PROMPT, SamplingParams(temperature=0, max_new_tokens=n), weight_version=weight_version
    )


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in build_preset("tiny", seed=seed).model.named_parameters()}


def step_until_done(engine: InferenceEngine, request_id: str, finals: dict[str, GenerationUpdate]) -> None:
    while request_id not in finals:
        finals.update((u.request_id, u) for u in engine.step() if u.finish_reason is not None)


def holds(engine: InferenceEngine, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, expected[name]) for name, p in engine.model.named_parameters())


@pytest.fixture
def fresh() -> LoadedModel:
    """Its own model: the engine swaps weights into it in place."""
    return build_preset("tiny", seed=0)


def test_a_pinned_request_at_another_version_is_refused_naming_the_version_held(fresh: LoadedModel) -> None:
    engine = InferenceEngine(fresh.model, fresh.tokenizer, NO_EOS, weight_version=3)
    with pytest.raises(VersionNotHeld) as refused:
        engine.add_request(greedy("old", 4, weight_version=2))
    assert refused.value.held_version == 3
    assert isinstance(refused.value, FailedPrecondition) and "holds version 3" in refused.value.message
    with pytest.raises(InvalidArgument) as negative:
        engine.add_request(greedy("negative", 4, weight_version=-1))
    assert negative.value.violations[0].field == "weight_version"

    # A version staged for the next step is the one a request admitted now would get.
    assert engine.stage_weights(weights(1), version=4) is True
    with pytest.raises(VersionNotHeld) as refused:
        engine.add_request(greedy("stale", 4, weight_version=3))
    assert refused.value.held_version == 4
    engine.add_request(greedy("next", 4, weight_version=4))
    finals: dict[str, GenerationUpdate] = {}
    step_until_done(engine, "next", finals)
    assert finals["next"].tokens.versions == [4] * 4
    assert not engine.has_work


def test_versions_received_during_a_pinned_request_wait_and_only_the_newest_is_swapped_in(
    fresh: LoadedModel,
) -> None:
    expected_pinned = hf_greedy(build_preset("tiny", seed=0), PROMPT, 20)
    engine = InferenceEngine(fresh.model, fresh.tokenizer, NO_EOS)
    engine.add_request(greedy("eval", 20, weight_version=0))
    engine.add_request(greedy("train", 40))
    finals: dict[str, GenerationUpdate] = {}
    for _ in range(3):
        engine.step()
    received = {version: weights(version) for version in (1, 2, 3)}
    for version, tensors in received.items():
        buffers = {name: t.clone() for name, t in tensors.items()}
        assert engine.stage_weights(buffers, version) is False  # copied: the caller may reuse them
        for buffer in buffers.values():
            buffer.zero_()  # as a receiver reusing its buffers for the next version would
        engine.step()
    assert engine.weight_version == 0 and engine.stats().pinned_waits == 3

    step_until_done(engine, "eval", finals)
    assert finals["eval"].tokens.versions == [0] * 20
    assert finals["eval"].tokens.token_ids == expected_pinned  # the weights never changed under it
    assert engine.weight_version == 0  # the swap comes at the next step

    step_until_done(engine, "train", finals)
    versions = finals["train"].tokens.versions
    switch = versions.index(3)
    assert versions == [0] * switch + [3] * (40 - switch)  # 1 and 2 were never swapped in
    assert switch == 20  # beside the pinned request, on the held version; then at once on the newest
    assert engine.weight_version == 3 and holds(engine, received[3])
    stats = engine.stats()
    assert stats.pinned_waits == 3 and stats.pinned_wait_s > 0


@pytest.mark.parametrize("running", [True, False], ids=["running", "queued"])
def test_aborting_the_pinned_request_releases_the_hold(fresh: LoadedModel, running: bool) -> None:
    engine = InferenceEngine(fresh.model, fresh.tokenizer, NO_EOS)
    engine.add_request(greedy("eval", 30, weight_version=0))
    if running:
        engine.step()
    new = weights(1)
    assert engine.stage_weights(new, version=1) is False
    engine.step()
    assert engine.weight_version == 0

    assert engine.abort("eval")
    finals: dict[str, GenerationUpdate] = {}
    step_until_done(engine, "eval", finals)
    assert finals["eval"].finish_reason is FinishReason.ABORT
    assert set(finals["eval"].tokens.versions) <= {0}
    assert engine.has_work  # the waiting version, swapped in at the next step
    engine.step()
    assert engine.weight_version == 1 and holds(engine, new)
    assert not engine.has_work


def test_while_a_version_waits_new_pinned_requests_get_the_held_one(fresh: LoadedModel) -> None:
    """While a version waits behind pinned requests, new pinned requests still get the held one."""
    engine = InferenceEngine(fresh.model, fresh.tokenizer, NO_EOS)
    engine.add_request(greedy("first", 6, weight_version=0))
    engine.stage_weights(weights(1), version=1)
    with pytest.raises(VersionNotHeld) as refused:
        engine.add_request(greedy("too-new", 6, weight_version=1))
    assert refused.value.held_version == 0
    engine.add_request(greedy("second", 12, weight_version=0))
    finals: dict[str, GenerationUpdate] = {}
    step_until_done(engine, "second", finals)
    assert {v for f in finals.values() for v in f.tokens.versions} == {0}
    engine.step()
    assert engine.weight_version == 1


async def test_apply_weights_returns_at_once_while_a_pinned_request_runs(fresh: LoadedModel) -> None:
    """The receiver's call does not wait for the pinned request: it may reuse its buckets at once,
    and the version lands when the request ends."""
    engine = InferenceEngine(fresh.model, fresh.tokenizer, NO_EOS)
    runner = EngineRunner(engine, "tiny")
    swaps: list[float] = []
    runner.on_swap = swaps.append
    runner.start()
    try:
        versions: list[int] = []
        started = asyncio.Event()

        evaluation_request = GenerationRequest(
            "eval", PROMPT, SamplingParams(temperature=0, max_new_tokens=600), True, weight_version=0
        )

        async def evaluate() -> list[int]:
            async for update in runner.generate(evaluation_request):
                versions.extend(update.tokens.versions)
                started.set()
            return versions

        new = weights(1)
        buckets, layout = bucketing.pack(new, bucketing.plan_layout(new.items()))
        evaluation = asyncio.create_task(evaluate())
        await started.wait()
        await asyncio.wait_for(runner.apply_weights(WeightVersion(1), layout, buckets), timeout=30)
        assert not evaluation.done() and engine.weight_version == 0 and swaps == []
        for bucket in buckets:
            bucket.zero_()  # the receiver's next version overwrites them

        assert await evaluation == [0] * 600
        for _ in range(200):
            if engine.weight_version == 1 and swaps:
                break
            await asyncio.sleep(0.01)
        assert engine.weight_version == 1 and holds(engine, new) and len(swaps) == 1
        assert runner.status().pinned_waits == 1
    finally:
        await runner.stop()
