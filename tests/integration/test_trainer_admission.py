"""The real trainer service against samples the learner cannot train: they are rejected on arrival
naming the field, their groups still complete, a step that fails skips the group it fails on, and a
learner that keeps failing turns health NOT_SERVING instead of silently training nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipelinerl.common.errors import Unavailable
from pipelinerl.common.model import build_preset
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.trainer.__main__ import build
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.trainer.config import LagPolicy, LearnerConfig, TrainerSettings
from pipelinerl.trainer.learner import StepMetrics, TorchLearner
from pipelinerl.trainer.lineage import Lost
from pipelinerl.trainer.server import registration
from pipelinerl.trainer.trainer import MAX_FAILED_GROUPS, Trainer
from pipelinerl.trainer.types import Disposition, SampleAck
from pipelinerl.weights.publisher import WeightPublisher
from pipelinerl.weights.settings import PublisherSettings
from tests.integration.test_trainer_loop import group

pytestmark = pytest.mark.slow

VOCAB = len(build_tokenizer())  # the tiny preset's
CONTEXT = 1024


async def submit(address: str, *batches: Sequence[Sample], timeout_s: float = 60) -> list[SampleAck]:
    """Every ack of `batches`, sent on one stream; fails if some accepted sample never gets a final one."""

    async def requests() -> AsyncIterator[Sequence[Sample]]:
        for batch in batches:
            yield batch

    async with TrainerClient(address) as client, asyncio.timeout(timeout_s):
        return [a async for a in client.submit(requests())]


def final(acks: list[SampleAck]) -> dict[str, SampleAck]:
    return {a.sample_id: a for a in acks if a.disposition.final}


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return response.status


def with_prompt(sample: Sample, prompt: list[int]) -> Sample:
    return replace(sample, prompt_token_ids=prompt)


async def test_samples_the_model_cannot_take_are_rejected_naming_the_field_and_training_goes_on(
    tmp_path: Path,
) -> None:
    server = await build(TrainerSettings(port=0, run_id="t", samples_per_step=7, broadcast_backend="none"))
    await server.start()
    try:
        big, neg, long = group("big", 0, [0, 1]), group("neg", 0, [0, 1]), group("long", 0, [0, 1])
        big[0] = with_prompt(big[0], [1, 10, 11, VOCAB])
        neg[0] = with_prompt(neg[0], [1, -3])
        long[0] = with_prompt(long[0], [1] * CONTEXT)  # + 2 completion tokens: over the context
        acks = final(
            await submit(server.address, group("a", 0, [0, 1]), big, neg, long, group("b", 0, [0, 1]))
        )

        fields = {
            sample_id: ack.error.violations[0].field
            for sample_id, ack in acks.items()
            if ack.disposition is Disposition.REJECTED and ack.error is not None
        }
        assert fields == {
            "big-0": "samples[0].prompt_token_ids[3]",
            "neg-0": "samples[0].prompt_token_ids[1]",
            "long-0": "samples[0].completion.token_ids",
        }
        assert all(acks[s].error.code == "INVALID_ARGUMENT" for s in fields)  # type: ignore[union-attr]
        # Their groups completed with the valid members, which trained with the others.
        trained = {s for s, a in acks.items() if a.disposition is Disposition.TRAINED}
        assert trained == {"a-0", "a-1", "b-0", "b-1", "big-1", "neg-1", "long-1"}
        async with TrainerClient(server.address) as client:
            status = await client.status()
        assert (status.version.version, status.rejected_samples) == (1, 3)
        assert await health(server.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=1)


async def test_a_group_with_a_rejected_member_trains_its_other_members(tmp_path: Path) -> None:
    server = await build(TrainerSettings(port=0, run_id="t", samples_per_step=2, broadcast_backend="none"))
    await server.start()
    try:
        # A future version is rejected: the group still completes with its other two members.
        mixed = group("mixed", 0, [0, 1, 0])
        mixed[0] = replace(mixed[0], completion=TokenSequence([12, 13], [-1.0, -1.5], [0, 5]))
        acks = final(await submit(server.address, mixed))
        assert {s: a.disposition for s, a in acks.items()} == {
            "mixed-0": Disposition.REJECTED, "mixed-1": Disposition.TRAINED, "mixed-2": Disposition.TRAINED,
        }  # fmt: skip
        # A member the servicer cannot even convert (a positive logprob) counts too, and the field
        # named is its index in the request.
        broken = group("broken", 1, [0, 0, 1])
        broken[1] = replace(broken[1], completion=TokenSequence([12, 13], [-1.0, 0.5], [1, 1]))
        acks = final(await submit(server.address, broken))
        assert {s: a.disposition for s, a in acks.items()} == {
            "broken-0": Disposition.TRAINED,
            "broken-1": Disposition.REJECTED,
            "broken-2": Disposition.TRAINED,
        }
        assert acks["broken-1"].error.violations[0].field == "samples[1].completion.logprobs"  # type: ignore[union-attr]
    finally:
        await server.stop(grace=1)


async def test_a_group_resent_after_a_drop_counts_each_member_once(tmp_path: Path) -> None:
    server = await build(
        TrainerSettings(
            port=0,
            run_id="t",
            samples_per_step=2,
            max_lag=0,
            lag_policy=LagPolicy.DROP,
            broadcast_backend="none",
        )
    )
    await server.start()
    try:
        assert (
            final(await submit(server.address, group("a", 0, [0, 1])))["a-0"].disposition
            is Disposition.TRAINED
        )
        # At version 1, a member of version 0 is dropped; resent, it must not stand for the missing member.
        stale, fresh = group("g", 0, [0, 1, 0]), group("g", 1, [0, 1, 0])
        acks = final(await submit(server.address, [stale[0]], [stale[0]], fresh[1:]))
        assert {s: a.disposition for s, a in acks.items()} == {
            "g-0": Disposition.DROPPED, "g-1": Disposition.TRAINED, "g-2": Disposition.TRAINED,
        }  # fmt: skip
    finally:
        await server.stop(grace=1)


class FailingLearner(TorchLearner):
    """Raises in `step` when a sample id starts with one of `poison` (every step: poison "")."""

    def __init__(self, poison: tuple[str, ...]) -> None:
        super().__init__(build_preset("tiny", seed=0).model, LearnerConfig(lr=1e-3))
        self.poison = poison
        self.steps = 0

    def step(self, samples: Sequence[Sample], current_version: int, lost: Lost = ()) -> StepMetrics:
        self.steps += 1
        if any(s.sample_id.startswith(self.poison) for s in samples):
            raise RuntimeError("CUDA error: device-side assert triggered")
        return super().step(samples, current_version, lost)


async def serve(learner: TorchLearner, samples_per_step: int) -> tuple[GrpcServer, Trainer]:
    publisher = WeightPublisher(PublisherSettings(broadcast_backend="none"), run_id="t")
    await publisher.start()
    loop = TrainerSettings(
        samples_per_step=samples_per_step, max_lag=4, lag_policy=LagPolicy.DROP, max_buffered_samples=64
    )
    trainer = Trainer(learner, publisher, loop, on_halt=lambda reason: server.set_not_serving(reason))
    server = GrpcServer(
        ServiceSettings(port=0, drain_seconds=1),
        [registration(trainer)],
        on_close=[trainer.close, publisher.close],
    )
    await trainer.start()
    await server.start()
    return server, trainer


async def test_a_group_a_step_fails_on_is_rejected_and_the_others_train() -> None:
    learner = FailingLearner(poison=("p-",))
    server, _ = await serve(learner, samples_per_step=8)
    try:
        groups = [group(g, 0, [0, 1]) for g in ("a", "p", "b", "c")]
        acks = final(await submit(server.address, *groups))
        assert {s for s, a in acks.items() if a.disposition is Disposition.REJECTED} == {"p-0", "p-1"}
        assert acks["p-0"].error is not None and "device-side assert" in acks["p-0"].error.message
        assert {s for s, a in acks.items() if a.disposition is Disposition.TRAINED} == {
            "a-0", "a-1", "b-0", "b-1", "c-0", "c-1",
        }  # fmt: skip
        assert await health(server.address) == health_pb2.HealthCheckResponse.SERVING
        # Training goes on after the failure.
        acks = final(await submit(server.address, *(group(g, 0, [0, 1]) for g in "defg")))
        assert all(a.disposition is Disposition.TRAINED for a in acks.values())
    finally:
        await server.stop(grace=1)


async def test_a_learner_that_keeps_failing_turns_health_not_serving() -> None:
    learner = FailingLearner(poison=("",))
    server, _ = await serve(learner, samples_per_step=2)
    try:
        groups = [group(f"g{i}", 0, [0, 1]) for i in range(MAX_FAILED_GROUPS)]
        acks = final(await submit(server.address, *groups))
        assert all(a.disposition is Disposition.REJECTED for a in acks.values()) and len(acks) == 6
        async with asyncio.timeout(10):
            while await health(server.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
                await asyncio.sleep(0.05)
        with pytest.raises(Unavailable):
            await submit(server.address, group("late", 0, [0, 1]))
    finally:
        await server.stop(grace=1)
