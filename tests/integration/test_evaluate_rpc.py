"""The Evaluate RPC's contract over real gRPC. Around a fake core: the set and its sampling reach
the core as sent, the result comes back whole, `every_versions` means nothing outside a run, and a
`max_new_tokens` left unset (no run to take it from) is INVALID_ARGUMENT naming the field. Through
the real coordinator process: a set that cannot be read, or a sampling its servers refuse, is
INVALID_ARGUMENT; an environment's set, FAILED_PRECONDITION."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument
from pipelinerl.common.types import SamplingParams
from pipelinerl.coordinator import server as coordinator_server
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.types import EvaluationResult, EvaluationSpec, RunSpec
from tests.fakes import FakeCoordinator
from tests.integration.test_coordinator_start import MAX_NEW_TOKENS, coordinator, coordinator_address  # noqa: F401


async def test_evaluate_sends_the_set_and_returns_the_result_whole(start_server) -> None:
    core = FakeCoordinator()
    address = await start_server(coordinator_server.registration(core))
    spec = EvaluationSpec("data/held_out.jsonl", 0, 4, SamplingParams(max_new_tokens=7, temperature=0.5), 9)
    async with CoordinatorClient(address) as client:
        result = await client.evaluate(spec, timeout_s=10)
    assert core.evaluated == [spec]
    finished = datetime(2026, 1, 1, tzinfo=UTC)
    assert result == EvaluationResult(
        spec.dataset, 5, 1, 4, 0.5, 0.5, 0.75, 3.0, 0.25, finished, 1.5, "fake:1"
    )


async def test_max_new_tokens_must_be_set_outside_a_run_and_every_versions_only_in_one(start_server) -> None:
    core = FakeCoordinator()
    address = await start_server(coordinator_server.registration(core))
    unset = EvaluationSpec("builtin:copy", 0, 1, SamplingParams(max_new_tokens=0))
    async with CoordinatorClient(address) as client:
        with pytest.raises(InvalidArgument) as refused:
            await client.evaluate(unset, timeout_s=10)
        assert [v.field for v in refused.value.violations] == ["evaluation.sampling.max_new_tokens"]
        run = RunSpec("builtin:copy", evaluations=(unset,))  # a run's set: every N versions, N >= 1
        with pytest.raises(InvalidArgument) as refused:
            await client.start_run(run, timeout_s=10)
        assert [v.field for v in refused.value.violations] == ["spec.evaluations[0].every_versions"]
    assert core.evaluated == [] and core.runs == {}


async def test_the_coordinator_refuses_what_it_cannot_evaluate(coordinator: CoordinatorClient) -> None:  # noqa: F811
    unknown = EvaluationSpec("builtin:nope", sampling=SamplingParams(max_new_tokens=3))
    with pytest.raises(InvalidArgument, match=r"expected builtin:<copy\|reverse\|sort\|repeat>"):
        await coordinator.evaluate(unknown, timeout_s=30)
    too_long = EvaluationSpec("builtin:copy", sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS + 1))
    with pytest.raises(InvalidArgument) as refused:
        await coordinator.evaluate(too_long, timeout_s=30)
    assert [v.field for v in refused.value.violations] == ["evaluation.sampling.max_new_tokens"]
    episodes = EvaluationSpec("environment:calculator", sampling=SamplingParams(max_new_tokens=3))
    with pytest.raises(FailedPrecondition, match="environment run"):
        await coordinator.evaluate(episodes, timeout_s=30)
