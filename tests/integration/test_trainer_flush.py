"""A flush is honoured whenever the client that sent it has seen the last step's acks: a flush that
arrives while the step's checkpoint is still being written is not lost (the client, released by
those acks, has nothing else to send and asks only once)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipelinerl.common.model import build_preset
from pipelinerl.trainer.config import LearnerConfig, TrainerSettings
from pipelinerl.trainer.learner import TorchLearner
from pipelinerl.trainer.trainer import Trainer
from pipelinerl.trainer.types import Disposition, SampleAck
from pipelinerl.weights.publisher import WeightPublisher
from pipelinerl.weights.settings import PublisherSettings
from tests.integration.test_trainer_loop import group

pytestmark = pytest.mark.slow


async def test_a_flush_sent_on_a_steps_acks_trains_the_partial_step_held(tmp_path: Path) -> None:
    publisher = WeightPublisher(PublisherSettings(broadcast_backend="none"), run_id="t")
    await publisher.start()
    learner = TorchLearner(build_preset("tiny", seed=0).model, LearnerConfig(lr=1e-3))
    settings = TrainerSettings(
        samples_per_step=4, checkpoint_dir=tmp_path / "checkpoints", checkpoint_every=1
    )
    trainer = Trainer(learner, publisher, settings)
    await trainer.start()
    acks: dict[str, SampleAck] = {}
    flushes: list[asyncio.Task[None]] = []

    def on_ack(ack: SampleAck) -> None:
        acks[ack.sample_id] = ack
        if ack.sample_id == "a-0" and ack.disposition is Disposition.TRAINED:
            flushes.append(asyncio.create_task(trainer.flush(checkpoint=False)))

    try:
        # A full step (group a) and a group of half a step (b), which waits for more or a flush.
        await trainer.admit([*group("a", 0, [0, 1, 0, 1]), *group("b", 0, [0, 1])], on_ack)
        async with asyncio.timeout(30):
            while not all(s in acks and acks[s].disposition.final for s in ("b-0", "b-1")):
                await asyncio.sleep(0.05)
    finally:
        await trainer.close()
        await publisher.close()
    assert acks["b-0"].disposition is Disposition.TRAINED and acks["b-0"].version == 2
