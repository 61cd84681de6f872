"""Which servers an evaluation runs on: the evaluation servers while one is connected (waiting a
moment for those still connecting), the training servers otherwise; and the coordinator's
RegisterInferenceServer puts a server in the pool of its role."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta

import pytest

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.common.types import FinishReason, SamplingParams, TokenSequence
from pipelinerl.coordinator import server as coordinator_server
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.evaluation import Evaluator
from pipelinerl.coordinator.membership import Membership
from pipelinerl.coordinator.tasks import Problem
from pipelinerl.coordinator.types import EvaluationSpec, InferenceRole
from pipelinerl.inference.types import Completion, GenerationRequest
from pipelinerl.reward.types import ScoreItem, ScoreResult, VerifierDetail
from tests.fakes import FakeCoordinator

SPEC = EvaluationSpec("builtin:copy", samples_per_problem=2, sampling=SamplingParams(max_new_tokens=2))
PROBLEMS = [Problem("12=", "12", "exact"), Problem("34=", "34", "exact")]


class _Pool:
    """Servers that answer every prompt with its answer, at the version they hold."""

    def __init__(self, members: Sequence[str] = (), connected: Sequence[str] = (), version: int = 3) -> None:
        self.members = set(members)
        self.connected = dict.fromkeys(connected, version)
        self.served: list[str] = []

    def add(self, address: str) -> None:
        self.members.add(address)

    def remove(self, address: str) -> None:
        self.members.discard(address)

    async def versions(self) -> dict[str, int]:
        return dict(self.connected)

    async def generate(self, request: GenerationRequest, prefer: str = "") -> tuple[str, Completion]:
        assert prefer in self.connected and request.weight_version == self.connected[prefer]
        self.served.append(prefer)
        answer = (request.prompt_text or "").rstrip("=")
        tokens = TokenSequence([1, 2], [-0.1, -0.1], [self.connected[prefer]] * 2)
        return prefer, Completion(request.request_id, [], tokens, answer, FinishReason.STOP)


class _Reward:
    async def score(self, items: Sequence[ScoreItem], timeout_s: float) -> list[ScoreResult]:
        right = [i.completion == i.answer for i in items]
        return [
            ScoreResult(i.sample_id, float(r), [VerifierDetail(i.verifier, float(r), 1.0, "")])
            for i, r in zip(items, right, strict=True)
        ]


async def _evaluate(training: _Pool, evaluation: _Pool | None) -> str:
    evaluator = Evaluator(training, _Reward(), evaluation_pool=evaluation)  # type: ignore[arg-type]
    result = await asyncio.wait_for(evaluator.evaluate(SPEC, PROBLEMS), 10)
    assert result.pass_at_1 == 1.0 and result.weight_version == 3
    return result.server


async def test_an_evaluation_server_takes_every_evaluation_request() -> None:
    training, evaluation = _Pool(["t:1"], ["t:1"]), _Pool(["e:1"], ["e:1"])
    assert await _evaluate(training, evaluation) == "e:1"
    assert evaluation.served == ["e:1"] * 4 and training.served == []


async def test_without_evaluation_servers_the_training_servers_evaluate() -> None:
    training = _Pool(["t:1"], ["t:1"])
    assert await _evaluate(training, _Pool()) == "t:1"
    assert await _evaluate(training, None) == "t:1"


async def test_an_evaluation_server_still_connecting_is_waited_for_a_moment_then_passed_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    training, evaluation = _Pool(["t:1"], ["t:1"]), _Pool(["e:1"])
    monkeypatch.setattr("pipelinerl.coordinator.evaluation.CONNECT_GRACE_S", 0.3)

    async def connect() -> None:
        await asyncio.sleep(0.1)
        evaluation.connected["e:1"] = 3

    connecting = asyncio.create_task(connect())
    assert await _evaluate(training, evaluation) == "e:1"
    await connecting
    del evaluation.connected["e:1"]  # it died: after the grace, the training server evaluates
    assert await _evaluate(training, evaluation) == "t:1"


async def test_registration_puts_a_server_in_the_pool_of_its_role(start_server) -> None:
    training, evaluation = _Pool(), _Pool()
    memberships = {
        InferenceRole.TRAINING: Membership(training),
        InferenceRole.EVALUATION: Membership(evaluation),
    }
    address = await start_server(coordinator_server.registration(FakeCoordinator(), memberships))
    async with CoordinatorClient(address) as client:
        lease = await client.register_inference_server("10.0.0.1:50051", timeout_s=10)
        await client.register_inference_server("10.0.0.2:50051", role=InferenceRole.EVALUATION, timeout_s=10)
        assert timedelta(seconds=lease) == timedelta(seconds=15)
        assert training.members == {"10.0.0.1:50051"} and evaluation.members == {"10.0.0.2:50051"}
        await client.register_inference_server("10.0.0.2:50051", leaving=True, role=InferenceRole.EVALUATION)
        assert evaluation.members == set() and training.members == {"10.0.0.1:50051"}
    only_training = await start_server(
        coordinator_server.registration(FakeCoordinator(), {InferenceRole.TRAINING: Membership(_Pool())})
    )
    async with CoordinatorClient(only_training) as client:
        with pytest.raises(FailedPrecondition, match="no registrations of evaluation servers"):
            await client.register_inference_server("10.0.0.2:50051", role=InferenceRole.EVALUATION)
