"""The coordinator's trainer stream settles a run: once every sample is trained, it asks for
checkpoints until one holds them all, even when the first one asked for lands before the last step;
and a flush lost with a broken stream is sent again after the resend."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from pathlib import Path

import pytest

from pipelinerl.common.errors import Unavailable
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.coordinator import submitter as submitter_module
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.submitter import TrainerSubmitter
from pipelinerl.trainer.client import Flush
from pipelinerl.trainer.types import Disposition, SampleAck


class LateStepTrainer:
    """Buffers samples; on a flush with a checkpoint, checkpoints what is trained so far and only
    then takes the step that was due (a checkpoint asked for while a step is under way)."""

    def __init__(self) -> None:
        self.checkpoints: list[int] = []

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        version, buffered = 0, []
        async for item in batches:
            if not isinstance(item, Flush):
                buffered += item
                yield [SampleAck(s.sample_id, Disposition.ACCEPTED, version) for s in item], self.durable
                continue
            if item.checkpoint and (not self.checkpoints or self.checkpoints[-1] != version):
                self.checkpoints.append(version)
            acks = []
            if buffered:
                version += 1
                acks = [SampleAck(s.sample_id, Disposition.TRAINED, version) for s in buffered]
                buffered = []
            yield acks, self.durable

    @property
    def durable(self) -> int:
        return self.checkpoints[-1] if self.checkpoints else -1


SAMPLE = Sample("s0", "g0", [1, 2], TokenSequence([3], [-0.5], [0]), 1.0)


@contextlib.asynccontextmanager
async def submitting(trainer: object, tmp_path: Path) -> AsyncIterator[TrainerSubmitter]:
    """A started submitter streaming to `trainer` (a stand-in: the stream is all it uses), on a
    journal in `tmp_path`; closed after."""
    journal = Journal(tmp_path / "journal.sqlite")
    submitter = TrainerSubmitter(trainer, journal)  # type: ignore[arg-type]
    submitter.start()
    try:
        yield submitter
    finally:
        await submitter.close()
        journal.close()


async def test_settle_asks_again_until_a_checkpoint_holds_the_last_step(tmp_path: Path) -> None:
    trainer = LateStepTrainer()
    async with submitting(trainer, tmp_path) as submitter:
        submitter.send([SAMPLE])
        await asyncio.wait_for(submitter.settle(), timeout=5)
    assert trainer.checkpoints == [0, 1]  # the first came before the step, the second holds it
    assert submitter.durable_version == 1


class RestartingTrainer:
    """Trains only on a flush. Its first stream breaks as soon as it has received a flush, with
    what it buffered untrained (a trainer killed before the step); later streams are well."""

    def __init__(self) -> None:
        self.streams = 0

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        self.streams += 1
        buffered: list[Sample] = []
        async for item in batches:
            if not isinstance(item, Flush):
                buffered += item
                yield [SampleAck(s.sample_id, Disposition.ACCEPTED, 0) for s in item], -1
            elif self.streams == 1:
                raise Unavailable("the trainer was killed")
            else:
                yield [SampleAck(s.sample_id, Disposition.TRAINED, 1) for s in buffered], -1
                buffered = []


async def test_a_flush_lost_with_its_stream_is_sent_again_after_the_resend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's only flush went down with the stream: the samples resent to the restarted trainer
    would wait for a step that nothing asks for (a run whose groups all wait on the trainer
    dispatches nothing more, so it sends no other flush)."""
    monkeypatch.setattr(submitter_module, "RECONNECT_S", 0.01)
    trainer = RestartingTrainer()
    async with submitting(trainer, tmp_path) as submitter:
        [future] = submitter.send([SAMPLE]).values()
        submitter.flush()
        ack = await asyncio.wait_for(future, timeout=5)
    assert ack.disposition is Disposition.TRAINED and trainer.streams == 2
